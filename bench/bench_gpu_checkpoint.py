"""Training stall of a checkpoint on one GPU: flexrun's Checkpointer vs DCP async_save vs a sync save.

One prepared run (issue 20, item 9): it launches itself under ``flexrun run --standalone
--nproc-per-node 1`` (NCCL for the GPU, with a gloo side for DCP's CPU collectives), builds
a ~1B-parameter model with Adam state on ``cuda:0``, trains a few steps, and then measures
side by side, each ``--repeats`` times after one warm-up:

1. ``flexrun.train.Checkpointer.save`` with its default settings (async; host copy of the
   parameters and Adam state deferred to the background and the next ``optimizer.step()``
   held until it is done): the stall is the time inside ``save()`` plus that hold;
2. ``torch.distributed.checkpoint.async_save`` of the same state (``get_state_dict``): the
   stall is the time until it returns (it stages to host memory first);
3. a synchronous ``torch.save`` of the same state dicts + ``fsync``: the stall is all of it.

For each: the stall, the time until the checkpoint is durable, and the median training step
while it persists vs without. Results go to ``--out`` (default ``DEFAULT_OUT``:
``gpu_checkpoint.txt`` in bench/results/, written by a run on a GPU; with the command, the
GPU, the load average before and after) and to stdout.

Usage (on a machine with a CUDA GPU, from the repository root, flexrun importable):

    python bench/bench_gpu_checkpoint.py                 # ~1B params, about 4-6 min on an H200
    python bench/bench_gpu_checkpoint.py --tiny          # CPU dry run: small model, gloo

``--json PATH`` also writes the measurements as JSON (``bench/gpu_check.py`` reads them).

Without a CUDA device and without ``--tiny`` it says so and exits 0. Checkpoints go to
``--dir`` (default: a temporary directory, removed at the end; about 2.5x the state size
at the peak, ~30 GB for the full model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "gpu_checkpoint.txt"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small model on the CPU (gloo): a dry run")
    ap.add_argument("--hidden", type=int, default=None, help="layer width (default 8192; tiny 256)")
    ap.add_argument("--layers", type=int, default=None, help="Linear layers (default 15; tiny 3)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="measured saves per method")
    ap.add_argument("--steps-between", type=int, default=5, help="steps timed while persisting")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="results file ('-': stdout only)")
    ap.add_argument("--timeout", type=float, default=460.0, help="seconds for the whole run")
    ap.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON result path
    return ap.parse_args(argv)


# -- the worker (runs under flexrun run) ----------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import flexrun.train as ft

    cuda = torch.cuda.is_available() and not args.tiny
    if not dist.is_initialized():  # DCP's async_save needs a CPU (gloo) side next to NCCL
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
    ctx = ft.init()
    device = torch.device("cuda:0") if cuda else torch.device("cpu")
    hidden = args.hidden or (256 if args.tiny else 8192)
    layers = args.layers or (3 if args.tiny else 15)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    x = torch.randn(args.batch, hidden, device=device)
    params = sum(p.numel() for p in model.parameters())

    def step() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t0

    for _ in range(3):
        step()  # Adam state exists from here on
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    base = [step() for _ in range(10)]
    root = Path(args.dir or tempfile.mkdtemp(prefix="flexrun-gpu-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, float]]] = {}

    def measure(label: str, save: Any, durable: Any, cleanup: Any) -> None:
        out = []
        for i in range(args.repeats + 1):
            _sync(device)
            t0 = time.perf_counter()
            handle = save(i)
            call_s = time.perf_counter() - t0
            during = [step() for _ in range(args.steps_between)]
            extra_stall = durable(handle, "stall")  # e.g. the optimizer step's hold
            t1 = time.perf_counter()
            durable(handle, "wait")
            persist_s = call_s + sum(during) + (time.perf_counter() - t1)
            if i > 0:  # the first one allocates buffers
                out.append(
                    {
                        "stall_s": call_s + extra_stall,
                        "persist_s": persist_s,
                        "step_while_s": statistics.median(during),
                    }
                )
            cleanup(i)
            base.extend(step() for _ in range(3))
            print(
                f"[{label}] save {i}: stall {(call_s + extra_stall) * 1e3:.1f} ms, durable after {persist_s:.2f} s",
                flush=True,
            )
        rows[label] = out

    ck = ft.Checkpointer(root / "flexrun", ctx=ctx, keep_last=1)
    ck.register("model", model)
    ck.register("optim", opt)

    def ck_save(i: int) -> None:
        ck.save(i + 1)

    def ck_durable(_h: None, what: str) -> float:
        if what == "stall":  # the hold of the first optimizer step, already in step_while
            return ck._p._copy_wait_s  # the first optimizer step's hold for the host copy
        ck.wait()
        return 0.0

    measure("flexrun Checkpointer.save (defaults)", ck_save, ck_durable, lambda i: None)
    ck.close()
    shutil.rmtree(root / "flexrun", ignore_errors=True)

    def dcp_save(i: int) -> Any:
        msd, osd = get_state_dict(model, opt)
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-{i}"))

    def dcp_durable(fut: Any, what: str) -> float:
        if what == "wait":
            fut.result()
        return 0.0

    measure(
        "torch.distributed.checkpoint.async_save",
        dcp_save,
        dcp_durable,
        lambda i: shutil.rmtree(root / f"dcp-{i}", ignore_errors=True),
    )

    def sync_save(i: int) -> None:
        path = root / f"sync-{i}.pt"
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    measure(
        "synchronous torch.save + fsync",
        sync_save,
        lambda _h, _w: 0.0,
        lambda i: (root / f"sync-{i}.pt").unlink(missing_ok=True),
    )
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "backend": str(dist.get_backend()),
        "torch": torch.__version__,
        "params": params,
        "state_bytes": state_bytes,
        "base_step_s": statistics.median(base),
        "rows": rows,
    }
    Path(args.worker).write_text(json.dumps(result))
    ft.shutdown()


# -- the launcher ---------------------------------------------------------------------------


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "(uptime unavailable)"


def report(result: dict[str, Any], command: str, before: str, after: str, wall_s: float) -> str:
    lines = [
        "# GPU checkpoint stall: flexrun Checkpointer vs DCP async_save vs synchronous save",
        f"# Command:  {command}",
        f"# Device:   {result['device']} ({result['backend']}), torch {result['torch']}",
        f"# Model:    {result['params'] / 1e9:.2f}B parameters + Adam state, "
        f"{result['state_bytes'] / 2**30:.1f} GiB on the device",
        f"# Load before: {before}",
        f"# Load after:  {after}",
        f"# Wall time: {wall_s:.0f} s",
        "",
        f"step without a checkpoint (median): {result['base_step_s'] * 1e3:.1f} ms",
        "",
        f"{'method':<42}{'stall (median)':>16}{'durable after':>16}{'step while persisting':>24}",
    ]
    base = result["base_step_s"]
    for label, rows in result["rows"].items():
        if not rows:
            continue
        stall = statistics.median(r["stall_s"] for r in rows)
        persist = statistics.median(r["persist_s"] for r in rows)
        during = statistics.median(r["step_while_s"] for r in rows)
        lines.append(
            f"{label:<42}{stall * 1e3:>13.1f} ms{persist:>14.2f} s"
            f"{during * 1e3:>14.1f} ms ({(during / base - 1) * 100:+.0f}%)"
        )
    lines.append("")
    lines.append("(stall: time the training loop was blocked by the save, including the next")
    lines.append(" optimizer step's wait for flexrun's deferred host copy; medians of the")
    lines.append(" measured saves after one warm-up each)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    if not args.tiny and not torch.cuda.is_available():
        print(
            "bench_gpu_checkpoint: no CUDA device here; nothing to measure (use --tiny for a CPU dry run)"
        )
        return 0
    started = time.monotonic()
    before = _uptime()
    with tempfile.TemporaryDirectory(prefix="flexrun-gpu-bench-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "flexrun", "run", "--standalone", "--nproc-per-node", "1"]
        cmd += [
            "--run-dir",
            str(Path(tmp) / "run"),
            str(HERE),
            *_worker_args(args),
            "--worker",
            str(result_path),
        ]
        env = dict(os.environ)
        env.setdefault("PYTHONPATH", str(REPO / "src"))
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout, cwd=REPO)
        except subprocess.TimeoutExpired:
            print(f"bench_gpu_checkpoint: did not finish in {args.timeout:.0f} s", file=sys.stderr)
            return 1
        if proc.returncode != 0 or not result_path.exists():
            print(
                f"bench_gpu_checkpoint: the worker failed (exit {proc.returncode})", file=sys.stderr
            )
            return 1
        result = json.loads(result_path.read_text())
    command = "python bench/bench_gpu_checkpoint.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(result, command.strip(), before, _uptime(), time.monotonic() - started)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(result, command=command.strip()), indent=2))
    if args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


def _worker_args(args: argparse.Namespace) -> list[str]:
    out = ["--batch", str(args.batch), "--repeats", str(args.repeats)]
    out += ["--steps-between", str(args.steps_between)]
    if args.tiny:
        out.append("--tiny")
    if args.hidden:
        out += ["--hidden", str(args.hidden)]
    if args.layers:
        out += ["--layers", str(args.layers)]
    if args.dir:
        out += ["--dir", args.dir]
    return out


if __name__ == "__main__":
    sys.exit(main())
