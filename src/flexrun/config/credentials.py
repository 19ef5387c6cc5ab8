"""Store credentials: the job secret that signs every store record and the etcd user's
password, read from files or the environment, never from the command line (``ps`` shows
it to every user); and the keep-alive defaults that scale with the job's size.

Owned here so that one place reads secrets, in the documented order
(docs/operator/security.md: ``--rdzv-conf secret_file=`` >
``$FLEXRUN_JOB_SECRET_FILE`` > ``$FLEXRUN_JOB_SECRET``). It does not sign anything:
:mod:`flexrun.store.signed` does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from flexrun.errors import ConfigError

log = logging.getLogger("flexrun")

SECRET_ENV_FILE = "FLEXRUN_JOB_SECRET_FILE"
SECRET_ENV = "FLEXRUN_JOB_SECRET"
ETCD_PASSWORD_ENV_FILE = "FLEXRUN_ETCD_PASSWORD_FILE"
ETCD_PASSWORD_ENV = "FLEXRUN_ETCD_PASSWORD"
MIN_SECRET_BYTES = 16


def read_secret_file(path: str, what: str = "job secret") -> bytes:
    """The contents of a secret file, trailing whitespace stripped.

    A file that group or others can read is accepted with a warning (a Kubernetes Secret
    volume is 0644 unless its ``defaultMode`` says otherwise); ``chmod 600`` silences it.

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    p = Path(path)
    try:
        mode = p.stat().st_mode
        data = p.read_bytes().rstrip()
    except OSError as exc:
        raise ConfigError(f"{what} file {path}: cannot read it ({exc.strerror or exc})") from None
    if not data:
        raise ConfigError(f"{what} file {path} is empty")
    if mode & 0o077:
        log.warning(
            "%s file %s can be read by other users (mode %o): chmod 600 %s",
            what,
            path,
            mode & 0o777,
            path,
        )
    return data


def store_credentials(
    conf: Mapping[str, str], environ: Mapping[str, str]
) -> tuple[dict[str, str], bytes | None, str | None]:
    """Split the job secret and the etcd password out of ``--rdzv-conf``.

    Returns (the remaining conf, the job secret, the etcd password). Sources, first found
    wins: secret: ``secret_file=PATH`` > ``$FLEXRUN_JOB_SECRET_FILE`` > ``$FLEXRUN_JOB_SECRET``;
    etcd password: ``password_file=PATH`` > ``$FLEXRUN_ETCD_PASSWORD_FILE`` >
    ``$FLEXRUN_ETCD_PASSWORD``. A value on the command line (``secret=``, ``password=``)
    is refused: every user of the machine sees it in ``ps``.

    Raises:
        ConfigError: a value given on the command line, an unreadable or short secret.
    """
    rest = dict(conf)
    for key in rest:
        folded = key.strip().lower().replace("-", "_")
        if folded != key and folded in ("secret", "password", "secret_file", "password_file"):
            raise ConfigError(
                f"--rdzv-conf {key}=...: keys are lower case; did you mean {folded}? "
                "(a secret under an unknown key would sit on the command line, unused)"
            )
    for name, instead in (("secret", "secret_file=PATH"), ("password", "password_file=PATH")):
        if name in rest:
            raise ConfigError(
                f"--rdzv-conf {name}=...: a secret on the command line is visible to every user "
                f"in `ps`; use --rdzv-conf {instead} or the environment "
                f"({SECRET_ENV_FILE if name == 'secret' else ETCD_PASSWORD_ENV_FILE})"
            )
    secret: bytes | None = None
    if "secret_file" in rest:
        secret = read_secret_file(rest.pop("secret_file"))
    elif environ.get(SECRET_ENV_FILE):
        secret = read_secret_file(environ[SECRET_ENV_FILE])
    elif environ.get(SECRET_ENV):
        secret = environ[SECRET_ENV].strip().encode()
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the job secret is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
            "(e.g. `openssl rand -hex 32 > secret; chmod 600 secret`)"
        )
    password: str | None = None
    if "password_file" in rest:
        password = _text_password(rest.pop("password_file"))
    elif environ.get(ETCD_PASSWORD_ENV_FILE):
        password = _text_password(environ[ETCD_PASSWORD_ENV_FILE])
    elif environ.get(ETCD_PASSWORD_ENV):
        password = environ[ETCD_PASSWORD_ENV]
    return rest, secret, password


def _text_password(path: str) -> str:
    raw = read_secret_file(path, "etcd password")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"etcd password file {path}: not UTF-8 text (byte {exc.start}); etcd passwords are text"
        ) from None


def generated_secret() -> bytes:
    """A fresh random job secret (``--standalone``: one per run)."""
    import secrets

    return secrets.token_hex(32).encode()


__all__ = [
    "ETCD_PASSWORD_ENV",
    "ETCD_PASSWORD_ENV_FILE",
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "SECRET_ENV_FILE",
    "generated_secret",
    "read_secret_file",
    "store_credentials",
]
