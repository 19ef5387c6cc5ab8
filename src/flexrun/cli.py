"""Command line: argparse -> config -> one call. No logic lives here.

``flexrun run`` takes torchrun's options (both ``--nproc-per-node`` and
``--nproc_per_node`` spellings) and defaults each from ``PET_<OPTION>`` as torchrun does.
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
from typing import Any

from flexrun import __version__
from flexrun.config import env_default, env_flag, process_environ, run_config_from_args
from flexrun.errors import ConfigError, FlexrunError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _opt(
    p: argparse.ArgumentParser,
    env: Mapping[str, str],
    name: str,
    default: str | None,
    help: str,
    **kw: Any,
) -> None:
    spellings = [f"--{name}"]
    if "-" in name:
        spellings.append("--" + name.replace("-", "_"))
    p.add_argument(
        *spellings,
        dest=name.replace("-", "_"),
        default=env_default(env, name, default),
        help=help,
        **kw,
    )


def _flag(
    p: argparse.ArgumentParser,
    env: Mapping[str, str],
    name: str,
    help: str,
    short: str | None = None,
) -> None:
    spellings = ([short] if short else []) + [f"--{name}"]
    if "-" in name:
        spellings.append("--" + name.replace("-", "_"))
    p.add_argument(
        *spellings,
        dest=name.replace("-", "_"),
        action="store_true",
        default=env_flag(env, name),
        help=help,
    )


def _add_run(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser(
        "run",
        help="launch an elastic training job (torchrun-compatible flags)",
        description="Start this node's elastic agent. Options default from PET_<OPTION> like torchrun.",
    )
    _opt(p, env, "nnodes", "1", "number of nodes, N or MIN:MAX")
    _opt(p, env, "nproc-per-node", "1", "workers per node: N, auto, cpu or gpu")
    _opt(p, env, "rdzv-backend", "c10d", "c10d/tcp (embedded store), static, etcd/etcd-v3")
    _opt(p, env, "rdzv-endpoint", "", "store address HOST:PORT (etcd: comma-separated list)")
    _opt(p, env, "rdzv-id", "", "job id shared by all nodes")
    _opt(
        p,
        env,
        "rdzv-conf",
        "",
        "k=v,...: join_timeout, last_call_timeout, heartbeat_interval, "
        "heartbeat_timeout, connect_timeout, is_host",
    )
    _flag(p, env, "standalone", "single node with an embedded store on a free port")
    _opt(p, env, "max-restarts", "0", "failures tolerated per job before giving up", type=int)
    _opt(p, env, "monitor-interval", "0.1", "seconds between worker health checks", type=float)
    _opt(p, env, "stop-grace", "30", "seconds between SIGTERM and SIGKILL for workers", type=float)
    _opt(p, env, "role", "default", "worker role name (ROLE_NAME)")
    _opt(p, env, "log-dir", None, "directory for per-rank logs (default: RUN_DIR/logs)")
    _opt(p, env, "run-dir", None, "run directory (default: ./flexrun-runs/<rdzv-id>)")
    _opt(
        p,
        env,
        "redirects",
        "0",
        "streams kept out of the console (files only): 0 none, 1 out, 2 err, 3 both",
    )
    _opt(
        p,
        env,
        "tee",
        "0",
        "streams also shown on the console: 0-3 (all are by default unless redirected)",
    )
    _opt(p, env, "local-addr", None, "address other nodes use to reach this one (MASTER_ADDR)")
    _opt(p, env, "node-rank", "0", "static backend: which node hosts the store (0)")
    _opt(p, env, "master-addr", "127.0.0.1", "static backend: store host")
    _opt(p, env, "master-port", "29500", "static backend: store port")
    _opt(p, env, "node-id", None, "unique id of this node (default host-pid-random)")
    _opt(
        p,
        env,
        "mode",
        "auto",
        "recovery mode: live (survivors never restart; scripts using "
        "flexrun.train.LiveLoop), restart (torchrun semantics), auto (live if the script uses LiveLoop)",
    )
    _opt(
        p,
        env,
        "hang-timeout",
        "0",
        "seconds without step progress (flexrun.train.report_progress) "
        "before a rank's stacks are captured and it is failed; 0: off",
    )
    _opt(p, env, "metrics-port", None, "serve Prometheus metrics on this port (default: off)")
    _opt(
        p,
        env,
        "resource-interval",
        "10",
        "seconds between node resource samples in the event log (0: off)",
    )
    _opt(
        p,
        env,
        "warm-spares",
        None,
        "idle interpreters with torch imported, kept to replace workers: live mode "
        "default 1, restart mode default nproc-per-node (a restart then skips the cold start); 0: none",
    )
    _opt(
        p,
        env,
        "spares-dir",
        None,
        "directory of this node's `flexrun spares`: take warm interpreters from it first "
        "(default: off)",
    )
    _flag(p, env, "module", "run the entrypoint as a Python module (python -m)", short="-m")
    _flag(p, env, "no-python", "run the entrypoint as an executable, not with python")
    p.add_argument("training_script", help="script (or module, or executable)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_run)


def _cmd_run(ns: argparse.Namespace) -> int:
    config = run_config_from_args(ns, ns.environ)
    if config.spares_dir is not None and ns.delegate:
        # The node's `flexrun spares` may hold an agent with its imports done: run there.
        from flexrun.spares.client import run_in_warm_agent

        code = run_in_warm_agent(config.spares_dir, ns.argv)
        if code is not None:
            return code
    from flexrun.agent.launch import launch

    return launch(config)


def _add_store(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    p = sub.add_parser("store", help="run the embedded tcp rendezvous store as its own process")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
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

    from flexrun.spares.client import query_status
    from flexrun.spares.daemon import SparesDaemon

    root = Path(ns.dir).absolute()
    if ns.status:
        print(json.dumps(query_status(root)))
        return 0
    daemon = SparesDaemon(
        root, ns.count, environ=ns.environ, refill_delay_s=ns.refill_delay, agents=ns.agents
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
    _add_run(sub, env)
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


def main(argv: Sequence[str] | None = None, *, delegate: bool = True) -> int:
    """``flexrun <argv>``; ``delegate=False``: never hand ``run`` to a warm agent (this
    process is one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = process_environ()
    # Before torch loads: c10d warns about every expired bounded store wait, which the
    # agent uses on purpose. Workers get the user's own setting (captured above).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
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
        return int(ns.func(ns))
    except FlexrunError as exc:
        print(f"flexrun: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
