"""Command line: argparse -> config -> one call. No logic lives here.

``flexrun run`` takes torchrun's options (:mod:`flexrun.run_args`: both ``--nproc-per-node``
and ``--nproc_per_node`` spellings) and defaults each from ``PET_<OPTION>`` as torchrun does.
A :class:`FlexrunError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from flexrun import __version__
from flexrun.config import process_environ, run_config_from_args
from flexrun.errors import ConfigError, FlexrunError
from flexrun.run_args import add_run_parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _cmd_run(ns: argparse.Namespace) -> int:
    config = run_config_from_args(ns, ns.environ)
    ns.run_dir_used = config.output.run_dir  # (main's JobFailed points at the logs)
    if config.spares.spares_dir is not None and ns.delegate:
        # The node's `flexrun spares` may hold an agent with its imports done: run there.
        from flexrun.spares.client import run_in_warm_agent

        code = run_in_warm_agent(config.spares.spares_dir, ns.argv)
        if code is not None:
            return code
    from flexrun.agent.launch import launch

    return launch(config)


def _add_store(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser("store", help="run the embedded tcp rendezvous store as its own process")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this host only; give the address "
        "other nodes reach, or 0.0.0.0, for a multi-node job)",
    )
    p.add_argument("--port", type=int, default=29400, help="port to listen on")
    p.set_defaults(func=_cmd_store)


def _cmd_store(ns: argparse.Namespace) -> int:
    from flexrun.store.tcp import TcpStoreServer

    if not 0 <= ns.port < 65536:
        raise ConfigError(f"--port {ns.port}: out of range 0-65535")
    server = TcpStoreServer(ns.host, ns.port)
    print(f"flexrun store listening on {ns.host}:{server.port}", flush=True)
    stopped = _until_signalled()
    while not stopped():
        time.sleep(0.2)  # (signal.pause() could miss a signal that came just before it)
    server.close()
    return 0


def _until_signalled() -> Callable[[], bool]:
    """Catch SIGTERM and SIGINT from now on; the returned callable says whether one came."""
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return lambda: bool(seen)


def _add_spares(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser(
        "spares",
        help="keep warm interpreters (torch imported) on this node for the agents started here",
        description="Start with the node (or as a pod's sidecar); `flexrun run --spares-dir DIR` "
        "then takes its first workers from here instead of starting cold.",
    )
    p.add_argument("--dir", required=True, help="directory for the socket, spares and exit records")
    p.add_argument("--count", type=int, default=1, help="idle spares to keep (default 1)")
    p.add_argument(
        "--agents",
        type=int,
        default=0,
        help="idle agents to keep (imports done), so `flexrun run --spares-dir` starts at once "
        "(default 0)",
    )
    p.add_argument(
        "--refill-delay",
        type=float,
        default=5.0,
        help="seconds after a hand-over before new spares start importing (default 5)",
    )
    p.add_argument("--status", action="store_true", help="print the daemon's counts and exit")
    p.set_defaults(func=_cmd_spares)


def _cmd_spares(ns: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from flexrun.config.parsing import parse_duration
    from flexrun.spares.client import query_status
    from flexrun.spares.daemon import SparesDaemon

    root = Path(ns.dir).absolute()
    refill_delay_s = parse_duration(ns.refill_delay, "--refill-delay")
    if ns.status:
        print(json.dumps(query_status(root)))
        return 0
    daemon = SparesDaemon(
        root, ns.count, environ=ns.environ, refill_delay_s=refill_delay_s, agents=ns.agents
    )
    print(
        f"flexrun spares: keeping {ns.count} warm (and {ns.agents} agents) in {root} "
        f"(pid {os.getpid()})",
        flush=True,
    )
    daemon.serve(_until_signalled())
    return 0


# Subcommands contributed by other layers: each module exposes add_parser(subparsers).
_EXTRA_COMMANDS: tuple[str, ...] = (
    "flexrun.k8s.commands",
    "flexrun.observe.commands",
    "flexrun.pipeline.commands",
    "flexrun.testing.chaos_cmd",
)


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="flexrun", description="Elastic, fault-tolerant PyTorch training.")
    parser.add_argument("--version", action="version", version=f"flexrun {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = add_run_parser(sub, env, _cmd_run)
    run.flexrun_root = parser  # type: ignore[attr-defined]  # --print-completion's program
    _add_store(sub, env)
    _add_spares(sub, env)
    import importlib

    for name in _EXTRA_COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise  # the command exists but something it imports is missing: say so
            continue
        add: Callable[[argparse._SubParsersAction], None] = mod.add_parser
        add(sub)
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    delegate: bool = True,
    raise_on_failure: bool | None = None,
) -> int:
    """``flexrun <argv>``; returns the exit code.

    Called with ``argv`` (``flexrun.cli.main(["run", ...])``, as ``torch.distributed.run.
    main(argv)``), a ``run`` whose job fails raises :class:`~flexrun.errors.JobFailed`
    (the exit code and the root cause: torch raises ``ChildFailedError``); the console
    script (``argv`` None) returns the exit code instead. ``raise_on_failure`` overrides
    that choice. Bad input is one line on stderr and 2 either way. ``delegate=False``:
    never hand ``run`` to a warm agent (this process is one)."""
    raising = argv is not None if raise_on_failure is None else raise_on_failure
    console = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    env = process_environ()
    # Before torch loads: c10d warns about every expired bounded store wait, which the
    # agent uses on purpose. Workers get the user's own setting (captured above).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    since = time.time()
    ns: argparse.Namespace | None = None
    try:
        parser = build_parser(env)
        ns = parser.parse_args(argv)
        logging.basicConfig(
            level=logging.DEBUG if ns.verbose else logging.INFO,
            format="[flexrun] %(message)s",
            stream=sys.stderr,
        )
        ns.environ = env
        ns.argv, ns.delegate = argv, delegate
        code = int(ns.func(ns))
    except FlexrunError as exc:
        print(f"flexrun: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    else:
        if raising and code != 0 and getattr(ns, "run_dir_used", None) is not None:
            from flexrun.api import job_failure

            raise job_failure(code, ns.run_dir_used, since)
    # An agent ran (its job ended, or it failed: a rendezvous timeout, a lost store):
    # its daemon threads may still be inside store calls.
    if console and getattr(ns, "run_dir_used", None) is not None:
        _exit_without_finalizing(code)
    return code


def _exit_without_finalizing(code: int) -> None:
    """End a ``flexrun run`` process with ``code`` once everything is flushed, skipping the
    interpreter's finalization: the agent's daemon threads (the rendezvous' long store
    watch) may sit inside a C++ ``TCPStore`` wait, and finalizing under them ends the
    process in ``std::terminate`` (SIGABRT, exit -6) instead of with ``code``. Returns
    (a normal exit follows) only if the console cannot be flushed."""
    logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return  # a closed or broken console: the normal exit path (finalizing) it is
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
