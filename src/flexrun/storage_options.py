"""Checkpoint ``storage_options`` handed to a worker in its environment, and the rule that
they never carry a credential.

Owns ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (a JSON object the Kubernetes and pipeline
renderers set from a spec's ``checkpoint.storageOptions`` / ``train.storageOptions``; a
script asks for it with ``Checkpointer(..., storage_options="env")``), the checks a spec's
checkpoint URL and options pass (:func:`check_url`, :func:`check_no_secrets`,
:func:`spec_storage_options`) and their one encoding (:func:`storage_options_json`).
A base module (it imports only ``flexrun.errors``) so that ``train``, ``k8s`` and
``pipeline`` share it. The library reads the variable only when the script asks.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from flexrun.errors import ConfigError

CHECKPOINT_DIR_ENV = "FLEXRUN_CHECKPOINT_DIR"
"""Environment variable naming a worker's checkpoint location: a mounted directory or an
fsspec URL (``s3://bucket/prefix``); scripts pass it to ``Checkpointer``."""

STORAGE_OPTIONS_ENV = "FLEXRUN_CHECKPOINT_STORAGE_OPTIONS"
"""Environment variable holding a worker's checkpoint ``storage_options`` as a JSON object
(set by the Kubernetes and pipeline renderers from ``checkpoint.storageOptions``)."""

_SECRET_KEYS = frozenset(
    {
        "key",
        "secret",
        "password",
        "passwd",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "secret_access_key",
        "session_token",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
        "credentials",
    }
)
_TOKEN_MODES = frozenset({"anon", "cloud", "google_default", "browser", "cache"})


_CREDENTIAL_ADVICE = (
    "never put secrets in a spec: use the store's credential chain (pod/instance "
    "identity, a profile, AWS_* variables from a Kubernetes Secret)"
)
#: Query parameters of a pre-signed or SAS URL: a credential in the URL itself.
_SECRET_QUERY = frozenset(
    {"sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token"}
)
_FSSPEC_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*::)*([A-Za-z][A-Za-z0-9+.-]*)://(.+)$")


def _is_secret_key(name: str) -> bool:
    return name in _SECRET_KEYS or name.endswith(("_secret", "_password", "_key_id"))


def check_url(url: str, where: str, *, error: type[ConfigError] = ConfigError) -> None:
    """Refuse a checkpoint URL that is not an fsspec URL (``proto://...``, chained
    ``simplecache::s3://...`` too) or that embeds a credential (``user:pass@host``, a
    pre-signed or SAS query string).

    Raises:
        ConfigError (or ``error``): ``where: ...`` naming the problem.
    """
    m = _FSSPEC_URL.match(url)
    if m is None or not m.group(2).strip("/"):
        raise error(f"{where}: {url!r} is not an fsspec URL (proto://bucket/prefix)")
    rest = m.group(2)
    authority = rest.split("/", 1)[0]
    if "@" in authority:
        raise error(
            f"{where}: the URL embeds credentials (user:password@...); {_CREDENTIAL_ADVICE}"
        )
    if "?" in rest:
        for name, _ in parse_qsl(rest.split("?", 1)[1], keep_blank_values=True):
            low = name.lower()
            if low in _SECRET_QUERY or _is_secret_key(low) or low == "token":
                raise error(
                    f"{where}: the URL's query parameter {name!r} is a credential; "
                    f"{_CREDENTIAL_ADVICE}"
                )


def spec_storage_options(
    value: object, where: str, *, error: type[ConfigError] = ConfigError
) -> dict[str, Any]:
    """A spec's ``storageOptions``: a mapping with string keys that JSON can carry and
    :func:`check_no_secrets` passes.

    Raises:
        ConfigError (or ``error``): not a mapping, not JSON-encodable, or a credential.
    """
    if not isinstance(value, Mapping):
        raise error(f"{where}: must be a mapping (got {type(value).__name__})")
    options = dict(value)
    try:
        storage_options_json(options)
    except (TypeError, ValueError) as exc:
        raise error(f"{where}: must hold only JSON values (strings, numbers, ...): {exc}") from exc
    check_no_secrets(options, where, error=error)
    return options


def storage_options_json(options: Mapping[str, Any]) -> str:
    """The one encoding of ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS``: compact, sorted keys.

    Raises:
        TypeError, ValueError: a key is not a string or a value is not JSON.
    """
    for key in options:
        if not isinstance(key, str):
            raise TypeError(f"key {key!r} is not a string")
    return json.dumps(options, sort_keys=True, separators=(",", ":"), allow_nan=False)


def check_no_secrets(
    options: Mapping[str, Any], where: str, *, error: type[ConfigError] = ConfigError
) -> None:
    """Refuse ``storage_options`` that carry a credential (they travel in environment
    variables and rendered manifests; credentials belong in the store's own chain: an
    instance or pod identity, a profile, ``AWS_*`` variables from a Secret).

    Raises:
        ConfigError (or ``error``): ``where.path.to.key: looks like a credential`` for a
            key naming one (``secret``, ``password``, ``sas_token`` ...).
    """

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                name = str(k).lower()
                secret = _is_secret_key(name)
                if name == "token" and not (isinstance(v, str) and v in _TOKEN_MODES):
                    secret = True
                if secret:
                    raise error(f"{path}.{k}: looks like a credential; {_CREDENTIAL_ADVICE}")
                walk(v, f"{path}.{k}")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    walk(options, where)


def storage_options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``storage_options`` a launcher handed this worker in
    ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (JSON object; empty when unset).

    Raises:
        ConfigError: not a JSON object, or it carries a credential.
    """
    env = os.environ if environ is None else environ
    raw = env.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{STORAGE_OPTIONS_ENV} is not JSON: {type(exc).__name__}") from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f"{STORAGE_OPTIONS_ENV} must be a JSON object, got {type(value).__name__}"
        )
    check_no_secrets(value, STORAGE_OPTIONS_ENV)
    return value
