"""The Python launch API: ``flexrun.launch`` and ``flexrun.elastic_launch``.

Owns starting a job from Python, as ``torch.distributed.launcher.api.elastic_launch``
does: a script or a callable entrypoint, per-rank return values, and a failed job raised
as :class:`~flexrun.errors.JobFailed` with the failing rank's exception type, message and
traceback. It sits above the agent, like the CLI: the job runs under a ``flexrun run``
agent in a child process (its own session, dying with this one), with exactly the
command line's options and semantics.

How a callable reaches the workers: by reference, never as a pickled function. Each
worker runs ``python -m flexrun.api``, which re-imports the callable's module and looks up
its qualified name (a function defined in the main script is found by re-running that
script as ``__mp_main__``, as multiprocessing's spawn does; lambdas, closures and
functions typed into an interactive session are refused). The arguments, and each
rank's return value or exception, travel as pickles in a private directory (mode 0700,
made for this launch and removed after it), each prefixed with an HMAC-SHA256 under a
random key that reaches the workers only through their environment: a file that someone
swapped in is refused before it is unpickled.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import importlib
import json
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError, JobFailed

API_DIR_ENV = "FLEXRUN_API_DIR"
"""The worker variable naming the launch's private directory."""
API_KEY_ENV = "FLEXRUN_API_KEY"
"""The worker variable holding the launch's HMAC key (hex)."""
WORKER_MODULE = "flexrun.api"
_CALL = "call"
_MAC_LEN = hashlib.sha256().digest_size


# -- the caller's side ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """torch's ``LaunchConfig`` fields that flexrun honours (a torch ``LaunchConfig`` is
    accepted too); ``options`` holds any other ``flexrun run`` option by its dest name
    (``{"mode": "live", "hang_timeout": 30}``)."""

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = ""
    role: str = "default"
    rdzv_endpoint: str = ""
    rdzv_backend: str = ""
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    max_restarts: int = 0
    monitor_interval: float | None = None
    local_addr: str | None = None
    log_line_prefix_template: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


def launch(
    entrypoint: Callable[..., Any] | str,
    *args: Any,
    nproc_per_node: int = 1,
    nnodes: int | str = 1,
    max_restarts: int = 0,
    fn_kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> dict[int, Any]:
    """Run ``entrypoint`` on ``nproc_per_node`` local workers (of an ``nnodes`` job) and
    return this node's ranks' return values, ``{rank: value}``.

    ``entrypoint`` is a callable (called as ``entrypoint(*args, **fn_kwargs)`` in every
    rank) or a script path (run with ``args`` as its command line; values are None).
    ``options`` are ``flexrun run`` options by their dest name (``rdzv_endpoint=``,
    ``run_dir=``, ``mode=``, ``standalone=True``...); ``env`` is added to the workers'
    environment.

    Raises:
        ConfigError: bad options, or a callable the workers cannot import.
        JobFailed: the job failed (the failing rank's exception, message and traceback).
    """
    flags = {"nproc_per_node": nproc_per_node, "nnodes": nnodes, "max_restarts": max_restarts}
    flags.update(options)
    with tempfile.TemporaryDirectory(prefix="flexrun-api-") as tmp:
        private = Path(tmp)  # (mkdtemp: mode 0700, this user's only)
        key = secrets.token_bytes(32)
        extra = {**(env or {}), API_DIR_ENV: str(private), API_KEY_ENV: key.hex()}
        if callable(entrypoint):
            _write_call(private, key, entrypoint, args, dict(fn_kwargs or {}))
            target = ["-m", WORKER_MODULE]
        else:
            if fn_kwargs:
                raise ConfigError("fn_kwargs: only a callable entrypoint takes keyword arguments")
            target = [os.fspath(entrypoint), *map(str, args)]
        argv = [*option_args(flags), *target]
        return _run(argv, extra, private, key)


def elastic_launch(
    config: Any, entrypoint: Callable[..., Any] | str | None = None
) -> Callable[..., Any]:
    """torch's ``elastic_launch(config, entrypoint)(*args)``; also
    ``elastic_launch(config)(entrypoint)(*args)``. ``config`` is a :class:`LaunchConfig`
    or torch's own."""
    flags = flags_of(config)

    def bind(ep: Callable[..., Any] | str) -> Callable[..., dict[int, Any]]:
        def run(*args: Any) -> dict[int, Any]:
            f = dict(flags)
            return launch(
                ep,
                *args,
                nproc_per_node=f.pop("nproc_per_node"),
                nnodes=f.pop("nnodes"),
                max_restarts=f.pop("max_restarts"),
                **f,
            )

        return run

    return bind if entrypoint is None else bind(entrypoint)


def flags_of(config: Any) -> dict[str, Any]:
    """``flexrun run`` options from a :class:`LaunchConfig` (or torch's, read by name)."""
    lo, hi = int(getattr(config, "min_nodes", 1)), int(getattr(config, "max_nodes", 1))
    flags: dict[str, Any] = {
        "nproc_per_node": int(getattr(config, "nproc_per_node", 1)),
        "nnodes": f"{lo}" if lo == hi else f"{lo}:{hi}",
        "max_restarts": int(getattr(config, "max_restarts", 0)),
    }
    for name, dest in (
        ("run_id", "rdzv_id"),
        ("role", "role"),
        ("rdzv_endpoint", "rdzv_endpoint"),
        ("rdzv_backend", "rdzv_backend"),
        ("local_addr", "local_addr"),
    ):
        value = getattr(config, name, None)
        if value:
            flags[dest] = value
    for name in ("monitor_interval", "log_line_prefix_template"):
        if getattr(config, name, None) is not None:
            flags[name] = getattr(config, name)
    conf = dict(getattr(config, "rdzv_configs", None) or {})
    if conf:
        flags["rdzv_conf"] = conf
    flags.update(getattr(config, "options", None) or {})
    return flags


def option_args(flags: Mapping[str, Any]) -> list[str]:
    """``{"max_restarts": 1, "standalone": True}`` -> ``["--max-restarts", "1",
    "--standalone"]`` (None and False leave an option out; a mapping becomes ``k=v,...``,
    a sequence ``a,b``)."""
    out: list[str] = []
    for dest, value in flags.items():
        if value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, Mapping):
            out += [flag, ",".join(f"{k}={v}" for k, v in value.items())]
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, os.fspath(value) if isinstance(value, os.PathLike) else str(value)]
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"flexrun.launch: {message}")


