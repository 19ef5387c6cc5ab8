"""HTTP/1.1 to etcd's JSON gateway (``/v3/...``) with the standard library only.

Owns connections (one keep-alive connection per thread and endpoint, TLS from a CA file
and an optional client certificate), request timeouts, the streaming watch response,
sorting every failure into two kinds: :class:`Unreachable` (refused, reset, timed out,
HTTP 503: try another member) and :class:`EtcdRefused` (etcd answered with an error: the
request itself is wrong, or permission is denied), fail-over across the endpoints and the
auth token (:class:`Cluster`), translated into :mod:`flexrun.errors`. It knows nothing of
keys or revisions.

Why not ``requests``: a request through ``requests`` (via ``etcd3gw``) costs the client
several times the CPU of one through ``http.client``; at a thousand agents per host (the
scale benchmark's harness), and for a busy agent, that is the main cost.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from flexrun._clock import Clock
from flexrun.errors import ConfigError, StoreError, StoreUnavailable

API = "/v3"
_ATTEMPT_S = 1.0
T = TypeVar("T")


class Unreachable(Exception):
    """This member did not answer (try another one)."""


class EtcdRefused(Exception):
    """etcd answered with an error; ``status`` is the HTTP status, ``text`` its message."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def tls_context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A client TLS context verifying against ``cacert`` (else the system store)."""
    ctx = ssl.create_default_context(cafile=cacert)
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def error_text(body: bytes) -> str:
    """etcd's message from an error body (JSON ``error``/``message``), else its first line."""
    text = body.decode(errors="replace").strip()
    with contextlib.suppress(ValueError):
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            text = str(parsed.get("error") or parsed.get("message") or text)
    return (text.splitlines()[0] if text else "")[:300]


