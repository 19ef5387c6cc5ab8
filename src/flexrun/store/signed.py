"""Authenticated records: a :class:`~flexrun.store.api.Store` that signs what it writes and
ignores what does not verify.

Owns the record envelope, its verification, and what a reader does with a record that
fails (``store_record_rejected``, at most once a minute per key and reason, through
:func:`report_to` and :class:`~flexrun.store.rejects.Rejects`). It
does not know the rendezvous (round numbers are judged there) and cannot stop anyone who
reaches the store from deleting keys or flooding it: neither a ``TCPStore`` nor an etcd
without auth authenticates its clients. What the secret buys is that nobody without it
can *write* a record that a job's agents or live workers believe.

Envelope (bytes)::

    FXS1 <tag: 64 hex> <seq> <ttl or ->\\n<payload>
    tag = HMAC-SHA256(secret, "flexrun-record-v1" 0 key 0 seq 0 ttl 0 payload)

The key is inside the MAC, so a record cannot be moved to another key (round 3's master
address to round 7's, one node's record to another's). ``seq`` is ``<nonce>.<n>``: a random
nonce per writer process and a counter.

Replay. A recorded value replayed later under its own key verifies. Where that matters:

- keep-alives (``ttl`` in the envelope): readers judge a keep-alive by its ``seq``, not by
  the store's revision: a keep-alive whose ``seq`` has not changed for its TTL (2 x TTL on
  etcd, whose writers re-sign every TTL/2 and otherwise only refresh the lease) counts as
  absent, and one that the store still serves then is rejected as ``replayed``. So a dead
  node's captured keep-alive, written back, keeps it alive for at most that long.
- round records: their number (and a write sequence) only grows; the rendezvous rejects an
  older one than it has seen (``flexrun.rendezvous.handler``). A node that has seen none
  (it just started) can be shown an old round of the same job: it waits as a standby until
  the watcher, which has seen the current one, writes it back.
- a record from an earlier job with the same ``--rdzv-id`` and the same secret verifies:
  use a fresh secret per job (``--standalone`` and the Kubernetes renderer do).

Junk (anything that does not verify: truncated, wrong tag, unsigned, over ``MAX_RECORD``)
counts as "no write happened": a reader keeps the value it last verified under that key
(absent if none), and a compare-and-set expecting that value's revision is applied over
the junk, so a forged round record cannot make every compare-and-set fail for ever. A
keep-alive kept this way still expires by its ``seq``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flexrun._clock import SYSTEM_CLOCK, Clock
from flexrun.store.api import Entry, Event, Store
from flexrun.store.rejects import Rejects, Sink, report_to

log = logging.getLogger("flexrun.store")

MAGIC = b"FXS1"
MAX_RECORD = 4 << 20  # larger values are rejected unread (the rendezvous writes < 100 KB)
_CONTEXT = b"flexrun-record-v1"


def tag_of(secret: bytes, key: str, seq: bytes, ttl: bytes, payload: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (_CONTEXT, key.encode(), seq, ttl, payload):
        mac.update(part)
        mac.update(b"\0")
    return mac.hexdigest().encode()


def seal(secret: bytes, key: str, payload: bytes, seq: bytes, ttl_s: float | None) -> bytes:
    """The envelope of ``payload`` under ``key``."""
    ttl = b"-" if ttl_s is None else repr(float(ttl_s)).encode()
    return b" ".join((MAGIC, tag_of(secret, key, seq, ttl, payload), seq, ttl)) + b"\n" + payload


@dataclass(frozen=True, slots=True)
class Opened:
    payload: bytes
    seq: bytes
    ttl_s: float | None


def open_record(secret: bytes, key: str, raw: bytes) -> Opened | str:
    """The verified record, or why it does not verify (a short reason)."""
    if len(raw) > MAX_RECORD:
        return f"too large ({len(raw)} bytes)"
    header, sep, payload = raw.partition(b"\n")
    parts = header.split(b" ")
    if not sep or len(parts) != 4 or parts[0] != MAGIC:
        return "not signed" if not raw.startswith(MAGIC) else "malformed"
    _, tag, seq, ttl = parts
    if not hmac.compare_digest(tag, tag_of(secret, key, seq, ttl, payload)):
        return "bad signature"
    try:
        ttl_s = None if ttl == b"-" else float(ttl)
    except ValueError:
        return "malformed"
    return Opened(payload, seq, ttl_s)


@dataclass(slots=True)
class _Known:
    """What this reader last verified under a key."""

    entry: Entry
    seq: bytes
    ttl_s: float | None
    seq_since: float  # monotonic time this reader first saw that seq
    junk_rev: int = 0  # revision of unverifiable junk written over it (0: none)


class SignedStore:
    """Signs every value written through it and verifies every value read."""

    def __init__(self, inner: Store, secret: bytes, *, clock: Clock = SYSTEM_CLOCK) -> None:
        if len(secret) < 16:
            raise ValueError("a job secret must be at least 16 bytes")
        self.inner = inner
        self._secret = bytes(secret)
        self._clock = clock
        self._nonce = os.urandom(4).hex().encode()
        self._n = 0
        self._lock = threading.Lock()
        self._known: dict[str, _Known] = {}
        self._junk_only: dict[str, int] = {}  # key -> revision of junk with nothing verified
        self._sealed: dict[str, tuple[bytes, float | None, bytes, float]] = {}
        self._rejects = Rejects(clock=clock)
        # The api's optional reads, where the inner store has them (callers look them up
        # with getattr): the values they return are judged as every other read's.
        if callable(getattr(inner, "get_prefix_at", None)) and callable(
            getattr(inner, "watch_values", None)
        ):
            self.get_prefix_at = self._get_prefix_at
            self.watch_values = self._watch_values

    @property
    def judges_ttl_locally(self) -> bool:
        return bool(getattr(self.inner, "judges_ttl_locally", False))

    def expires_at(self, key: str) -> float | None:
        """When this reader will judge the keep-alive ``key`` expired unless it reads a
        newer write first (where the inner store judges TTLs locally); None: unknown."""
        inner = getattr(self.inner, "expires_at", None)
        if not self.judges_ttl_locally or inner is None:
            return None
        at = inner(key)
        with self._lock:
            known = self._known.get(key)
        if at is None or known is None or known.ttl_s is None:
            return at
        return max(at, known.seq_since + known.ttl_s)

    @property
    def rejected(self) -> int:
        """How many reads met a record that does not verify."""
        return self._rejects.count

    def add_sink(self, sink: Sink) -> None:
        """Also report rejected records to ``sink`` (e.g. the event log)."""
        self._rejects.add_sink(sink)

    # -- writing ----------------------------------------------------------------------------
    def _seq(self) -> bytes:
        with self._lock:
            self._n += 1
            return self._nonce + b"." + str(self._n).encode()

    def _seal(self, key: str, value: bytes, ttl_s: float | None) -> bytes:
        value = bytes(value)
        if ttl_s is not None and not self.judges_ttl_locally:
            # etcd refreshes an unchanged keep-alive with its lease alone: re-sign only
            # every TTL/2, so that readers can still tell a replayed one (module docstring).
            with self._lock:
                last = self._sealed.get(key)
            now = self._clock.monotonic()
            if (
                last is not None
                and last[0] == value
                and last[1] == ttl_s
                and now - last[3] < ttl_s / 2
            ):
                return last[2]
            raw = seal(self._secret, key, value, self._seq(), ttl_s)
            with self._lock:
                self._sealed[key] = (value, ttl_s, raw, now)
            return raw
        return seal(self._secret, key, value, self._seq(), ttl_s)

    def put(self, key: str, value: bytes, *, ttl_s: float | None = None) -> int:
        return self.inner.put(key, self._seal(key, value, ttl_s), ttl_s=ttl_s)

    def put_many(self, items: Mapping[str, bytes]) -> int:
        return self.inner.put_many({k: self._seal(k, v, None) for k, v in items.items()})

    def compare_and_set(
        self, key: str, value: bytes, *, expected_revision: int
    ) -> tuple[bool, Entry | None]:
        with self._lock:
            known = self._known.get(key)
        expected = expected_revision
        if known is not None and known.junk_rev and known.entry.revision == expected_revision:
            expected = known.junk_rev  # write over the junk, as if it had never been written
        elif known is None and expected_revision == 0:
            with self._lock:
                expected = self._junk_only.get(key, 0)  # "absent": junk only
        ok, entry = self.inner.compare_and_set(
            key, self._seal(key, value, None), expected_revision=expected
        )
        if ok and entry is not None:
            entry = Entry(bytes(value), entry.revision)
            with self._lock:
                self._junk_only.pop(key, None)
                self._known[key] = _Known(entry, b"", None, self._clock.monotonic())
        return ok, entry

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        with self._lock:
            self._known.pop(key, None)
            self._sealed.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)
        with self._lock:
            for key in [k for k in self._known if k.startswith(prefix)]:
                del self._known[key]

    # -- reading ----------------------------------------------------------------------------
    def _reject(self, key: str, reason: str) -> None:
        self._rejects.report(key, reason)

    def _judge(self, key: str, raw: Entry | None) -> Entry | None:
        """What this reader takes the key to hold, given the store's entry."""
        now = self._clock.monotonic()
        with self._lock:
            known = self._known.get(key)
        if raw is None:
            with self._lock:
                self._known.pop(key, None)
                self._junk_only.pop(key, None)
            return None
        opened = open_record(self._secret, key, raw.value)
        if isinstance(opened, str):
            self._reject(key, opened)
            if known is None:
                with self._lock:
                    self._junk_only[key] = raw.revision
                return None
            known.junk_rev = raw.revision
            return self._fresh(key, known, now, replay_check=False)
        with self._lock:
            self._junk_only.pop(key, None)
            if known is None or known.seq != opened.seq or known.entry.revision > raw.revision:
                known = _Known(Entry(opened.payload, raw.revision), opened.seq, opened.ttl_s, now)
                self._known[key] = known
            else:
                known.entry = Entry(opened.payload, raw.revision)
                known.junk_rev = 0
        return self._fresh(key, known, now, replay_check=True)

    def _fresh(self, key: str, known: _Known, now: float, *, replay_check: bool) -> Entry | None:
        if known.ttl_s is None:
            return known.entry
        limit = known.ttl_s if self.judges_ttl_locally else 2 * known.ttl_s
        if now - known.seq_since < limit:
            return known.entry
        if replay_check:
            self._reject(key, "replayed keep-alive (its sequence number stopped changing)")
        return None

    def get(self, key: str) -> Entry | None:
        return self._judge(key, self.inner.get(key))

    def get_at(self, key: str) -> tuple[Entry | None, int]:
        """:meth:`get` and the store revision read before or with it (the inner store's
        ``get_at`` where it has one: see :class:`flexrun.store.api.Store`)."""
        inner = getattr(self.inner, "get_at", None)
        if inner is not None:
            raw, rev = inner(key)
        else:
            rev = self.inner.revision()
            raw = self.inner.get(key)
        return self._judge(key, raw), rev

    def get_prefix(self, prefix: str) -> dict[str, Entry]:
        raw = self.inner.get_prefix(prefix)
        with self._lock:
            gone = [k for k in self._known if k.startswith(prefix) and k not in raw]
            for k in gone:
                del self._known[k]
        out = {}
        for key, entry in raw.items():
            judged = self._judge(key, entry)
            if judged is not None:
                out[key] = judged
        return out

    def wait_for_change(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[bool, int]:
        return self.inner.wait_for_change(prefix, since_revision, timeout_s)

    def _get_prefix_at(self, prefix: str) -> tuple[dict[str, Entry], int]:
        raw, rev = self.inner.get_prefix_at(prefix)  # type: ignore[attr-defined]
        with self._lock:
            for k in [k for k in self._known if k.startswith(prefix) and k not in raw]:
                del self._known[k]
        judged = {key: self._judge(key, entry) for key, entry in raw.items()}
        return {k: e for k, e in judged.items() if e is not None}, int(rev)

    def _watch_values(
        self, prefix: str, since_revision: int, timeout_s: float
    ) -> tuple[list[Event] | None, int]:
        """The inner store's events, each value judged as :meth:`get` judges it (junk
        stands for the value last verified under its key)."""
        events, rev = self.inner.watch_values(  # type: ignore[attr-defined]
            prefix, since_revision, timeout_s
        )
        if events is None:
            return None, int(rev)
        return [(key, self._judge(key, entry)) for key, entry in events], int(rev)

    def revision(self) -> int:
        return self.inner.revision()

    def close(self) -> None:
        self.inner.close()


def is_signed(store: object) -> bool:
    """Whether ``store`` authenticates its records."""
    return isinstance(store, SignedStore)


def write_secret_file(path: str | os.PathLike[str], secret: bytes) -> Path:
    """Write a (generated) job secret for workers to read: mode 0600, created exclusively
    or replaced atomically. Returns the path (give workers ``FLEXRUN_JOB_SECRET_FILE``)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            if os.write(fd, secret) != len(secret):
                raise OSError(errno.ENOSPC, "short write", str(tmp))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)  # (a full disk: no half-written secret left behind)
        raise
    return target


_SPARE_DIRS = ("/dev/shm", tempfile.gettempdir())
"""Where a secret file goes when the run directory cannot take it (a full disk): memory
first, each time in a fresh private (0700) directory."""


def place_secret_file(preferred: Path, secret: bytes) -> Path:
    """:func:`write_secret_file` at ``preferred``, else (that disk full or read-only) in a
    private directory under ``/dev/shm`` or the temporary directory, with a warning; the
    job must not stop because its run directory is full. Remove it with
    :func:`remove_secret_file`.

    Raises:
        OSError: no candidate could take it (the last error).
    """
    try:
        return write_secret_file(preferred, secret)
    except OSError as exc:
        first, error = exc, exc
    for base in _SPARE_DIRS:
        try:
            private = Path(tempfile.mkdtemp(prefix="flexrun-secret-", dir=base))
        except OSError as exc:
            error = exc
            continue
        try:
            placed = write_secret_file(private / preferred.name, secret)
        except OSError as exc:
            private.rmdir()
            error = exc
            continue
        log.warning(
            "cannot write the job secret under %s (%s); the workers read it from %s",
            preferred.parent,
            first.strerror or first,
            placed,
        )
        return placed
    raise error


def remove_secret_file(path: Path) -> None:
    """Remove a file :func:`place_secret_file` wrote (and its private directory)."""
    path.unlink(missing_ok=True)
    if path.parent.name.startswith("flexrun-secret-"):
        with contextlib.suppress(OSError):  # (not empty: not ours alone; leave it)
            path.parent.rmdir()


__all__ = [
    "MAGIC",
    "MAX_RECORD",
    "SignedStore",
    "is_signed",
    "open_record",
    "report_to",
    "seal",
    "place_secret_file",
    "remove_secret_file",
    "write_secret_file",
]
