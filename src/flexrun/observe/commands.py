"""``flexrun status|report|doctor``: argparse wiring for the observability commands.

Owns the flags of these subcommands and their one call each into ``status``, ``report``
and ``doctor``; no logic beyond printing. ``flexrun.cli`` registers them with
``add_parser(subparsers)``; each sets ``func(args) -> int``. Heavy or optional packages
(rich, matplotlib, prometheus-client) are imported only when a command runs, so the CLI
starts even where one is missing and the command then says what to install.
Bad input raises :class:`~flexrun.errors.ConfigError` (the CLI prints one line, exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from flexrun._cmdutil import standalone_main
from flexrun.errors import ConfigError


def _need(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"this command needs {package}: pip install {package}") from exc


def status_command(args: argparse.Namespace) -> int:
    """Print the job's round, members and waiting nodes; 0 when found.

    Raises:
        ConfigError: bad options, or no job with this id in the store (exit 2).
        StoreUnavailable: the store does not answer (exit 2).
    """
    from flexrun.config.parsing import parse_duration
    from flexrun.observe import status as st

    observe = parse_duration(args.observe, "--observe")
    watch = parse_duration(args.watch, "--watch")
    settings = st.store_settings_from_args(
        args.rdzv_backend,
        args.rdzv_endpoint or "",
        args.rdzv_conf or "",
        connect_timeout_s=parse_duration(args.connect_timeout, "--connect-timeout", positive=True),
    )
    if not args.rdzv_id:
        raise ConfigError("--rdzv-id is required: the job id the agents were started with")
    store = st.open_status_store(settings)
    try:
        while True:
            job = st.read_status(store, args.rdzv_id, observe_s=observe)
            if args.json:
                print(st.status_json(job), flush=True)
            else:
                _need("rich", "rich")
                from rich.console import Console

                Console().print(st.render_table(job))
            if not watch:
                return 0
            import time

            time.sleep(max(watch - observe, 0.0))
    except KeyboardInterrupt:
        return 0
    finally:
        store.close()


def report_command(args: argparse.Namespace) -> int:
    """Write report.html (and PNGs) for the run directories given; 0 on success.

    Raises:
        ConfigError: a path is missing or holds no events, or the output is unwritable.
    """
    _need("matplotlib", "matplotlib")
    from flexrun.observe.report import build_report

    page, analysis = build_report(args.run_dir, args.output)
    n = analysis.skipped_events
    print(f"wrote {page}" + (f" ({n} malformed event line(s) skipped)" if n else ""))
    return 0


def _rdzv_options(p: argparse.ArgumentParser) -> None:
    """The job's rendezvous options, defaulting from ``PET_*`` like ``flexrun run``."""
    from flexrun.config import env_default, process_environ

    env = process_environ()

    for name, default, help_ in (
        ("rdzv-backend", "c10d", "c10d/tcp (embedded store) or etcd/etcd-v3, as for the job"),
        ("rdzv-endpoint", "", "the job's store HOST:PORT (etcd: comma-separated list)"),
        ("rdzv-id", "", "the job id"),
        ("rdzv-conf", "", "k=v,... (connect_timeout, TLS options for etcd)"),
    ):
        p.add_argument(
            f"--{name}",
            f"--{name.replace('-', '_')}",
            dest=name.replace("-", "_"),
            default=env_default(env, name, default),
            help=help_,
        )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``status``, ``report`` and ``doctor``."""
    p = subparsers.add_parser(
        "status",
        help="show a running job: round, members, ranks, heartbeats, waiting nodes",
        description="Read a job's rendezvous state from its store (read-only) and print it.",
    )
    _rdzv_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--observe",
        type=float,
        default=1.2,
        metavar="S",
        help="seconds to watch keep-alives to measure heartbeat age (default 1.2)",
    )
    p.add_argument(
        "--watch",
        type=float,
        default=0.0,
        metavar="S",
        help="refresh every S seconds until interrupted (default: print once)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="give up reaching the store after S seconds (default 10)",
    )
    p.set_defaults(func=status_command)

    r = subparsers.add_parser(
        "report",
        help="write report.html (timeline, incidents, ETTR) from a run's event logs",
        description="Merge the events.jsonl files under the given run directories (one per "
        "node is fine) and write a self-contained report.html with PNG figures.",
    )
    r.add_argument("run_dir", nargs="+", metavar="RUN_DIR", help="run directories or event files")
    r.add_argument(
        "-o", "--output", metavar="DIR", help="where to write (default: the first RUN_DIR)"
    )
    r.set_defaults(func=report_command)

    try:
        doctor = importlib.import_module("flexrun.observe.doctor")
    except ModuleNotFoundError as exc:
        if exc.name != "flexrun.observe.doctor":
            raise
        return
    doctor.add_arguments(
        subparsers.add_parser(
            "doctor",
            help="pre-flight check of a job's nodes: store, join, all-reduce, matmul, stragglers",
            description="Run on every node of a job with the job's rendezvous options.",
        ),
        _rdzv_options,
    )


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (``python -m flexrun.observe.commands``)."""
    return standalone_main(add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
