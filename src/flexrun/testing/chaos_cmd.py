"""``flexrun chaos``: run a job under a seeded fault schedule and check every invariant.

Owns only argument parsing and printing; the schedule, harness and injector are in
``flexrun.testing.chaos``, the verdict in ``flexrun.testing.invariants``.

    flexrun chaos schedule --seed 3 --duration 600 --interval 6
    flexrun chaos run --root /tmp/chaos --seed 3 --duration 600 --interval 6 --steps 6000
    flexrun chaos run --root /tmp/hsdp --launcher live --nproc 2 --shards 2 --seed 3  # HSDP
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of faults")
    p.add_argument("--interval", type=float, default=15.0, help="mean seconds between faults")
    p.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all of them)")


def _check_numbers(ns: argparse.Namespace) -> None:
    from flexrun.config.parsing import parse_duration

    for flag in ("duration", "interval", "step_sleep", "hang_timeout", "timeout"):
        if hasattr(ns, flag):
            name = "--" + flag.replace("_", "-")
            setattr(ns, flag, parse_duration(getattr(ns, flag), name, positive=flag == "interval"))
    for flag, low in (
        ("nodes", 1),
        ("max_nodes", 1),
        ("nproc", 1),
        ("shards", 1),
        ("steps", 1),
        ("ckpt_every", 1),
        ("durable_every", 0),
    ):
        value = getattr(ns, flag, None)
        if value is not None and not low <= value <= 1_000_000:
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} {value}: must be between {low} and 1000000")


def _schedule(ns: argparse.Namespace) -> list[Any]:
    from flexrun.testing.chaos import KINDS, make_schedule

    _check_numbers(ns)
    kinds = tuple(k for k in ns.kinds.split(",") if k) or KINDS
    return make_schedule(ns.seed, duration_s=ns.duration, interval_s=ns.interval, kinds=kinds)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="inject a seeded stream of faults into a job and check it")
    csub = p.add_subparsers(dest="chaos_command", required=True)

    s = csub.add_parser("schedule", help="print the fault schedule of a seed (JSON lines)")
    _schedule_args(s)
    s.set_defaults(func=_cmd_schedule)

    r = csub.add_parser("run", help="run the chaos workload under the schedule, then check")
    _schedule_args(r)
    r.add_argument("--root", required=True, help="directory for the job (made if missing)")
    r.add_argument("--launcher", choices=["restart", "live", "torchrun"], default="restart")
    r.add_argument("--nodes", type=int, default=2, help="agents at start")
    r.add_argument("--max-nodes", type=int, default=3)
    r.add_argument("--nproc", type=int, default=1, help="workers per agent")
    r.add_argument(
        "--shards",
        type=int,
        default=1,
        help="live: an HSDP job, every N workers of an agent one replica group of FSDP2 "
        "shards (--live-shards N; --nproc a multiple of N)",
    )
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--step-sleep", type=float, default=0.05)
    r.add_argument("--ckpt-every", type=int, default=10)
    r.add_argument(
        "--durable-every",
        type=int,
        default=0,
        help="restart mode: save every step to the checkpoint memory tier and durably every "
        "N steps (Checkpointer(durable_every=N)); 0 (default): durably every --ckpt-every",
    )
    r.add_argument("--hang-timeout", type=float, default=0.0)
    r.add_argument("--timeout", type=float, default=1800.0, help="give up after this long")
    r.set_defaults(func=_cmd_run)


def _cmd_schedule(ns: argparse.Namespace) -> int:
    for f in _schedule(ns):
        print(json.dumps(asdict(f)))
    return 0


def _cmd_run(ns: argparse.Namespace) -> int:
    from flexrun.testing.chaos import JobSpec, run_chaos

    _check_numbers(ns)
    if ns.nodes < 1 or ns.max_nodes < ns.nodes:
        raise ConfigError("--nodes must be >= 1 and <= --max-nodes")
    if ns.durable_every and ns.launcher != "restart":
        raise ConfigError(
            f"--durable-every: the memory tier is flexrun's restart mode's (the agent keeps "
            f"the copies); not with --launcher {ns.launcher}"
        )
    if ns.shards > 1 and (ns.launcher != "live" or ns.nproc % ns.shards):
        raise ConfigError(
            f"--shards {ns.shards}: an HSDP job is a live one (--launcher live) whose --nproc "
            f"({ns.nproc}) is a multiple of --shards"
        )
    root = Path(ns.root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--root {ns.root}: exists and is not a directory")
    spec = JobSpec(
        root=root,
        launcher=ns.launcher,
        nodes=ns.nodes,
        max_nodes=ns.max_nodes,
        nproc=ns.nproc,
        steps=ns.steps,
        step_sleep=ns.step_sleep,
        ckpt_every=ns.ckpt_every,
        seed=ns.seed,
        hang_timeout_s=ns.hang_timeout,
        shards=ns.shards,
        extra_args=["--durable-every", str(ns.durable_every)] if ns.durable_every else [],
    )
    result = run_chaos(spec, _schedule(ns), timeout_s=ns.timeout)
    print(json.dumps(result.to_dict(), indent=1))
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    from flexrun._cmdutil import standalone_main

    return standalone_main(add_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
