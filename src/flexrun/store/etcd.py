"""The etcd backend: flexrun's store protocol on etcd's v3 API (etcd 3.4-3.6).

Owns the mapping of the protocol onto etcd: revisions are etcd's store revision
(``header.revision``, ``mod_revision``), compare-and-set is a transaction on
``mod_revision`` (``create_revision == 0`` for "must be absent") whose failure branch
returns nothing, batches are transactions of up to 128 puts, keep-alive keys are attached
to leases, and waiting for change is a watch. It does not run etcd (see
:mod:`flexrun.testing.etcd_server` for tests) and knows nothing about rounds or nodes.

Transport. etcd's JSON gateway (``/v3/...`` over HTTP/1.1) through
:mod:`flexrun.store.etcd_http` (standard library only). The gateway is unidirectional,
so a watch is a streaming request, never polling; one a thread's wait left open after an
event serves its next wait on the same prefix (:mod:`flexrun.store.etcd_watch`).

Endpoints. ``--rdzv-endpoint a:2379,b:2379,c:2379``: requests go to the endpoint that
last answered; on a refused connection, an unavailable member (no leader) or a timeout
the next one is tried, round-robin, for up to ``request_timeout`` seconds before
:class:`~flexrun.errors.StoreUnavailable`. A compare-and-set whose outcome is unknown
(an attempt failed after it may have been sent, and the retry lost) counts as won when
the key holds exactly the value written, at a newer revision.

Keep-alive keys. Each key written with ``ttl_s`` gets its own lease (TTL rounded up to
whole seconds, as etcd requires). Writing the same value again with the same TTL is a
lease keep-alive only (one small request that etcd's leader answers without a raft write,
and no watch event: keep-alives wake nobody); the value itself is written again at most
every ``ttl_s`` (after the keep-alive: a put does not renew its lease), so a key deleted
or overwritten by someone else comes back. A dead node's
keys vanish when etcd expires its lease (whole seconds, at least etcd's minimum TTL,
checked every 500 ms): readers take a present key as alive. Keys under ``__flexrun/``
are never returned by :meth:`EtcdStore.get_prefix`.

Options (``--rdzv-conf k=v,...``; anything else is rejected):

``cacert``
    CA bundle (PEM) to verify the etcd servers; implies https.
``cert``, ``key``
    Client certificate and its private key (PEM) for mutual TLS; implies https.
``tls``
    ``true`` for https with the system CA store (when no ``cacert`` is given).
``user``
    etcd user for password auth (``etcdctl auth enable``); the password comes from
    ``StoreSettings.password`` (``password_file=PATH`` or the environment, never the
    command line); the token is renewed when etcd expires it.
``request_timeout``
    Seconds one operation may take, fail-over included (default 5).

``connect_timeout`` (generic) bounds the first contact: if no endpoint answers within it,
construction raises :class:`~flexrun.errors.StoreUnavailable` naming every endpoint.
"""

from __future__ import annotations

import base64
import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError, StoreError
from flexrun.store.api import Entry, Event
from flexrun.store.etcd_http import Cluster, Transport, tls_context
from flexrun.store.etcd_watch import Watches, event_of
from flexrun.store.rejects import Rejects

if TYPE_CHECKING:  # the store layer takes settings from above but never imports config at run time
    from flexrun.config import StoreSettings

_INTERNAL = "__flexrun/"
_REV_PROBE = "__flexrun/rev"
TXN_OPS = 128  # etcd's default --max-txn-ops
SNAPSHOTS = 16  # prefixes whose last get_prefix is kept for an incremental re-read
OPTIONS = ("cacert", "cert", "key", "tls", "user", "request_timeout")

