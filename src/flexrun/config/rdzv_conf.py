"""``--rdzv-conf``: flexrun's own keys and torchrun's, mapped onto flexrun's settings.

Owns the meaning of every key (docs/user/options.md describes this module's), the durations'
validation (finite, not negative), and the one warning per unknown key (torchrun ignores
those silently; a typo should not pass unnoticed). Pure: the caller logs the notes.

torchrun's keys and what they become:

========================  ===================================================================
``join_timeout``          the same (600 s): how long a node waits for MIN nodes.
``timeout``               ``join_timeout`` when that is not given (torch's etcd and static
                          backends' total rendezvous timeout; its c10d backend ignores it).
``last_call_timeout``     the same; flexrun's default is 1 s (torchrun: 30 s).
``keep_alive_interval``   ``heartbeat_interval`` (flexrun max(1 s, MAX nodes / 2000 s), torchrun 5 s).
``keep_alive_max_attempt`` ``heartbeat_timeout`` = interval x attempts (a node is lost after
                          that many missed keep-alives; 1 is taken as 1.5 intervals).
``read_timeout``          the store's per-operation timeout (tcp: ``op_timeout_s``; etcd:
                          ``request_timeout``).
``close_timeout``         accepted, no effect: flexrun's close is one compare-and-set.
``is_host``               the same: host the tcp store in this agent or not.
``store_type``            ``tcp`` only (torchrun also has ``file``).
etcd v2 users' keys       ``protocol=https`` -> ``tls=true``; ``ssl_cert``/``cert``,
                          ``ssl_cert_key``/``key``, ``ca_cert``/``cacert``: client TLS files;
                          ``etcd_prefix``: accepted, not used (flexrun's records live in
                          etcd's v3 keyspace under its own per-job keys).
========================  ===================================================================

``heartbeat_timeout`` is flexrun's: a node whose keep-alive is older is lost (torch's key of
that name bounds one keep-alive write).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from flexrun.config.parsing import parse_duration
from flexrun.errors import ConfigError

FLEXRUN_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "heartbeat_interval",
    "heartbeat_timeout",
    "connect_timeout",
    "is_host",
)
TORCHRUN_KEYS = (
    "timeout",
    "read_timeout",
    "close_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "store_type",
    "protocol",
    "etcd_prefix",
    "ssl_cert",
    "ssl_cert_key",
    "ca_cert",
)
ETCD_KEYS = ("cacert", "cert", "key", "tls", "user", "password", "request_timeout")
"""Passed on to flexrun's etcd v3 backend (``flexrun.store.etcd``)."""
CREDENTIAL_KEYS = ("secret_file", "password_file")
"""Read by the job-secret / etcd-password code (:mod:`flexrun.config.credentials`)."""
STORE_TYPES = ("tcp",)
"""torchrun's ``store_type`` values flexrun serves: its c10d store is a tcp store (torchrun's
file store is not supported)."""
_ETCD_RENAMES = {"ssl_cert": "cert", "ssl_cert_key": "key", "ca_cert": "cacert"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedConf:
    """``--rdzv-conf`` resolved: timings, store options, and lines for the log."""

    join_timeout_s: float = 600.0
    last_call_s: float = 1.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    connect_timeout_s: float = 30.0
    read_timeout_s: float | None = None
    """The store's per-operation timeout (None: the backend's default)."""
    is_host: bool | None = None
    backend_conf: Mapping[str, str]
    """What the store backend receives (etcd TLS and auth options)."""
    notes: tuple[str, ...] = ()
    """Info lines: keys accepted without effect."""
    warnings: tuple[str, ...] = ()
    """Warning lines: unknown keys, one each."""


def _bool(conf: Mapping[str, str], key: str) -> bool | None:
    if key not in conf:
        return None
    value = conf[key].strip().lower()
    if value in ("1", "true", "yes", "on", "y"):
        return True
    if value in ("0", "false", "no", "off", "n"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={conf[key]!r}: expected true or false")


def _dur(conf: Mapping[str, str], key: str, *, positive: bool = False) -> float | None:
    if key not in conf:
        return None
    return parse_duration(conf[key], f"--rdzv-conf {key}=", positive=positive)


def parse_rdzv_conf(
    conf: Mapping[str, str],
    *,
    keepalive: tuple[float, float],
    options: Callable[[Mapping[str, str], dict[str, str], float | None, list[str]], None],
) -> ParsedConf:
    """Resolve ``conf`` (from :func:`flexrun.config.parsing.parse_kv`) for one backend
    (:meth:`flexrun.config.backends.Backend.parse_conf`): ``keepalive`` its default
    (heartbeat interval, timeout) for the job's size, ``options`` its own options' parser.

    Raises:
        ConfigError: a bad value (a non-finite or negative duration, a bad boolean,
            conflicting synonyms, an unsupported store type or protocol).
    """
    notes: list[str] = []
    warnings: list[str] = []
    known = set(FLEXRUN_KEYS) | set(TORCHRUN_KEYS) | set(CREDENTIAL_KEYS) | set(ETCD_KEYS)
    for key in conf:
        if key not in known:
            warnings.append(
                f"--rdzv-conf {key}: unknown key, ignored (flexrun's keys: "
                f"{', '.join(FLEXRUN_KEYS)}; torchrun's: {', '.join(TORCHRUN_KEYS)})"
            )
    interval = _dur(conf, "heartbeat_interval", positive=True)
    keep_alive = _dur(conf, "keep_alive_interval", positive=True)
    if interval is not None and keep_alive is not None and interval != keep_alive:
        raise ConfigError(
            "--rdzv-conf heartbeat_interval and keep_alive_interval are the same setting; give one"
        )
    interval = interval if interval is not None else keep_alive
    default_interval, default_timeout = keepalive
    hb_interval = interval if interval is not None else default_interval
    hb_timeout = _dur(conf, "heartbeat_timeout", positive=True)
    if "keep_alive_max_attempt" in conf:
        raw = conf["keep_alive_max_attempt"].strip()
        # (ASCII digits only: str.isdigit() is true for "²", which int() refuses)
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= 1_000_000:
            raise ConfigError(
                f"--rdzv-conf keep_alive_max_attempt={raw[:40]!r}: expected an integer 1-1000000"
            )
        if hb_timeout is None:
            hb_timeout = hb_interval * max(int(raw), 1.5)
    if hb_timeout is None:
        hb_timeout = max(5.0, hb_interval * 3) if interval is not None else default_timeout
    join = _dur(conf, "join_timeout")
    timeout = _dur(conf, "timeout")
    if join is None:
        join = timeout
    last_call = _dur(conf, "last_call_timeout")
    connect = _dur(conf, "connect_timeout", positive=True)
    read = _dur(conf, "read_timeout", positive=True)
    _dur(conf, "close_timeout")
    if "close_timeout" in conf:
        notes.append("--rdzv-conf close_timeout: accepted; flexrun's close is one compare-and-set")
    store_type = conf.get("store_type", "tcp").strip().lower()
    if store_type not in STORE_TYPES:
        raise ConfigError(
            f"--rdzv-conf store_type={conf['store_type']!r}: flexrun's c10d store is a tcp store "
            "(torchrun's file store is not supported)"
        )
    backend_conf = {k: v for k, v in conf.items() if k in ETCD_KEYS or k in CREDENTIAL_KEYS}
    options(conf, backend_conf, read, notes)
    return ParsedConf(
        join_timeout_s=600.0 if join is None else join,
        last_call_s=1.0 if last_call is None else last_call,
        heartbeat_interval_s=hb_interval,
        heartbeat_timeout_s=hb_timeout,
        connect_timeout_s=30.0 if connect is None else connect,
        read_timeout_s=read,
        is_host=_bool(conf, "is_host"),
        backend_conf=backend_conf,
        notes=tuple(notes),
        warnings=tuple(warnings),
    )


def tcp_options(
    conf: Mapping[str, str], out: dict[str, str], read: float | None, notes: list[str]
) -> None:
    """The tcp store's options: none of its own; etcd's are noted as unused."""
    given = sorted(k for k in conf if k in ETCD_KEYS or k in _ETCD_RENAMES or k == "protocol")
    if given:
        notes.append(f"--rdzv-conf {', '.join(given)}: etcd options, unused by the tcp store")
    if "etcd_prefix" in conf:
        notes.append("--rdzv-conf etcd_prefix: an etcd option, unused by the tcp store")


def etcd_options(
    conf: Mapping[str, str], out: dict[str, str], read: float | None, notes: list[str]
) -> None:
    """torch's etcd (v1 and v2 backends) spellings -> flexrun's etcd v3 options, in ``out``."""
    for theirs, ours in _ETCD_RENAMES.items():
        if theirs in conf:
            if ours in conf and conf[ours] != conf[theirs]:
                raise ConfigError(f"--rdzv-conf {theirs} and {ours} are the same setting; give one")
            out[ours] = conf[theirs]
    if "protocol" in conf:
        protocol = conf["protocol"].strip().lower()
        if protocol not in ("http", "https"):
            raise ConfigError(f"--rdzv-conf protocol={conf['protocol']!r}: expected http or https")
        if protocol == "https" and "tls" not in out:
            out["tls"] = "true"
        if protocol == "http" and any(k in out for k in ("cacert", "cert", "key")):
            raise ConfigError(
                "--rdzv-conf protocol=http with TLS files (ca_cert/ssl_cert): use protocol=https"
            )
    if read is not None and "request_timeout" not in out:
        out["request_timeout"] = repr(read)
    if "etcd_prefix" in conf:
        notes.append(
            f"--rdzv-conf etcd_prefix={conf['etcd_prefix']}: accepted, not used: flexrun keeps "
            "its records in etcd's v3 keyspace under its own per-job keys (--rdzv-id)"
        )
