"""The stall of a sharded save: flexrun's ShardedCheckpointer (synchronous and
``asynchronous=True``) beside torch's ``dcp.save`` and ``dcp.async_save``, same state.

One process (no process group), a model of ``--mb`` MiB of float32 parameters and its Adam
state (3x that in all), saved ``--trials`` times by each, interleaved. Stall = how long the
call held the training loop; total = until the checkpoint is complete (flexrun: committed,
manifest written, files fsynced and hashed; DCP: its future done, no fsync). Medians.

    python bench/bench_sharded_async.py [--mb 256] [--trials 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from flexrun.train.context import single_process_context
from flexrun.train.sharded import ShardedCheckpointer


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, mb * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    model, opt = build(a.mb)
    work = Path(tempfile.mkdtemp(prefix="flexrun-async-"))
    rows: dict[str, list[tuple[float, float]]] = {}
    try:
        ck = ShardedCheckpointer(work / "flexrun", ctx=single_process_context(), keep_last=1)
        ck.register("model", model)
        ck.register("optim", opt)
        step = 0
        for trial in range(a.trials):
            step += 1
            t0 = time.monotonic()
            ck.save(step)
            t = time.monotonic() - t0
            rows.setdefault("flexrun ShardedCheckpointer.save", []).append((t, t))
            step += 1
            t0 = time.monotonic()
            pending = ck.save(step, asynchronous=True)
            stall = time.monotonic() - t0
            assert pending is not None
            pending.wait()
            rows.setdefault("flexrun ShardedCheckpointer.save(asynchronous=True)", []).append(
                (stall, time.monotonic() - t0)
            )
            # (get_state_dict inside the timing, as a torchtitan-style AppState calls it.)
            t0 = time.monotonic()
            msd, osd = get_state_dict(model, opt)
            dcp.save(
                {"model": msd, "optim": osd}, checkpoint_id=str(work / f"dcp-{trial}"), no_dist=True
            )
            t = time.monotonic() - t0
            rows.setdefault("torch dcp.save", []).append((t, t))
            t0 = time.monotonic()
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            fut = dcp.async_save(state, checkpoint_id=str(work / f"adcp-{trial}"), no_dist=True)
            stall = time.monotonic() - t0
            fut.result()  # type: ignore[union-attr]
            rows.setdefault("torch dcp.async_save", []).append((stall, time.monotonic() - t0))
            shutil.rmtree(work / f"dcp-{trial}", ignore_errors=True)
            shutil.rmtree(work / f"adcp-{trial}", ignore_errors=True)
        print(
            f"state {3 * a.mb} MiB (model {a.mb} MiB + Adam), {a.trials} trials, medians, "
            f"torch {torch.__version__}"
        )
        for name, vals in rows.items():
            stall = statistics.median(v[0] for v in vals)
            total = statistics.median(v[1] for v in vals)
            print(f"  {name:<55} stall {stall:6.2f} s   total {total:6.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
