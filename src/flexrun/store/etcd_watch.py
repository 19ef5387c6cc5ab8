"""Watches of the etcd backend: one streaming request kept open across waits.

Owns :class:`Watches`, what :meth:`flexrun.store.etcd.EtcdStore.wait_for_change` does on
etcd's JSON gateway. A watch stream delivers every event after its start revision, in
order, for as long as it stays open; so a thread whose wait ended with an event and that
waits again on the same prefix from a later revision reads on from the same stream
(skipping events up to that revision) instead of opening a new one. Opening a watch costs
etcd's server several times what a range read does, and every follower re-arms its watch
after each round: at a thousand nodes, new watches alone would cost etcd seconds of CPU a
round. A wait that times out
closes its stream (http.client cannot resume a read that timed out): an idle node opens
one watch per wait, as before. It knows nothing about rounds.
"""

from __future__ import annotations

import base64
import http.client
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flexrun._clock import Clock
from flexrun.store.api import Entry, Event
from flexrun.store.etcd_http import Transport, Unreachable, error_text, watch_message


class Stream:
    """One streaming answer on a connection of its own, read a message at a time, each
    read with its own timeout."""

    def __init__(
        self, t: Transport, path: str, payload: Mapping[str, Any], connect_s: float
    ) -> None:
        self._t = t
        self._conn = t._new(connect_s)
        self.closed = False
        try:
            try:
                self._resp = t._send(self._conn, path, payload, connect_s, t.token)
            except (OSError, http.client.HTTPException) as exc:
                raise Unreachable(str(exc) or type(exc).__name__) from exc
            if self._resp.status != 200:
                data = self._resp.read()
                raise Unreachable(error_text(data) or f"HTTP {self._resp.status}")
        except BaseException:
            self.close()
            raise

    def next(self, read_s: float) -> dict[str, Any] | None:
        """The next message; None if none came within ``read_s`` (the stream is closed).

        Raises:
            Unreachable: the stream broke or ended.
        """
        sock = self._conn.sock
        if sock is not None:
            sock.settimeout(max(0.01, read_s))
        while True:
            if self._resp.isclosed():  # (its store was closed by another thread)
                self.close()
                raise Unreachable("the watch stream was closed")
            try:
                line = self._resp.readline()
            except TimeoutError:
                self.close()
                return None
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise Unreachable(str(exc) or type(exc).__name__) from exc
            except (AttributeError, ValueError) as exc:
                if not self._resp.isclosed():
                    raise
                # http.client reading a response that another thread closed under it
                self.close()
                raise Unreachable("the watch stream was closed") from exc
            try:
                message = watch_message(line)
            except Unreachable:
                self.close()
                raise
            if message is not None:
                return message

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._t._drop(self._conn)


@dataclass(slots=True)
class _Open:
    key: tuple[str, str]  # (key, range_end) as sent
    base: int  # the stream delivers every event above this revision
    t: Transport
    stream: Stream
    seen: int = 0  # the newest event revision it delivered


def _revision_of(event: Mapping[str, Any]) -> int:
    return int(event.get("kv", {}).get("mod_revision", 0))


def event_of(event: Mapping[str, Any]) -> Event | None:
    """An etcd watch event as the api's ``(key, entry)`` (None: deleted or expired); None
    for an event whose key is not UTF-8 (no flexrun client writes one: a stranger's)."""
    kv = event.get("kv", {})
    try:
        key = base64.b64decode(kv.get("key") or "").decode()
    except (UnicodeDecodeError, ValueError):
        return None
    if event.get("type") == "DELETE":
        return key, None
    return key, Entry(base64.b64decode(kv.get("value") or ""), int(kv.get("mod_revision", 0)))


class Watches:
    """Per thread, the watch stream its last wait left open (see the module docstring)."""

    def __init__(self, clock: Clock, request_timeout_s: Callable[[], float]) -> None:
        self._clock = clock
        self._request_timeout_s = request_timeout_s
        self._local = threading.local()

    def watch(
        self,
        t: Transport,
        request: Mapping[str, Any],
        deadline: float,
        since_revision: int,
        collect: list[dict[str, Any]] | None = None,
    ) -> tuple[bool, int]:
        """Whether anything under the request's range changed after ``since_revision``
        before ``deadline``, and the revision to wait from next.

        With ``collect``, the events after ``since_revision`` are appended to it (etcd's
        event objects, values included) and the revision returned is the newest of them:
        every event up to it has been handed over (``(True, since)`` with nothing
        collected: history before ``since_revision`` is compacted).

        Raises:
            Unreachable: the stream broke (the caller retries on a new one).
        """
        create = request["create_request"]
        key = (create["key"], create["range_end"])
        held: _Open | None = getattr(self._local, "open", None)
        if held is not None and (
            held.stream.closed
            or held.key != key
            or held.t is not t
            or since_revision < held.base
            or (collect is not None and since_revision < held.seen)
        ):
            held.stream.close()
            held = None
        if held is None:
            remaining = max(0.01, deadline - self._clock.monotonic())
            stream = Stream(t, "/watch", request, min(remaining, self._request_timeout_s()))
            held = _Open(key, since_revision, t, stream)
        elif since_revision < held.seen:
            return True, held.seen  # the stream already delivered a change after it
        self._local.open = held
        try:
            return self._read(held, deadline, since_revision, collect)
        except Unreachable:
            held.stream.close()
            raise

    def events(
        self, t: Transport, request: Mapping[str, Any], deadline: float, since_revision: int
    ) -> tuple[bool, int, list[dict[str, Any]]]:
        """:meth:`watch`, and the events after ``since_revision`` it collected."""
        out: list[dict[str, Any]] = []
        changed, rev = self.watch(t, request, deadline, since_revision, out)
        return changed, rev, out

    def _read(
        self,
        held: _Open,
        deadline: float,
        since_revision: int,
        collect: list[dict[str, Any]] | None,
    ) -> tuple[bool, int]:
        stream = held.stream
        while True:
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                return False, since_revision  # (the stream stays open for the next wait)
            message = stream.next(remaining)
            if message is None:
                return False, since_revision  # the read timed out: the wait is over
            if "error" in message:
                raise Unreachable(str(message["error"]))
            result = message.get("result", {})
            events = result.get("events")
            if events:
                newest = max(_revision_of(e) for e in events)
                held.seen = max(held.seen, newest)
                if newest > since_revision:
                    if collect is not None:
                        collect.extend(e for e in events if _revision_of(e) > since_revision)
                        return True, newest
                    return True, max(
                        int(result.get("header", {}).get("revision", 0)), since_revision
                    )
                continue  # already read by the caller (the stream started earlier)
            if result.get("canceled"):
                if int(result.get("compact_revision", 0)):
                    # History before since_revision is compacted: report a change.
                    stream.close()
                    if collect is not None:
                        return True, since_revision
                    return True, max(
                        int(result.get("header", {}).get("revision", 0)), since_revision
                    )
                raise Unreachable(str(result.get("cancel_reason", "watch canceled")))

    def close(self) -> None:
        held: _Open | None = getattr(self._local, "open", None)
        if held is not None:
            held.stream.close()


__all__ = ["Stream", "Watches", "event_of"]
