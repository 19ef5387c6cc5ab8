"""Checkpoint stall and background slowdown, async (flexrun.train) vs synchronous torch.save.

For a ~50M-parameter model with Adam state, in one process and one run:

1. baseline training step time (median);
2. synchronous save: ``torch.save`` of model+optimizer state, ``fsync``; the loop is
   blocked for all of it;
3. async save with :class:`flexrun.train.Checkpointer`: the stall (time inside ``save()``,
   the host copy) and the step time of training steps that run while the checkpoint
   persists in the background.

Usage: python bench/bench_checkpoint.py [--dir DIR] [--repeats 2] [--share 0.2 ...]
       [--normal-priority] [--copy-in-save] [--stores local,s3] [--s3-endpoint URL]
       python bench/bench_checkpoint.py --memory-tier [--blocks 3] [--block-steps 20]
       [--no-copy-wait]

``--memory-tier`` measures the memory tier instead (issue 34): the same loop with no
checkpoint at all and with ``save()`` every step (``Checkpointer(durable_every=20)``,
copies under ``/dev/shm``), in alternating blocks of ``--block-steps`` steps in one run;
it reports the median step of each, their ratio, the stall per save and the memory the
copies take, next to a synchronous ``torch.save``.

The headline rows are Checkpointer's DEFAULT settings and the unpaced variant
(``persist_cpu_share=None``); the flags add variants for contrast. ``--stores local,s3``
runs every variant on the local filesystem and on an S3 API server side by side in one
run (moto's server mode started here in its own process on 127.0.0.1, or
``--s3-endpoint`` for a real one such as MinIO; credentials from the usual ``AWS_*``
variables), and ends with a table of stall and persist time per store.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import torch

from flexrun.train import Checkpointer
from flexrun.train.context import single_process_context


def build(width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def sync_save(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


class S3Server:
    """moto's S3 server in a child process (so it does not share this process's GIL)."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise SystemExit("moto server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def s3_target(endpoint: str) -> tuple[str, dict[str, Any]]:
    """A fresh bucket on ``endpoint``: (URL prefix, storage_options)."""
    import boto3

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    bucket = f"bench-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    options = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
    return f"s3://{bucket}", options


