"""The pipeline state file and content hashes: what ran, with what, and how it ended.

Owns ``<run dir>/pipeline-state.json`` (schema-versioned JSON, rewritten atomically:
temporary file, fsync, rename) and the content hash of files and directories. It does not
decide what to run (``runner``); :func:`summarize` turns it into the rows ``flexrun
pipeline status`` prints. A state file that is binary, not UTF-8, not JSON or not an
object of this shape is one clear error (delete it to start over), never a traceback.

Per stage: ``status`` (pending, running, succeeded, failed, interrupted, blocked),
``key`` (hash of command, environment, input contents and upstream keys: equal key and
present outputs mean the stage can be skipped), ``started``/``finished`` (epoch seconds),
``duration_s``, ``attempts``, ``exit_code``, ``cached`` (skipped in the latest run),
``command``, ``inputs``/``outputs`` (path -> sha256), ``pid`` (session of the running
attempt, so a later run can stop what a killed runner left behind) and ``message``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError

STATE_FILE = "pipeline-state.json"
FORMAT_VERSION = 1
STATUSES = ("pending", "running", "succeeded", "failed", "interrupted", "blocked")
_CHUNK = 1 << 20


def hash_path(path: Path) -> str | None:
    """sha256 of a file's bytes, or of a directory's relative names and file hashes.

    ``None`` when the path does not exist. Symlinks are followed (a ``current`` pointer
    hashes as what it points to).
    """
    if path.is_file():
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()
    if path.is_dir():
        h = hashlib.sha256(b"dir\0")
        for child in sorted(path.rglob("*")):
            if child.is_file():
                h.update(child.relative_to(path).as_posix().encode() + b"\0")
                h.update((hash_path(child) or "").encode() + b"\0")
        return h.hexdigest()
    return None


def stage_key(
    *,
    command: list[str],
    env: Mapping[str, str],
    inputs: Mapping[str, str | None],
    upstream: Mapping[str, str],
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The cache key of one stage: equal keys mean the same work on the same data."""
    blob = json.dumps(
        {
            "command": command,
            "env": dict(sorted(env.items())),
            "inputs": dict(sorted(inputs.items())),
            "upstream": dict(sorted(upstream.items())),
            "extra": extra or {},
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _not_state(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path}: not a pipeline state file ({why}); delete it to start over")


def _parse(raw: bytes, path: Path) -> dict[str, Any]:
    """The state file's JSON, checked for the shape the runner relies on."""
    if b"\0" in raw:
        raise _not_state(path, "a binary file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_state(path, f"not UTF-8 text at byte {exc.start}") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        raise _not_state(path, str(exc)) from exc
    except RecursionError as exc:
        raise _not_state(path, "JSON nested too deeply") from exc
    if not isinstance(data, dict):
        raise _not_state(path, f"a JSON {type(data).__name__}, not an object")
    stages = data.get("stages")
    if not isinstance(stages, dict) or not all(isinstance(r, dict) for r in stages.values()):
        raise _not_state(path, "'stages' must map stage names to objects")
    order = data.get("order")
    if order is not None and (
        not isinstance(order, list) or not all(isinstance(n, str) for n in order)
    ):
        raise _not_state(path, "'order' must be a list of stage names")
    if data.get("version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path}: state format {data.get('version')!r}, expected {FORMAT_VERSION}"
        )
    return data


class StateFile:
    """The run directory's state, shared by the runner's threads (one lock)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / STATE_FILE
        self._lock = threading.Lock()
        self.data: dict[str, Any] = {"version": FORMAT_VERSION, "stages": {}}

    @classmethod
    def load(cls, run_dir: Path) -> StateFile:
        """Read the state (an empty one when the file does not exist).

        Raises:
            ConfigError: the file exists but is unreadable or not a state file (binary,
                not UTF-8, not JSON, not an object of the expected shape).
        """
        state = cls(run_dir)
        try:
            raw = state.path.read_bytes()
        except FileNotFoundError:
            return state
        except OSError as exc:
            raise ConfigError(f"{state.path}: cannot read ({exc.strerror})") from exc
        state.data = _parse(raw, state.path)
        return state

    def stage(self, name: str) -> dict[str, Any]:
        """A copy of one stage's record (empty when it never ran)."""
        with self._lock:
            return dict(self.data["stages"].get(name, {}))

    @contextmanager
    def edit(self, name: str) -> Iterator[dict[str, Any]]:
        """Change one stage's record, then write the file (atomically)."""
        with self._lock:
            rec = self.data["stages"].setdefault(name, {})
            yield rec
            self._write()

    def set_meta(self, **fields: Any) -> None:
        with self._lock:
            self.data.update(fields)
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with tmp.open("w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            raise ConfigError(f"{self.path}: cannot write state ({exc.strerror})") from exc


def _seconds(value: object) -> float | None:
    """A recorded duration, or None when it is not a plausible one (a hand-edited file
    may hold ``1e999`` read as infinity, or an integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not 0 <= value <= 1e12:  # (exact for ints of any size; False for NaN)
        return None
    return float(value)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def summarize(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Rows for ``flexrun pipeline status``: stage, status, duration, attempts, message."""
    stages = state.get("stages", {})
    raw_order = state.get("order")
    order = (
        [n for n in raw_order if isinstance(n, str) and n in stages]
        if isinstance(raw_order, list)
        else []
    )
    order += [n for n in stages if n not in order]
    rows = []
    for name in order:
        rec = stages[name]
        status = str(rec.get("status", "pending"))
        if status == "succeeded" and rec.get("cached"):
            status = "succeeded (cached)"
        attempts = rec.get("attempts", 0)
        rows.append(
            {
                "stage": str(name),
                "status": status,
                "duration_s": _seconds(rec.get("duration_s")),
                "attempts": attempts if _count(attempts) else 0,
                "message": str(rec.get("message") or ""),
            }
        )
    return rows
