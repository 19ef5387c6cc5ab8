"""The pipeline state file and content hashes: what ran, with what, and how it ended.

Owns ``<run dir>/pipeline-state.json`` (schema-versioned JSON, rewritten atomically:
temporary file, fsync, rename) and the content hash of files and directories. It does not
decide what to run (``runner``).

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
            ConfigError: the file exists but is unreadable or not a state file.
        """
        state = cls(run_dir)
        try:
            text = state.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return state
        except OSError as exc:
            raise ConfigError(f"{state.path}: cannot read ({exc.strerror})") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{state.path}: not a pipeline state file ({exc}); delete it to start over"
            ) from exc
        if not isinstance(data, dict) or not isinstance(data.get("stages"), dict):
            raise ConfigError(f"{state.path}: not a pipeline state file; delete it to start over")
        if data.get("version") != FORMAT_VERSION:
            raise ConfigError(
                f"{state.path}: state format {data.get('version')!r}, expected {FORMAT_VERSION}"
            )
        state.data = data
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