T = TypeVar("T")


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _range_end(prefix: str) -> bytes:
    """The exclusive end of the key range starting with ``prefix`` (etcd's prefix rule)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # empty prefix (or all 0xff): every key


def _rev(result: Mapping[str, Any]) -> int:
    return int(result.get("header", {}).get("revision", 0))


def _watch_request(prefix: str, since_revision: int) -> dict[str, Any]:
    return {
        "create_request": {
            "key": _b64(prefix or "\0"),
            "range_end": _b64(_range_end(prefix)),
            "start_revision": since_revision + 1,
        }
    }


def _entry(kv: Mapping[str, Any], rejects: Rejects) -> tuple[str, Entry] | None:
    """A key-value of etcd's answer; None (reported) for a key that is not UTF-8, which
    no flexrun client writes: anyone who reaches etcd can, and it counts as absent."""
    try:
        key = _unb64(kv.get("key")).decode()
    except (UnicodeDecodeError, ValueError):
        rejects.report(repr(_unb64(kv.get("key"))), "key is not UTF-8")
        return None
    return key, Entry(_unb64(kv.get("value")), int(kv.get("mod_revision", 0)))


def _entries(kvs: Iterable[Mapping[str, Any]], rejects: Rejects) -> dict[str, Entry]:
    """The entries of ``kvs`` but internal keys and keys that are not text, by key."""
    out = dict(e for e in (_entry(kv, rejects) for kv in kvs) if e is not None)
    return {k: out[k] for k in sorted(out) if not k.startswith(_INTERNAL)}


def _events(raw: Iterable[Mapping[str, Any]], rejects: Rejects) -> list[Event]:
    """etcd's watch events as the api's, but internal keys and keys that are not text."""
    events = [e for e in map(event_of, raw) if e is None or not e[0].startswith(_INTERNAL)]
    if None in events:
        rejects.report("?", "a watch event's key is not UTF-8")
    return [e for e in events if e is not None]


def options(settings: StoreSettings) -> dict[str, Any]:
    """:class:`EtcdStore`'s keyword arguments from ``--rdzv-conf`` and the settings.

    Raises:
        ConfigError: an unknown option or a malformed value.
    """
    conf = dict(settings.conf)
    unknown = sorted(set(conf) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"--rdzv-conf {', '.join(unknown)}: not an option of the etcd backend "
            f"(known: {', '.join(OPTIONS)}, password_file, and the generic rendezvous options)"
        )
    tls = conf.get("tls", "false").lower()
    if tls not in ("true", "false", "1", "0", "yes", "no"):
        raise ConfigError(f"--rdzv-conf tls={conf['tls']!r}: expected true or false")
    try:
        request_timeout_s = float(conf.get("request_timeout", "5"))
    except ValueError:
        raise ConfigError(
            f"--rdzv-conf request_timeout={conf['request_timeout']!r}: expected seconds"
        ) from None
    return {
        "https": tls in ("true", "1", "yes"),
        "cacert": conf.get("cacert"),
        "cert": conf.get("cert"),
        "key": conf.get("key"),
        "user": conf.get("user"),
        "password": getattr(settings, "password", None),
        "connect_timeout_s": settings.connect_timeout_s,
        "request_timeout_s": request_timeout_s,
    }


class EtcdStore:
    """Client of an etcd v3 cluster implementing :class:`flexrun.store.Store`."""

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        https: bool = False,
        cacert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = 30.0,
        request_timeout_s: float = 5.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not endpoints:
            raise ConfigError("the etcd backend needs --rdzv-endpoint host:2379[,host2:2379,...]")
        if (cert is None) != (key is None):
            raise ConfigError(
                "--rdzv-conf cert=... and key=... must be given together (client TLS)"
            )
        if (user is None) != (password is None):
            raise ConfigError(
                "--rdzv-conf user=NAME needs a password (--rdzv-conf password_file=PATH, or "
                "FLEXRUN_ETCD_PASSWORD_FILE / FLEXRUN_ETCD_PASSWORD), and a password needs a user"
            )
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--rdzv-conf {name}={path}: no such file")
        if not request_timeout_s > 0:
            raise ConfigError("--rdzv-conf request_timeout must be positive")
        self.endpoints = tuple(endpoints)
        tls = None
        if https or cacert or cert:
            try:
                tls = tls_context(cacert, cert, key)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"--rdzv-conf cacert/cert/key: unusable TLS files: {exc}"
                ) from exc
        self._cluster = Cluster(
            [Transport(h, p, tls) for h, p in self.endpoints],
            user=user,
            password=password,
            request_timeout_s=request_timeout_s,
            clock=clock,
        )
        self._transports = self._cluster.transports
        self._clock = clock
        self._lock = threading.Lock()
        # key -> (lease id, ttl_s, value written, revision of that write, when written)
        self._leases: dict[str, tuple[int, float, bytes, int, float]] = {}
        # prefix -> (revision, key (base64) -> kv): the last get_prefix, brought up to date
        # by the next one with only the keys modified since
        self._snapshots: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {}
        self._watches = Watches(clock, lambda: self._cluster.request_timeout_s)
        self.rejects = Rejects("ignored an etcd key that is not text", clock=clock)
        self._cluster.connect(connect_timeout_s)

    @classmethod
    def from_settings(cls, settings: StoreSettings, clock: Clock = SYSTEM_CLOCK) -> EtcdStore:
        """Build a connected store from ``--rdzv-endpoint``, ``--rdzv-conf`` and the
        settings' password.

        Raises:
            ConfigError: an unknown or inconsistent option, or credentials etcd rejects.
            StoreUnavailable: no endpoint answered within ``connect_timeout_s``.
        """
        return cls(settings.endpoints, **options(settings), clock=clock)

    # -- plumbing ---------------------------------------------------------------------
    def _call(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One request with fail-over (see :meth:`flexrun.store.etcd_http.Cluster.call`)."""
        return self._cluster.call(path, payload)

    def _retry(self, op: Callable[[Transport, float], T]) -> T:
        return self._cluster.retry(op)

    def _range(self, key: str, range_end: bytes | None = None) -> tuple[int, list[dict[str, Any]]]:
        payload: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            payload["range_end"] = _b64(range_end)
        result = self._call("/kv/range", payload)
        return _rev(result), list(result.get("kvs", []))

    # -- leases --------------------------------------------------------------------------
    def _grant(self, ttl_s: float) -> int:
        whole = max(1, math.ceil(ttl_s))
        result = self._call("/lease/grant", {"TTL": whole, "ID": 0})
        lease = int(result.get("ID", 0))
        if not lease:
            raise StoreError(f"etcd did not grant a lease: {result.get('error', result)}")
        return lease

    def _refresh(self, key: str, value: bytes, ttl_s: float) -> int | None:
        """Renew ``key``'s lease; its revision, or None when the key must be written too
        (new, changed, due, or expired). The repeat that rewrites renews too: a put does
        not renew its lease (one that skipped it lost its key when late by TTL - 2 beats)."""
        with self._lock:
            held = self._leases.get(key)
        if held is None or held[1] != ttl_s or held[2] != value:
            return None
        result = self._call("/lease/keepalive", {"ID": held[0]})
        if int(result.get("result", {}).get("TTL", 0)) <= 0:
            with self._lock:  # expired (the store was down longer than the TTL): a new lease
                self._leases.pop(key, None)
            return None
        if self._clock.monotonic() - held[4] >= ttl_s:
            return None  # written again every ttl_s: a deleted or overwritten key comes back
        return held[3]

    def _forget_lease(self, key: str) -> None:
        with self._lock:
            held = self._leases.pop(key, None)
        if held is not None:
            with contextlib.suppress(StoreError):  # else it expires on its own
                self._call("/lease/revoke", {"ID": held[0]})

    # -- protocol ---------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        return self.get_at(key)[0]

    def get_at(self, key: str) -> tuple[Entry | None, int]:
        """:meth:`get` and the revision the read saw, in one request (see the api)."""
        rev, kvs = self._range(key)
        found = _entry(kvs[0], self.rejects) if kvs else None
        return (found[1] if found is not None else None), rev

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        """Every key under ``prefix``. A repeated call asks etcd only for the keys
        modified since the last one (``min_mod_revision``) and, in the same transaction,
        how many keys there are: if that count says some were deleted, it reads all."""
        with self._lock:
            snap = self._snapshots.get(prefix)
        bkey, bend = _b64(prefix or "\0"), _b64(_range_end(prefix))
        kvs_by_key: dict[str, dict[str, Any]] | None = None
        if snap is not None:
            since, cached = snap
            rng = {"key": bkey, "range_end": bend}
            txn = {
                "compare": [],
                "success": [
                    {"request_range": {**rng, "min_mod_revision": since + 1}},
                    {"request_range": {**rng, "count_only": True}},
                ],
            }
            result = self._call("/kv/txn", txn)
            at = _rev(result)
            responses = result.get("responses") or [{}, {}]
            changed = responses[0].get("response_range", {}).get("kvs", [])
            count = int(responses[-1].get("response_range", {}).get("count", 0))
            merged = dict(cached)
            for kv in changed:
                merged[kv.get("key", "")] = kv
            if len(merged) == count and at >= since:  # nothing deleted since (docstring)
                kvs_by_key = merged
        if kvs_by_key is None:
            at, kvs = self._range(prefix or "\0", _range_end(prefix))
            kvs_by_key = {kv.get("key", ""): kv for kv in kvs}
        with self._lock:
            old = self._snapshots.get(prefix)
            if old is None or old[0] <= at:
                self._snapshots[prefix] = (at, kvs_by_key)
                if len(self._snapshots) > SNAPSHOTS:
                    del self._snapshots[next(iter(self._snapshots))]
        return _entries(kvs_by_key.values(), self.rejects)

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        """Write; with ``ttl_s``, a repeat of the same value is a lease keep-alive (see
        the module docstring) and returns the key's unchanged revision."""
        value = bytes(value)
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if ttl_s is None:
            with self._lock:
                self._leases.pop(key, None)
            return _rev(self._call("/kv/put", payload))
        kept = self._refresh(key, value, ttl_s)
        if kept is not None:
            return kept
        with self._lock:
            held = self._leases.get(key)
        lease = held[0] if held is not None and held[1] == ttl_s else self._grant(ttl_s)
        payload["lease"] = lease
        try:
            rev = _rev(self._call("/kv/put", payload))
        except StoreError as exc:
            if "lease not found" not in str(exc):
                raise
            payload["lease"] = lease = self._grant(ttl_s)  # expired since the keep-alive
            rev = _rev(self._call("/kv/put", payload))
        with self._lock:
            self._leases[key] = (lease, ttl_s, value, rev, self._clock.monotonic())
        return rev

    def put_many(self, items: Mapping[str, bytes]) -> int:
        keys = list(items)
        rev = 0
        with self._lock:
            for key in keys:
                self._leases.pop(key, None)
        for i in range(0, len(keys), TXN_OPS):
            puts = [
                {"request_put": {"key": _b64(k), "value": _b64(bytes(items[k]))}}
                for k in keys[i : i + TXN_OPS]
            ]
            rev = _rev(self._call("/kv/txn", {"compare": [], "success": puts}))
        return rev

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        if expected_revision < 0:
            raise ValueError("expected_revision must be >= 0")
        bkey, bvalue = _b64(key), _b64(bytes(value))
        compare = (
            {"key": bkey, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            if expected_revision == 0
            else {"key": bkey, "result": "EQUAL", "target": "MOD", "mod_revision": expected_revision}
        )
        # No failure branch: a loser learns that it lost, not the winner's value.
        txn = {"compare": [compare], "success": [{"request_put": {"key": bkey, "value": bvalue}}]}
        attempts: list[int] = []

        def op(t: Transport, timeout_s: float) -> dict[str, Any]:
            attempts.append(1)
            return dict(self._cluster.post(t, "/kv/txn", txn, timeout_s))

        result = self._retry(op)
        with self._lock:
            self._leases.pop(key, None)
        if result.get("succeeded"):
            return True, Entry(bytes(value), _rev(result))
        if len(attempts) > 1:
            # An earlier attempt may have been applied before it failed: our value at a
            # newer revision is our write.
            current = self.get(key)
            if (
                current is not None
                and current.value == bytes(value)
                and current.revision > expected_revision
            ):
                return True, current
        return False, None

    def delete(self, key: str) -> None:
        self._call("/kv/deleterange", {"key": _b64(key)})
        self._forget_lease(key)

    def delete_prefix(self, prefix: str) -> None:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        self._call("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(_range_end(prefix))})

    def revision(self) -> int:
        return self._range(_REV_PROBE)[0]

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        if timeout_s <= 0:
            return False, since_revision
        deadline = self._clock.monotonic() + timeout_s
        request = _watch_request(prefix, since_revision)
        return self._retry(
            lambda t, attempt_s: self._watches.watch(t, request, deadline, since_revision)
        )

    def get_prefix_at(self, prefix: str) -> tuple[dict[str, Entry], int]:
        """Every key under ``prefix`` and the revision the read saw (see the api). One
        request on a connection closed after it: a watching thread keeps none idle."""
        payload = {"key": _b64(prefix or "\0"), "range_end": _b64(_range_end(prefix))}
        result = self._retry(lambda t, s: dict(t.post("/kv/range", payload, s, keep=False)))
        return _entries(result.get("kvs", []), self.rejects), _rev(result)

    def watch_values(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[list[Event] | None, int]:
        """:meth:`wait_for_change` returning its events, values included (see the api)."""
        if timeout_s <= 0:
            return [], since_revision
        deadline = self._clock.monotonic() + timeout_s
        request = _watch_request(prefix, since_revision)
        changed, rev, raw = self._retry(
            lambda t, attempt_s: self._watches.events(t, request, deadline, since_revision)
        )
        if changed and not raw:
            return None, since_revision  # compacted: the caller reads the prefix again
        return _events(raw, self.rejects), rev

    def close(self) -> None:
        self._cluster.close()


__all__ = ["OPTIONS", "EtcdStore"]