def _validate(argv: Sequence[str], environ: Mapping[str, str]) -> Path:
    """Parse ``flexrun run argv`` as the CLI would; return the run directory.

    Raises:
        ConfigError: what ``flexrun run`` would refuse with exit 2.
    """
    from flexrun.config import run_config_from_args
    from flexrun.run_args import add_run_parser

    parser = _Parser(prog="flexrun")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_run_parser(sub, environ, lambda ns: 0)
    return run_config_from_args(parser.parse_args(["run", *argv]), environ).output.run_dir


def _run(argv: list[str], extra: Mapping[str, str], private: Path, key: bytes) -> dict[int, Any]:
    from flexrun.config import process_environ
    from flexrun.proc import spawn

    environ = {**process_environ(), **extra}
    run_dir = _validate(argv, environ)
    since = time.time()
    agent = spawn([sys.executable, "-m", "flexrun", "run", *argv], environ, stdin=None)
    try:
        code = agent.wait()
    except KeyboardInterrupt:
        # The agent runs in a session of its own: pass the interrupt on, let it stop the
        # workers, then let the caller see the interrupt.
        with contextlib.suppress(ProcessLookupError):
            agent.send_signal(signal.SIGINT)
        try:
            agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        raise
    records = read_records(private, key)
    if code != 0:
        raise job_failure(code, run_dir, since, records)
    values = {rank: rec[1] for rank, rec in records.items() if rec[0] == "ok"}
    for rank in started_ranks(run_dir, since):
        values.setdefault(rank, None)
    return dict(sorted(values.items()))


def _write_call(
    private: Path, key: bytes, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
) -> None:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise ConfigError(
            f"flexrun.launch: {fn!r} cannot be imported by the workers (a lambda, a nested "
            "function or a callable object): define it at the top level of a module"
        )
    main_path = None
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if main_file is None:
            raise ConfigError(
                f"flexrun.launch: {qualname} was defined in an interactive session, which "
                "the workers cannot import: define it in a module (a .py file) and import it"
            )
        main_path = str(Path(main_file).absolute())
    try:
        payload = pickle.dumps((args, kwargs))
    except Exception as exc:  # (pickle raises PicklingError, TypeError, AttributeError)
        raise ConfigError(f"flexrun.launch: the arguments cannot be pickled: {exc}") from exc
    call = {
        "module": module,
        "qualname": qualname,
        "main_path": main_path,
        "sys_path": [p for p in sys.path if p],
        "args": payload,
    }
    _seal(private / _CALL, key, pickle.dumps(call))


def read_records(private: Path, key: bytes) -> dict[int, tuple[Any, ...]]:
    """Each rank's record of its newest attempt: ``("ok", value)`` or ``("error", type,
    message, traceback, attempt)``. A record whose HMAC does not verify is skipped."""
    newest: dict[int, tuple[int, tuple[Any, ...]]] = {}
    for path in private.glob("rank_*.rec"):
        try:
            rank, attempt = (int(x) for x in path.name[5:-4].split("."))
            data = _open_sealed(path, key)
        except (ValueError, OSError):
            continue
        if data is None:
            continue
        if rank not in newest or attempt > newest[rank][0]:
            newest[rank] = (attempt, pickle.loads(data))
    return {rank: rec for rank, (_, rec) in newest.items()}