def memory_tier(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    root: str,
    *,
    blocks: int,
    block_steps: int,
    durable_every: int,
    copy_wait: bool,
) -> None:
    """No checkpoint vs a save every step with the memory tier, alternating blocks."""
    shm = tempfile.mkdtemp(prefix="flexrun-bench-mem-", dir="/dev/shm")
    try:
        ck = Checkpointer(
            os.path.join(root, "memtier"),
            ctx=single_process_context(),
            keep_last=1,
            durable_every=durable_every,
            memory_dir=shm,
            memory_copy_wait=copy_wait,
        )
        ck.register("model", model)
        ck.register("optim", opt)
        plain: list[float] = []
        saving: list[float] = []
        stalls: list[float] = []
        n = 0
        for b in range(blocks):
            plain += [step(model, opt, x) for _ in range(block_steps)]
            block = []
            for _ in range(block_steps):
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                opt.step()  # (waits for the previous save's deferred copy, if any)
                opt.zero_grad(set_to_none=True)
                n += 1
                ck.save(n)
                block.append(time.perf_counter() - t0)
                stalls.append(ck.last_stall_s)
            saving += block[1:] if b == 0 else block  # (the very first save allocates)
            print(
                f"block {b + 1}: no checkpoint median {statistics.median(plain[-block_steps:]) * 1e3:.1f} ms"
                f", save every step median {statistics.median(block) * 1e3:.1f} ms"
            )
        ck.close()
        copies = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(shm) for f in files
        )
        durable = ck.steps()
        skipped = ck.memory_copies_skipped
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    p, m = statistics.median(plain), statistics.median(saving)
    print()
    print(f"step, no checkpoint (median, n={len(plain)})       : {p * 1e3:.1f} ms")
    print(f"step, save() every step (median, n={len(saving)})  : {m * 1e3:.1f} ms")
    print(f"ratio (memory tier / no checkpoint)          : {m / p:.3f}   (target <= 1.03)")
    print(
        f"same, means                                  : {statistics.fmean(saving) / statistics.fmean(plain):.3f}"
    )
    print(
        f"stall per save (save() + optimizer.step()'s wait, median): {statistics.median(stalls) * 1e3:.1f} ms"
    )
    print(f"memory copies on this node at the end        : {copies / 2**20:.0f} MiB (2 kept)")
    print(f"durable checkpoints written (durable_every={durable_every}): steps {durable}")
    print(f"memory_copy_wait={copy_wait}: copies skipped (previous still writing): {skipped}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--share", type=float, action="append", default=[], help="extra persist_cpu_share variant"
    )
    ap.add_argument("--normal-priority", action="store_true", help="add a non-SCHED_IDLE variant")
    ap.add_argument("--copy-in-save", action="store_true", help="add a defer_copy=False variant")
    ap.add_argument("--stores", default="local", help="comma-separated: local, s3")
    ap.add_argument("--s3-endpoint", default=None, help="S3 API endpoint (default: start moto)")
    ap.add_argument("--memory-tier", action="store_true", help="measure the memory tier only")
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--block-steps", type=int, default=20)
    ap.add_argument("--durable-every", type=int, default=20)
    ap.add_argument("--no-copy-wait", action="store_true", help="memory_copy_wait=False")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for training (default: torch's, one per core); fewer "
        "than the cores leaves CPU to the checkpoint's copies, as a GPU job's host does",
    )
    args = ap.parse_args()
    if args.threads < 0:
        ap.error(f"--threads {args.threads}: must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    stores = [x.strip() for x in args.stores.split(",") if x.strip()]
    server = S3Server() if "s3" in stores and args.s3_endpoint is None else None
    endpoint = args.s3_endpoint or (server.endpoint if server else None)
    root = args.dir or tempfile.mkdtemp(prefix="flexrun-bench-")
    os.makedirs(root, exist_ok=True)
    model, opt = build(args.width, args.depth)
    x = torch.randn(args.batch, args.width)
    params = sum(p.numel() for p in model.parameters())
    for _ in range(3):
        step(model, opt, x)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3
    print(f"model: {params / 1e6:.1f}M parameters, Adam; state ~{state_bytes / 2**20:.0f} MiB")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}")

    base = [step(model, opt, x) for _ in range(3 if args.memory_tier else 10)]
    base_s = statistics.median(base)
    print(f"baseline step: median {base_s * 1e3:.1f} ms over {len(base)} steps")

    syncs = [sync_save(model, opt, os.path.join(root, "sync.pt")) for _ in range(args.repeats)]
    sync_s = statistics.median(syncs)
    print(f"sync torch.save+fsync: median {sync_s:.3f} s  ({', '.join(f'{s:.3f}' for s in syncs)})")
    if args.memory_tier:
        memory_tier(
            model,
            opt,
            x,
            root,
            blocks=args.blocks,
            block_steps=args.block_steps,
            durable_every=args.durable_every,
            copy_wait=not args.no_copy_wait,
        )
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        return

    results: dict[str, tuple[float, list[float], float]] = {}
    variants: list[tuple[str, dict[str, object]]] = [
        ("DEFAULT settings", {}),
        ("unpaced (persist_cpu_share=None)", {"persist_cpu_share": None}),
    ]
    for share in args.share:
        variants.append((f"persist_cpu_share={share:g}", {"persist_cpu_share": share}))
    if args.normal_priority:
        variants.append(("DEFAULT, but persist_when_idle=False", {"persist_when_idle": False}))
    if args.copy_in_save:
        variants.append(("DEFAULT, but defer_copy=False", {"defer_copy": False}))
    runs: list[tuple[str, str, str, dict[str, Any] | None, dict[str, object]]] = []
    for store in stores:
        for n, (label, options) in enumerate(variants):
            if store == "local":
                runs.append((f"{label}", store, os.path.join(root, f"async-{n}"), None, options))
            else:
                assert endpoint is not None
                url, sopts = s3_target(endpoint)
                runs.append((f"{label} [s3]", store, f"{url}/async-{n}", sopts, options))
    for label, _store, where, storage_options, options in runs:
        ck = Checkpointer(
            where,
            ctx=single_process_context(),
            keep_last=1,
            storage_options=storage_options,
            **options,  # type: ignore[arg-type]
        )
        ck.register("model", model)
        ck.register("optim", opt)
        stalls, bg_steps, persists = [], [], []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            ck.save(i + 1)
            call = time.perf_counter() - t0
            t1 = time.perf_counter()
            during = []
            while ck.persisting:
                during.append(step(model, opt, x))
            ck.wait()
            persist = time.perf_counter() - t1
            # What training lost: time inside save() plus the first optimizer.step()'s
            # wait for the deferred copy; that wait is taken out of the step time so it
            # is not counted twice (the step keeps its slowdown from the concurrent copy).
            stall = ck.last_stall_s
            if during:
                during[0] -= stall - call if stall > call else 0.0
            tag = "first (allocates host buffers)" if i == 0 else "steady"
            med = statistics.median(during) * 1e3 if during else 0.0
            print(
                f"[{label}] save {i + 1} {tag}: stall {stall * 1e3:.1f} ms (in save() "
                f"{call * 1e3:.1f} ms), persisted in {persist:.2f} s while {len(during)} "
                f"steps ran (median {med:.1f} ms)"
            )
            if i > 0:
                stalls.append(stall)
                persists.append(persist)
                bg_steps += during
            base += [step(model, opt, x) for _ in range(3)]
        ck.close()
        results[label] = (statistics.median(stalls), bg_steps, statistics.median(persists))

    base_s = statistics.median(base)
    print()
    print(f"sync torch.save+fsync (median)     : {sync_s * 1e3:.1f} ms")
    print(f"step, no persist (median, n={len(base)}) : {base_s * 1e3:.1f} ms")
    for label, (stall_s, bg_steps, persist_s) in results.items():
        bg_s = statistics.median(bg_steps) if bg_steps else float("nan")
        bg_mean = statistics.fmean(bg_steps) if bg_steps else float("nan")
        base_mean = statistics.fmean(base)
        print(f"-- async, {label}")
        print(f"   stall (steady, median)          : {stall_s * 1e3:.1f} ms")
        print(
            f"   stall / sync save               : {stall_s / sync_s * 100:.1f} %   (target <= 5 %)"
        )
        print(f"   step while persisting (n={len(bg_steps)})   : {bg_s * 1e3:.1f} ms")
        print(
            f"   background slowdown per step    : {(bg_s / base_s - 1) * 100:+.1f} %   (target <= 10 %)"
        )
        print(f"   same, means instead of medians  : {(bg_mean / base_mean - 1) * 100:+.1f} %")
        print(f"   persist duration (steady, median): {persist_s:.2f} s")
    if len(stores) > 1:
        print()
        print("side by side (steady saves, medians)       " + "".join(f"{st:>22}" for st in stores))
        for label, _opts in variants:
            row = []
            for st in stores:
                key = label if st == "local" else f"{label} [s3]"
                stall_s, bg_steps, persist_s = results[key]
                bg = statistics.median(bg_steps) if bg_steps else float("nan")
                row.append(
                    f"stall {stall_s * 1e3:6.1f} ms, persist {persist_s:6.2f} s, "
                    f"step {(bg / base_s - 1) * 100:+5.1f} %"
                )
            print(f"{label:<42}" + " | ".join(row))
    if server is not None:
        server.close()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
