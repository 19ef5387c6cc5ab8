"""``flexrun pipeline run|status|render|rollback``: argparse wiring for the pipeline commands.

Owns the subcommands' flags, signal handling of a local run (SIGINT/SIGTERM stop the
running stages cleanly) and printing; the work is one call each into ``runner``,
``argo`` or ``versions``. Bad input raises :class:`~flexrun.errors.SpecError` or
:class:`~flexrun.errors.ConfigError` (the CLI prints one line and exits 2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

from flexrun._cmdutil import write_output
from flexrun.errors import ConfigError


def run_command(args: argparse.Namespace) -> int:
    """Run a pipeline locally; 0 success, 1 a stage failed, 128+N stopped by signal N.

    Raises:
        SpecError: the spec is invalid or an external input is missing.
        ConfigError: the run directory is unusable or in use.
    """
    from flexrun.pipeline.runner import Runner, RunOptions
    from flexrun.pipeline.spec import load_pipeline

    pipeline = load_pipeline(args.pipeline)
    run_dir = Path(args.run_dir or Path("flexrun-runs") / pipeline.name)
    options = RunOptions(
        run_dir=run_dir, max_parallel=args.max_parallel, stop_grace_s=args.stop_grace
    )
    environ = getattr(args, "environ", None)
    runner = Runner(pipeline, options, environ=dict(os.environ if environ is None else environ))

    def handler(signum: int, frame: object) -> None:
        runner.request_stop(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return runner.run()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _fmt_duration(value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    return f"{value:.1f}s"


def status_command(args: argparse.Namespace) -> int:
    """Print each stage's status and duration from a run directory's state file.

    Raises:
        ConfigError: no state file there, or it is unreadable.
    """
    from flexrun.pipeline.runner import summarize
    from flexrun.pipeline.state import STATE_FILE, StateFile

    run_dir = Path(args.run_dir)
    if not (run_dir / STATE_FILE).is_file():
        raise ConfigError(f"{run_dir}: no {STATE_FILE}; is it a `flexrun pipeline run` directory?")
    data = StateFile.load(run_dir).data
    rows = summarize(data)
    if args.json:
        print(
            json.dumps(
                {
                    "pipeline": data.get("pipeline"),
                    "status": data.get("run_status"),
                    "stages": rows,
                },
                indent=2,
            )
        )
        return 0
    print(f"pipeline {data.get('pipeline', '?')}: {data.get('run_status', 'unknown')}")
    width = max([len("STAGE"), *(len(r["stage"]) for r in rows)])
    print(f"{'STAGE':<{width}}  {'STATUS':<19} {'DURATION':>9} {'ATTEMPTS':>8}  MESSAGE")
    for r in rows:
        print(
            f"{r['stage']:<{width}}  {r['status']:<19} {_fmt_duration(r['duration_s']):>9} "
            f"{r['attempts']:>8}  {r['message']}"
        )
    return 0


def render_command(args: argparse.Namespace) -> int:
    """Render the pipeline for a cluster target (Argo Workflows) to stdout or ``-o``.

    Raises:
        SpecError: the spec (or its train stage as a k8s job) is invalid.
        ConfigError: the output file cannot be written.
    """
    from flexrun.pipeline.argo import render_workflow, to_yaml
    from flexrun.pipeline.spec import load_pipeline

    text = to_yaml(render_workflow(load_pipeline(args.pipeline)))
    write_output(text, args.output)
    return 0


def rollback_command(args: argparse.Namespace) -> int:
    """Point a model registry's ``current`` at an older version.

    Raises:
        ConfigError: no such registry or version.
    """
    from flexrun.pipeline.versions import rollback

    root = Path(args.registry)
    if not root.is_dir():
        raise ConfigError(f"{root}: no such model directory (the export stage's output)")
    old, new = rollback(root, args.to)
    print(f"{root}: current {old or '(none)'} -> {new}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pipeline`` with ``run``, ``status``, ``render`` and ``rollback``."""
    p = subparsers.add_parser(
        "pipeline",
        help="pipelines: run locally (cached, resumable), status, render for Argo, rollback",
        description="Run a pipeline of stages (preprocess -> elastic train -> evaluate -> "
        "export) locally, or render it as an Argo Workflow.",
    )
    sub = p.add_subparsers(
        dest="pipeline_command", metavar="{run,status,render,rollback}", required=True
    )

    run = sub.add_parser(
        "run",
        help="run the stages that are not up to date, in dependency order",
        description="Run a pipeline locally. Unchanged stages are skipped; an interrupted "
        "run resumes at the first incomplete stage (training from its checkpoint).",
    )
    run.add_argument("pipeline", metavar="PIPELINE.yaml")
    run.add_argument(
        "--run-dir",
        "--run_dir",
        dest="run_dir",
        default=None,
        help="where stages run and state/logs live (default ./flexrun-runs/<pipeline name>)",
    )
    run.add_argument(
        "--max-parallel",
        type=int,
        default=0,
        help="most stages running at once (default 0: every ready stage)",
    )
    run.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        help="seconds between SIGTERM and SIGKILL when stopping a stage (default 30)",
    )
    run.set_defaults(func=run_command)

    status = sub.add_parser("status", help="stages of a run with status and duration")
    status.add_argument("run_dir", metavar="RUN_DIR")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=status_command)

    render = sub.add_parser(
        "render",
        help="render for a cluster: an Argo Workflow with the train stage as a PyTorchJob",
    )
    render.add_argument("pipeline", metavar="PIPELINE.yaml")
    render.add_argument("--target", choices=["argo"], default="argo", help="only argo for now")
    render.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    render.set_defaults(func=render_command)

    rollback = sub.add_parser(
        "rollback", help="point a model directory's `current` at an older version"
    )
    rollback.add_argument("registry", metavar="MODELS_DIR", help="holds v1, v2, ... and current")
    rollback.add_argument("--to", metavar="vN", help="version to serve (default: the previous)")
    rollback.set_defaults(func=rollback_command)
