"""The etcd backend: flexrun's store protocol on etcd's v3 API (etcd 3.4-3.6).

Owns the mapping of the protocol onto etcd: revisions are etcd's store revision
(``header.revision``, ``mod_revision``), compare-and-set is a transaction on
``mod_revision`` (``create_revision == 0`` for "must be absent"), keep-alive keys are
attached to leases, and waiting for change is a watch. It does not run etcd (see
:mod:`flexrun.testing.etcd_server` for tests) and knows nothing about rounds or nodes.

Transport. etcd's JSON gateway (``/v3/...`` over HTTP/1.1) through ``etcd3gw``, whose
client supplies the session, TLS settings and the translation of HTTP failures into its
exceptions; every one of those is translated here into :mod:`flexrun.errors`. Requests
build their own payloads because ``etcd3gw``'s helpers drop the response header (the
revision) and it has no auth. The gateway is unidirectional, so a watch is one bounded
streaming request per :meth:`EtcdStore.wait_for_change` (read timeout = the time left),
never polling.

Endpoints. ``--rdzv-endpoint a:2379,b:2379,c:2379``: requests go to the endpoint that
last answered; on a refused connection, an unavailable member (no leader) or a timeout
the next one is tried, round-robin, for up to ``request_timeout`` seconds before
:class:`~flexrun.errors.StoreUnavailable`. A compare-and-set whose outcome is unknown
(an attempt failed after it may have been sent, and the retry lost) counts as won when
the key holds exactly the value written, at a newer revision.

Keep-alive keys. Each key written with ``ttl_s`` gets its own lease (TTL rounded up to
whole seconds, as etcd requires), refreshed with a keep-alive on every write of the key
and re-granted once expired: a dead node's keys vanish when its lease expires. etcd
checks expiry every 500 ms and has a minimum TTL, so readers additionally judge
freshness as the tcp store does: the exact ``ttl_s`` travels in the value itself (a
``\0ttl=<seconds>\n`` header on keys written with a lease, stripped on read, so judging
a key costs no extra request) and a key whose ``mod_revision`` this client has seen
unchanged for ``ttl_s`` counts as absent. Keys under ``__flexrun/`` are never returned
by :meth:`EtcdStore.get_prefix`.

Options (``--rdzv-conf k=v,...``; anything else is rejected):

``cacert``
    CA bundle (PEM) to verify the etcd servers; implies https.
``cert``, ``key``
    Client certificate and its private key (PEM) for mutual TLS; implies https.
``tls``
    ``true`` for https with the system CA store (when no ``cacert`` is given).
``user``, ``password``
    etcd user/password auth (``etcdctl auth enable``); the token is renewed when etcd
    expires it.
``request_timeout``
    Seconds one operation may take, fail-over included (default 5).

``connect_timeout`` (generic) bounds the first contact: if no endpoint answers within it,
construction raises :class:`~flexrun.errors.StoreUnavailable` naming every endpoint.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import requests
from etcd3gw import exceptions as gw_exc
from etcd3gw.client import Etcd3Client

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.errors import ConfigError, StoreError, StoreUnavailable
from flexrun.store.api import Entry

if TYPE_CHECKING:  # the store layer takes settings from above but never imports config at run time
    from flexrun.config import StoreSettings

_INTERNAL = "__flexrun/"
_TTL_HEADER = b"\0ttl="
_REV_PROBE = "__flexrun/rev"
_ATTEMPT_S = 1.0
SNAPSHOTS = 16  # prefixes whose last get_prefix is kept for an incremental re-read
OPTIONS = ("cacert", "cert", "key", "tls", "user", "password", "request_timeout")

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


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


_ROOT_CAUSE = re.compile(
    r"\[Errno -?\d+\] [^'\")]+|\[SSL: [^\]]+\][^'\")(]*|Read timed out|timed out"
)


def _detail(exc: BaseException) -> str:
    detail = getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__
    found = _ROOT_CAUSE.search(detail)  # requests nests the OS error deep in its message
    if found:
        return found.group(0).strip()
    try:
        parsed = json.loads(detail)
        if isinstance(parsed, dict):
            detail = str(parsed.get("error") or parsed.get("message") or detail)
    except ValueError:
        pass
    return _first_line(str(detail))[:300]


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
            raise ConfigError("--rdzv-conf user=... and password=... must be given together")
        for name, path in (("cacert", cacert), ("cert", cert), ("key", key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--rdzv-conf {name}={path}: no such file")
        if request_timeout_s <= 0:
            raise ConfigError("--rdzv-conf request_timeout must be positive")
        self.endpoints = tuple(endpoints)
        self._protocol = "https" if (https or cacert or cert) else "http"
        self._cacert, self._cert, self._key = cacert, cert, key
        self._verify: str | bool = cacert if cacert is not None else True
        self._user, self._password = user, password
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._current = 0
        self._token: str | None = None
        self._token_gen = 0
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._closed = False
        # key -> (lease id, ttl_s) for keep-alive keys this client writes
        self._leases: dict[str, tuple[int, float]] = {}
        # key -> (mod_revision, monotonic time this client first saw it)
        self._seen: dict[str, tuple[int, float]] = {}
        # prefix -> (revision, key (base64) -> kv): the last get_prefix, brought up to date
        # by the next one with only the keys modified since
        self._snapshots: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {}
        self._connect(connect_timeout_s)

    @classmethod
    def from_settings(cls, settings: StoreSettings, clock: Clock = SYSTEM_CLOCK) -> EtcdStore:
        """Build a connected store from ``--rdzv-endpoint`` and ``--rdzv-conf``.

        Raises:
            ConfigError: an unknown or inconsistent option, or credentials etcd rejects.
            StoreUnavailable: no endpoint answered within ``connect_timeout_s``.
        """
        conf = dict(settings.conf)
        unknown = sorted(set(conf) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"--rdzv-conf {', '.join(unknown)}: not an option of the etcd backend "
                f"(known: {', '.join(OPTIONS)} and the generic rendezvous options)"
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
        return cls(
            settings.endpoints,
            https=tls in ("true", "1", "yes"),
            cacert=conf.get("cacert"),
            cert=conf.get("cert"),
            key=conf.get("key"),
            user=conf.get("user"),
            password=conf.get("password"),
            connect_timeout_s=settings.connect_timeout_s,
            request_timeout_s=request_timeout_s,
            clock=clock,
        )

    # -- plumbing ---------------------------------------------------------------------
    def _where(self) -> str:
        return ", ".join(f"{h}:{p}" for h, p in self.endpoints)

    def _client(self, index: int) -> Etcd3Client:
        if self._closed:
            raise StoreUnavailable("etcd store client is closed")
        clients: dict[int, list[Any]] | None = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        slot = clients.get(index)  # [client, generation of the auth token its session carries]
        if slot is None:
            # One session per thread and endpoint: requests' Session is not promised thread-safe.
            session = requests.Session()
            if self._cacert is not None:
                session.verify = self._cacert
            if self._cert is not None and self._key is not None:
                session.cert = (self._cert, self._key)
            with self._lock:
                self._sessions.append(session)
            host, port = self.endpoints[index]
            client = Etcd3Client(
                host=host,
                port=port,
                protocol=self._protocol,
                timeout=self._request_timeout_s,
                api_path="/v3/",
                session=session,
            )
            slot = clients[index] = [client, -1]
        client = slot[0]
        if self._token is not None and slot[1] != self._token_gen:
            client.session.headers["Authorization"] = self._token
            slot[1] = self._token_gen
        return client

    def _post(self, client: Etcd3Client, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        # verify is passed per request: requests lets REQUESTS_CA_BUNDLE override session.verify.
        result = client.post(client.get_url(path), json=payload, verify=self._verify)
        return result if isinstance(result, dict) else {}

    def _call(self, op: Callable[[Etcd3Client], T]) -> T:
        """Run ``op`` on the endpoint that last answered, failing over to the others.

        Raises:
            StoreUnavailable: no endpoint answered within the request timeout.
            StoreError: etcd answered with an error (permission denied, bad request).
        """
        deadline = self._clock.monotonic() + self._request_timeout_s
        delay = 0.05
        # A request that reaches a member while the cluster elects a leader is held by etcd
        # for its own request timeout (about 6 s) before failing; give up on an attempt
        # much sooner and try the next member, doubling the allowance each round so that
        # a large read on a busy cluster still completes.
        attempt_s = _ATTEMPT_S
        n = len(self.endpoints)
        last: BaseException | None = None
        reauthed = False
        while True:
            start = self._current
            for i in range(n):
                idx = (start + i) % n
                client = self._client(idx)
                client.timeout = max(0.05, min(attempt_s, deadline - self._clock.monotonic()))
                try:
                    try:
                        result = op(client)
                    except gw_exc.Etcd3Exception as exc:
                        if (
                            type(exc) is not gw_exc.Etcd3Exception
                            or self._user is None
                            or reauthed
                            or "token" not in _detail(exc).lower()
                        ):
                            raise
                        # etcd expired our auth token: get a new one and retry once.
                        reauthed = True
                        self._authenticate(client)
                        result = op(self._client(idx))
                except (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError) as exc:
                    # Refused/reset, timed out, or 503 (no leader): try the next member.
                    last = exc
                    continue
                except gw_exc.Etcd3Exception as exc:
                    raise StoreError(
                        f"etcd at {client.host}:{client.port}: {_detail(exc)}"
                    ) from exc
                except requests.RequestException as exc:
                    last = exc
                    continue
                self._current = idx
                return result
            attempt_s *= 2
            if self._clock.monotonic() + delay > deadline:
                reason = _detail(last) if last is not None else "no answer"
                raise StoreUnavailable(
                    f"no etcd endpoint answered within {self._request_timeout_s:g}s "
                    f"({self._where()}): {reason}"
                ) from last
            self._clock.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _connect(self, timeout_s: float) -> None:
        deadline = self._clock.monotonic() + timeout_s
        delay = 0.05
        last: BaseException | None = None
        while True:
            for idx in range(len(self.endpoints)):
                client = self._client(idx)
                try:
                    self._post(client, "/maintenance/status", {})
                except (
                    gw_exc.ConnectionFailedError,
                    gw_exc.ConnectionTimeoutError,
                    requests.RequestException,
                ) as exc:
                    last = exc
                    continue
                except gw_exc.Etcd3Exception as exc:
                    last = exc  # it answered; auth or permissions are checked next
                self._current = idx
                if self._user is not None:
                    self._authenticate(client)
                return
            if self._clock.monotonic() + delay > deadline:
                reason = _detail(last) if last is not None else "no answer"
                raise StoreUnavailable(
                    f"cannot reach etcd at {self._where()} after {timeout_s:g}s ({reason}); check "
                    "--rdzv-endpoint, that etcd 3.4+ is running there, and the TLS options"
                ) from last
            self._clock.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _authenticate(self, client: Etcd3Client) -> None:
        no_token: dict[str, Any] = {"Authorization": None}  # None drops the session's header
        try:
            # The auth call itself must go without a (possibly expired) token.
            resp = client.session.post(
                client.get_url("/auth/authenticate"),
                json={"name": self._user, "password": self._password},
                timeout=self._request_timeout_s,
                headers=no_token,
                verify=self._verify,
            )
        except requests.RequestException as exc:
            raise StoreUnavailable(f"etcd at {client.host}:{client.port}: {_detail(exc)}") from exc
        if resp.status_code != 200:
            raise ConfigError(
                f"etcd at {client.host}:{client.port} rejected user {self._user!r}: "
                f"{_detail(gw_exc.Etcd3Exception(resp.text))}; check --rdzv-conf user/password"
            )
        token = resp.json().get("token")
        if not token:
            raise ConfigError(
                f"etcd at {client.host}:{client.port} returned no auth token; is auth enabled "
                "(etcdctl auth enable)? otherwise drop --rdzv-conf user/password"
            )
        with self._lock:
            self._token = str(token)
            self._token_gen += 1

    # -- leases and freshness ------------------------------------------------------------
    def _entry(self, kv: Mapping[str, Any]) -> tuple[str, Entry] | None:
        key = _unb64(kv.get("key")).decode()
        rev = int(kv.get("mod_revision", 0))
        value = _unb64(kv.get("value"))
        ttl: float | None = None
        if int(kv.get("lease", 0)) and value.startswith(_TTL_HEADER):
            header, _, value = value.partition(b"\n")
            ttl = float(header[len(_TTL_HEADER) :])
        entry = Entry(value, rev)
        if ttl is not None:
            now = self._clock.monotonic()
            with self._lock:
                seen = self._seen.get(key)
                if seen is None or seen[0] != rev:
                    self._seen[key] = (rev, now)
                elif now - seen[1] >= ttl:
                    return None
        return key, entry

    def _range(self, key: str, range_end: bytes | None = None) -> tuple[int, list[dict[str, Any]]]:
        payload: dict[str, Any] = {"key": _b64(key)}
        if range_end is not None:
            payload["range_end"] = _b64(range_end)
        result = self._call(lambda c: self._post(c, "/kv/range", payload))
        return int(result.get("header", {}).get("revision", 0)), list(result.get("kvs", []))

    def _grant(self, key: str, ttl_s: float) -> int:
        whole = max(1, math.ceil(ttl_s))
        result = self._call(lambda c: self._post(c, "/lease/grant", {"TTL": whole, "ID": 0}))
        lease = int(result.get("ID", 0))
        if not lease:
            raise StoreError(f"etcd did not grant a lease: {result.get('error', result)}")
        with self._lock:
            self._leases[key] = (lease, ttl_s)
        return lease

    def _lease_for(self, key: str, ttl_s: float) -> int:
        with self._lock:
            held = self._leases.get(key)
        if held is not None and held[1] == ttl_s:
            result = self._call(lambda c: self._post(c, "/lease/keepalive", {"ID": held[0]}))
            if int(result.get("result", {}).get("TTL", 0)) > 0:
                return held[0]
        return self._grant(key, ttl_s)

    def _forget_lease(self, key: str) -> None:
        with self._lock:
            held = self._leases.pop(key, None)
        if held is not None:
            with contextlib.suppress(StoreError):  # else it expires on its own
                self._call(lambda c: self._post(c, "/lease/revoke", {"ID": held[0]}))

    # -- protocol ---------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        _, kvs = self._range(key)
        got = self._entry(kvs[0]) if kvs else None
        return got[1] if got is not None else None

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        """Every live key under ``prefix``. A repeated call asks etcd only for the keys
        modified since the last one (``min_mod_revision``) and, in the same transaction,
        how many keys there are: if that count says some were deleted, it reads all."""
        with self._lock:
            snap = self._snapshots.get(prefix)
        bkey, bend = _b64(prefix or "\0"), _b64(_range_end(prefix))
        kvs_by_key: dict[str, dict[str, Any]] | None = None
        if snap is not None:
            since, cached = snap
            txn = {
                "compare": [],
                "success": [
                    {
                        "request_range": {
                            "key": bkey,
                            "range_end": bend,
                            "min_mod_revision": since + 1,
                        }
                    },
                    {"request_range": {"key": bkey, "range_end": bend, "count_only": True}},
                ],
            }
            result = self._call(lambda c: self._post(c, "/kv/txn", txn))
            at = int(result.get("header", {}).get("revision", 0))
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
        out: dict[str, Entry] = {}
        for kv in kvs_by_key.values():
            got = self._entry(kv)
            if got is not None and not got[0].startswith(_INTERNAL):
                out[got[0]] = got[1]
        return dict(sorted(out.items()))

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(bytes(value))}
        if ttl_s is None:
            with self._lock:
                self._leases.pop(key, None)
        else:
            header = _TTL_HEADER + repr(float(ttl_s)).encode() + b"\n"
            payload["value"] = _b64(header + bytes(value))
            payload["lease"] = self._lease_for(key, ttl_s)

        def op(c: Etcd3Client) -> dict[str, Any]:
            return self._post(c, "/kv/put", payload)

        try:
            result = self._call(op)
        except StoreError as exc:
            if ttl_s is None or "lease not found" not in str(exc):
                raise
            # The lease expired between the keep-alive and the put: take a new one.
            payload["lease"] = self._grant(key, ttl_s)
            result = self._call(op)
        return int(result["header"]["revision"])

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        if expected_revision < 0:
            raise ValueError("expected_revision must be >= 0")
        bkey, bvalue = _b64(key), _b64(bytes(value))
        compare = (
            {"key": bkey, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
            if expected_revision == 0
            else {
                "key": bkey,
                "result": "EQUAL",
                "target": "MOD",
                "mod_revision": expected_revision,
            }
        )
        txn = {
            "compare": [compare],
            "success": [{"request_put": {"key": bkey, "value": bvalue}}],
            "failure": [{"request_range": {"key": bkey}}],
        }
        attempts: list[int] = []

        def op(c: Etcd3Client) -> dict[str, Any]:
            attempts.append(1)
            return self._post(c, "/kv/txn", txn)

        result = self._call(op)
        with self._lock:
            self._leases.pop(key, None)
        if result.get("succeeded"):
            return True, Entry(bytes(value), int(result["header"]["revision"]))
        responses = result.get("responses") or [{}]
        kvs = responses[0].get("response_range", {}).get("kvs", [])
        got = self._entry(kvs[0]) if kvs else None
        current = got[1] if got is not None else None
        if (
            len(attempts) > 1
            and current is not None
            and current.value == bytes(value)
            and current.revision > expected_revision
        ):
            # An earlier attempt failed after sending: our value at a newer revision is our write.
            return True, current
        return False, current

    def delete(self, key: str) -> None:
        self._call(lambda c: self._post(c, "/kv/deleterange", {"key": _b64(key)}))
        self._forget_lease(key)

    def revision(self) -> int:
        return self._range(_REV_PROBE)[0]

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        deadline = self._clock.monotonic() + timeout_s
        request = {
            "create_request": {
                "key": _b64(prefix or "\0"),
                "range_end": _b64(_range_end(prefix)),
                "start_revision": since_revision + 1,
            }
        }
        if timeout_s <= 0:
            return False, since_revision
        return self._call(lambda c: self._watch(c, request, deadline, since_revision))

    def _watch(
        self, client: Etcd3Client, request: Mapping[str, Any], deadline: float, since_revision: int
    ) -> tuple[bool, int]:
        remaining = max(0.01, deadline - self._clock.monotonic())
        try:
            resp = client.session.post(
                client.get_url("/watch"),
                json=request,
                stream=True,
                verify=self._verify,
                timeout=(min(remaining, float(client.timeout or remaining)), remaining),
            )
        except requests.Timeout as exc:
            raise gw_exc.ConnectionTimeoutError(str(exc)) from exc
        except requests.ConnectionError as exc:
            raise gw_exc.ConnectionFailedError(str(exc)) from exc
        with resp:
            if resp.status_code != 200:
                raise (
                    gw_exc.ConnectionFailedError(resp.text)
                    if resp.status_code == 503
                    else gw_exc.Etcd3Exception(resp.text)
                )
            try:
                for line in resp.iter_lines():
                    if not line:
                        continue
                    message = json.loads(line)
                    if "error" in message:
                        raise gw_exc.ConnectionFailedError(json.dumps(message["error"]))
                    result = message.get("result", {})
                    header_rev = int(result.get("header", {}).get("revision", 0))
                    if result.get("events"):
                        return True, max(header_rev, since_revision)
                    if result.get("canceled"):
                        if int(result.get("compact_revision", 0)):
                            # History before since_revision is compacted: report a change.
                            return True, max(header_rev, self.revision())
                        raise gw_exc.ConnectionFailedError(
                            str(result.get("cancel_reason", "watch canceled"))
                        )
                    if self._clock.monotonic() >= deadline:
                        return False, since_revision
            except (
                requests.RequestException
            ) as exc:  # a read timeout while streaming lands here too
                if self._clock.monotonic() >= deadline - 0.01:
                    return False, since_revision
                # The member went away mid-watch: let _call watch again on another one.
                raise gw_exc.ConnectionFailedError(str(exc)) from exc
        if self._clock.monotonic() >= deadline - 0.01:
            return False, since_revision
        raise gw_exc.ConnectionFailedError("watch stream ended")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()


__all__ = ["OPTIONS", "EtcdStore"]