def _events_since(run_dir: Path, since: float) -> list[dict[str, Any]]:
    from flexrun.events import read_events

    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    return [e for e in read_events(path) if float(e.get("ts", 0)) >= since]


def started_ranks(run_dir: Path, since: float) -> list[int]:
    """The ranks of this node's last round started after ``since`` (from its event log)."""
    events = [e for e in _events_since(run_dir, since) if e.get("event") == "worker_started"]
    if not events:
        return []
    last = events[-1].get("round")
    return sorted({int(e["rank"]) for e in events if e.get("round") == last and "rank" in e})


def job_failure(
    code: int,
    run_dir: Path,
    since: float,
    records: Mapping[int, tuple[Any, ...]] | None = None,
) -> JobFailed:
    """The error for a job that ended with exit ``code``: the root cause from the ranks'
    records (callables) or the agent's last ``failure`` event after ``since``."""
    errors = [(rank, rec) for rank, rec in (records or {}).items() if rec[0] == "error"]
    failures = {rank: (rec[1], rec[2], rec[3]) for rank, rec in errors}
    causes = [e for e in _events_since(run_dir, since) if e.get("event") == "failure"]
    cause = causes[-1] if causes else {}
    blamed = cause.get("rank")
    if errors:
        newest = max(rec[4] for _, rec in errors)
        latest = sorted(rank for rank, rec in errors if rec[4] == newest)
        rank = blamed if blamed in latest else latest[0]
        exc_type, message, tb = failures[rank]
    else:
        rank = blamed if isinstance(blamed, int) else None
        exc_type, message, tb = "", str(cause.get("message", "")), str(cause.get("traceback", ""))
    if exc_type:
        what = f"rank {rank} raised {exc_type}: {message}"
    elif rank is not None:
        what = f"rank {rank} failed: {message or 'no message'}"
    else:
        what = message or "no root cause recorded"
    return JobFailed(
        f"job failed (exit code {code}): {what} (logs: {run_dir})",
        exit_code=code,
        rank=rank,
        exc_type=exc_type,
        exc_message=message,
        remote_traceback=tb,
        failures=failures,
    )


def _seal(path: Path, key: bytes, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(hmac.new(key, data, hashlib.sha256).digest() + data)
    os.replace(tmp, path)


def _open_sealed(path: Path, key: bytes) -> bytes | None:
    blob = path.read_bytes()
    mac, data = blob[:_MAC_LEN], blob[_MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).digest()):
        return None
    return data


# -- the worker's side (python -m flexrun.api) -----------------------------------------------
def _resolve(call: Mapping[str, Any]) -> Callable[..., Any]:
    if call["main_path"] is not None:
        # The caller's main script, re-run under __mp_main__ (its `if __name__ ==
        # "__main__":` block does not run), also as __main__ for pickles that name it.
        main = types.ModuleType("__mp_main__")
        main.__file__ = call["main_path"]
        sys.modules["__mp_main__"] = sys.modules["__main__"] = main
        source = Path(call["main_path"]).read_bytes()
        exec(compile(source, call["main_path"], "exec"), main.__dict__)
        obj: Any = main
    else:
        obj = importlib.import_module(call["module"])
    for part in call["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _write_error_file(exc: BaseException, tb: str) -> None:
    """torch's ``@record`` error file, so the agent's root cause is this exception."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": tb, "timestamp": str(int(time.time()))},
        }
    }
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(record))


def worker_main() -> int:
    """Run this rank's share of a :func:`launch`: call the callable, seal the result."""
    private = Path(os.environ[API_DIR_ENV])
    key = bytes.fromhex(os.environ[API_KEY_ENV])
    data = _open_sealed(private / _CALL, key)
    if data is None:
        print("flexrun.api: the call record failed its HMAC check: refused", file=sys.stderr)
        return 2
    call = pickle.loads(data)
    sys.path[:0] = [p for p in call["sys_path"] if p not in sys.path]
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = private / f"rank_{rank}.{attempt}.rec"
    try:
        fn = _resolve(call)
        args, kwargs = pickle.loads(call["args"])
        value = fn(*args, **kwargs)
        try:
            result = pickle.dumps(("ok", value))
        except Exception as exc:
            raise TypeError(f"the return value of rank {rank} cannot be pickled: {exc}") from exc
    except Exception as exc:
        tb = traceback.format_exc()
        kind = type(exc)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        _seal(out, key, pickle.dumps(("error", name, str(exc), tb, attempt)))
        _write_error_file(exc, tb)
        sys.stderr.write(tb)
        return 1
    _seal(out, key, result)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
