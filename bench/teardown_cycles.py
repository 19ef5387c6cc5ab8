"""A DDP script's teardown, repeated: does a worker hang after ``destroy_process_group``?

Two gloo ranks on this machine run, in one process each, ``--cycles`` times: a DDP model in
a ``main()`` (a few steps, a barrier, ``destroy_process_group``), which then returns, so
the model goes with its locals right after the teardown. ``--hook`` installs flexrun's
worker hook in both ranks first (as every flexrun worker has it), which holds the default
process group from the teardown to the next init. A cycle that does not return within
``--cycle-timeout`` is a hang (both ranks print their stacks). Reported per run: how many
cycles returned, out of how many.

    python bench/teardown_cycles.py --runs 6 --cycles 100            # torch alone
    python bench/teardown_cycles.py --runs 6 --cycles 100 --hook     # with the hook
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RANK = """
import faulthandler, sys
if sys.argv[4] == "1":
    from flexrun import worker_hook
    assert worker_hook.install({"FLEXRUN_PROGRESS_FILE": sys.argv[2] + "/progress" + sys.argv[1],
                                "FLEXRUN_STACK_FILE": sys.argv[2] + "/stacks" + sys.argv[1]})
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

rank, root, cycles, timeout = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[5])
torch.set_num_threads(1)


def main(i):
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-{i}", 2), rank=rank,
                            world_size=2)
    model = DDP(torch.nn.Linear(16, 1))
    for _ in range(3):
        model(torch.randn(8, 16)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()


for i in range(cycles):
    faulthandler.dump_traceback_later(timeout, exit=True)
    main(i)
    faulthandler.cancel_dump_traceback_later()
    print(i + 1, flush=True)
"""


def one_run(cycles: int, hook: bool, timeout: float) -> int:
    """Cycles both ranks returned from."""
    with tempfile.TemporaryDirectory(prefix="flexrun-teardown-") as root:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(rank), root, str(cycles), "1" if hook else "0",
                 str(timeout)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
            for rank in (0, 1)
        ]  # fmt: skip
        done = []
        for p in procs:
            out, _ = p.communicate(timeout=cycles * (timeout + 30))
            lines = [ln for ln in out.split() if ln.isdigit()]
            done.append(int(lines[-1]) if lines else 0)
        return min(done)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--cycle-timeout", type=float, default=20.0)
    ap.add_argument("--hook", action="store_true", help="install flexrun's worker hook")
    a = ap.parse_args()
    src = str(Path(__file__).resolve().parents[1] / "src")
    os.environ["PYTHONPATH"] = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    got = [one_run(a.cycles, a.hook, a.cycle_timeout) for _ in range(a.runs)]
    hung = sum(1 for g in got if g < a.cycles)
    print(f"{'with' if a.hook else 'without'} the hook: cycles returned per run {got} "
          f"(of {a.cycles}); runs that hung {hung} of {a.runs}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