class Transport:
    """Requests to one endpoint; thread-safe (each thread has its own connection)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.host = host
        self.port = port
        self._tls = tls
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[http.client.HTTPConnection] = []
        self.token: str | None = None

    def _new(self, timeout_s: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout_s, context=self._tls
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        with self._lock:
            self._open.append(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        with self._lock, contextlib.suppress(ValueError):
            self._open.remove(conn)

    def _send(
        self,
        conn: http.client.HTTPConnection,
        path: str,
        payload: Mapping[str, Any],
        timeout_s: float,
        token: str | None,
    ) -> http.client.HTTPResponse:
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        conn.request("POST", API + path, body=body, headers=headers)
        return conn.getresponse()

    def post(
        self,
        path: str,
        payload: Mapping[str, Any],
        timeout_s: float,
        *,
        auth: bool = True,
        keep: bool = True,
    ) -> dict[str, Any]:
        """One request; the parsed JSON answer. ``keep=False``: on a connection of its own,
        closed after (a thread that asks rarely holds no idle connection to etcd).

        Raises:
            Unreachable: no answer (connection failed, timed out, 503).
            EtcdRefused: etcd answered with an error.
        """
        conn: http.client.HTTPConnection | None = (
            getattr(self._local, "conn", None) if keep else None
        )
        if conn is None:
            conn = self._new(timeout_s)
            if keep:
                self._local.conn = conn
        try:
            resp = self._send(conn, path, payload, timeout_s, self.token if auth else None)
            data = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._drop(conn)
            if keep:
                self._local.conn = None
            raise Unreachable(_reason(exc)) from exc
        finally:
            if not keep:
                self._drop(conn)
        if resp.status == 503:
            raise Unreachable(error_text(data) or "503 service unavailable")
        if resp.status != 200:
            raise EtcdRefused(resp.status, error_text(data) or f"HTTP {resp.status}")
        try:
            out = json.loads(data)
        except ValueError as exc:
            raise EtcdRefused(resp.status, f"not JSON: {data[:100]!r}") from exc
        return out if isinstance(out, dict) else {}

    def close(self) -> None:
        """Close every connection, those other threads are reading too: each socket is shut
        down first, which ends a read blocked on it at once (closing alone does not)."""
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # (already shut down by its peer)
                    sock.shutdown(socket.SHUT_RDWR)
            conn.close()


class Cluster:
    """The endpoints of one etcd cluster: requests go to the one that last answered and
    fail over to the others within the request timeout; the auth token is renewed once
    when etcd expires it."""

    def __init__(
        self,
        transports: list[Transport],
        *,
        user: str | None,
        password: str | None,
        request_timeout_s: float,
        clock: Clock,
    ) -> None:
        self.transports = transports
        self._user, self._password = user, password
        self.request_timeout_s = request_timeout_s
        self._clock = clock
        self._current = 0
        self._closed = False

    def where(self) -> str:
        return ", ".join(f"{t.host}:{t.port}" for t in self.transports)

    def post(self, t: Transport, path: str, payload: Mapping[str, Any], timeout_s: float) -> Any:
        return t.post(path, payload, timeout_s)

    def call(self, path: str, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One request on the endpoint that last answered, failing over to the others.

        Raises:
            StoreUnavailable: no endpoint answered within the request timeout.
            StoreError: etcd answered with an error (permission denied, bad request).
        """
        return self.retry(lambda t, timeout_s: dict(self.post(t, path, payload, timeout_s)))

    def retry(self, op: Callable[[Transport, float], T]) -> T:
        """``op(transport, attempt_timeout_s)`` with fail-over (see :meth:`call`)."""
        if self._closed:
            raise StoreUnavailable("etcd store client is closed")
        deadline = self._clock.monotonic() + self.request_timeout_s
        delay = 0.05
        # A request that reaches a member while the cluster elects a leader is held by etcd
        # for its own request timeout (about 6 s) before failing; give up on an attempt
        # much sooner and try the next member, doubling the allowance each round so that
        # a large read on a busy cluster still completes.
        attempt_s = _ATTEMPT_S
        n = len(self.transports)
        last: BaseException | None = None
        reauthed = False
        while True:
            start = self._current
            for i in range(n):
                if self._closed:  # (closed by another thread meanwhile: connect no more)
                    raise StoreUnavailable("etcd store client is closed")
                t = self.transports[(start + i) % n]
                timeout_s = max(0.05, min(attempt_s, deadline - self._clock.monotonic()))
                try:
                    result = op(t, timeout_s)
                except Unreachable as exc:
                    last = exc
                    continue
                except EtcdRefused as exc:
                    if self._user is None or reauthed or "token" not in exc.text.lower():
                        raise StoreError(f"etcd at {t.host}:{t.port}: {exc.text}") from exc
                    reauthed = True  # etcd expired our auth token: get a new one, retry
                    self.authenticate(t)
                    try:
                        result = op(t, timeout_s)
                    except Unreachable as again:
                        last = again
                        continue
                    except EtcdRefused as again:
                        raise StoreError(f"etcd at {t.host}:{t.port}: {again.text}") from again
                self._current = (start + i) % n
                return result
            attempt_s *= 2
            if self._clock.monotonic() + delay > deadline:
                raise StoreUnavailable(
                    f"no etcd endpoint answered within {self.request_timeout_s:g}s "
                    f"({self.where()}): {last or 'no answer'}"
                ) from last
            self._clock.sleep(delay)
            delay = min(delay * 2, 0.5)

    def connect(self, timeout_s: float) -> None:
        """First contact: some endpoint answers within ``timeout_s`` (then log in).

        Raises:
            StoreUnavailable: none did.
            ConfigError: etcd rejected the credentials.
        """
        deadline = self._clock.monotonic() + timeout_s
        delay = 0.05
        last: BaseException | None = None
        while True:
            for idx, t in enumerate(self.transports):
                try:
                    t.post("/maintenance/status", {}, max(0.1, min(2.0, timeout_s)), auth=False)
                except Unreachable as exc:
                    last = exc
                    continue
                except EtcdRefused as exc:
                    last = exc  # it answered; auth or permissions are checked next
                self._current = idx
                if self._user is not None:
                    self.authenticate(t)
                return
            if self._clock.monotonic() + delay > deadline:
                raise StoreUnavailable(
                    f"cannot reach etcd at {self.where()} after {timeout_s:g}s "
                    f"({last or 'no answer'}); check --rdzv-endpoint, that etcd 3.4+ is "
                    "running there, and the TLS options"
                ) from last
            self._clock.sleep(delay)
            delay = min(delay * 2, 1.0)

    def authenticate(self, t: Transport) -> None:
        """Get an auth token for the configured user (every endpoint uses it).

        Raises:
            StoreUnavailable: the endpoint did not answer.
            ConfigError: etcd rejected the user or password, or returned no token.
        """
        try:
            resp = t.post(
                "/auth/authenticate",
                {"name": self._user, "password": self._password},
                self.request_timeout_s,
                auth=False,  # the auth call itself goes without a (possibly expired) token
            )
        except Unreachable as exc:
            raise StoreUnavailable(f"etcd at {t.host}:{t.port}: {exc}") from exc
        except EtcdRefused as exc:
            raise ConfigError(
                f"etcd at {t.host}:{t.port} rejected user {self._user!r}: {exc.text}; check "
                "--rdzv-conf user and the password (password_file / FLEXRUN_ETCD_PASSWORD_FILE)"
            ) from exc
        token = resp.get("token")
        if not token:
            raise ConfigError(
                f"etcd at {t.host}:{t.port} returned no auth token; is auth enabled "
                "(etcdctl auth enable)? otherwise drop --rdzv-conf user"
            )
        for other in self.transports:
            other.token = str(token)

    def close(self) -> None:
        self._closed = True
        for t in self.transports:
            t.close()


def watch_message(line: bytes) -> dict[str, Any] | None:
    """One line of a watch stream: its message, or None for a keep-alive blank line or a
    non-object.

    Raises:
        Unreachable: the stream ended (an empty read) or the line is not JSON.
    """
    if not line:
        raise Unreachable("watch stream ended")
    line = line.strip()
    if not line:
        return None
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise Unreachable(f"bad watch message {line[:80]!r}") from exc
    return message if isinstance(message, dict) else None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"[Errno {exc.errno}] {exc.strerror}"
    return str(exc) or type(exc).__name__
