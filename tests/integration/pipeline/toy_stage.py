"""A stand-in stage for runner tests: reads inputs, writes an output, logs the call.

    toy_stage.py --tag T [--in PATH ...] [--out PATH] [--sleep S] [--sleep-once S] [--exit N]
                  [--fail-first]

Appends ``tag start end pid`` to ``calls.log`` in the working directory (the run dir).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tag", required=True)
    p.add_argument("--in", dest="inputs", action="append", default=[])
    p.add_argument("--out")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--fail-first", action="store_true", help="fail unless a marker exists")
    p.add_argument("--sleep-once", type=float, default=0.0, help="sleep on the first call only")
    args = p.parse_args()
    start = time.time()
    print(f"toy {args.tag} starting", flush=True)
    time.sleep(args.sleep)
    slept = Path(f".{args.tag}.slept")
    if args.sleep_once and not slept.exists():
        slept.write_text("1")
        time.sleep(args.sleep_once)
    if args.fail_first:
        marker = Path(f".{args.tag}.tried")
        if not marker.exists():
            marker.write_text("1")
            print(f"toy {args.tag} failing on purpose", flush=True)
            return 3
    if args.out:
        text = args.tag + "".join(Path(i).read_text() for i in args.inputs)
        Path(args.out).write_text(text)
    with open("calls.log", "a") as f:
        f.write(f"{args.tag} {start:.3f} {time.time():.3f} {os.getpid()}\n")
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
