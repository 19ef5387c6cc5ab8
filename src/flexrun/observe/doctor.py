"""``flexrun doctor``: a pre-flight check run on every node of a job before the job.

Owns the check's protocol and its verdict: reach the store, meet the other nodes (a roster
fixed by compare-and-set under ``flexrun/<run_id>/doctor/<session>/``), form one process
group (gloo; NCCL when CUDA is present), time a matmul on each local device and a short
all-reduce for every pair of nodes, gather the figures everywhere and flag nodes far
slower than the others (a straggler or a faulty GPU). It does not touch the job's
rendezvous keys and starts no workers.

Exit codes: 0 every node healthy, 1 a node was flagged, 2 bad input or no store (one line
on stderr, like every flexrun command).

The verdict is pure (:func:`flag_stragglers`); the rest performs it. A node is flagged
when its matmul time exceeds ``threshold`` times the median of the *other* nodes (so two
nodes compare with each other), or its all-reduce bandwidth is below that median divided
by ``threshold``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from flexrun.errors import ConfigError, RendezvousTimeout
from flexrun.store.api import Store

log = logging.getLogger("flexrun.doctor")


@dataclass(slots=True)
class NodeResult:
    node_id: str
    rank: int
    host: str
    devices: dict[str, float] = field(default_factory=dict)
    """device -> median seconds of one matmul."""
    pair_gbps: dict[str, float] = field(default_factory=dict)
    """peer node -> all-reduce bus bandwidth with it (GB/s)."""
    all_gbps: float = 0.0
    """All-reduce bus bandwidth of the whole group (GB/s)."""
    flags: list[str] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        return max(self.devices.values()) if self.devices else 0.0

    @property
    def bandwidth_gbps(self) -> float:
        v = list(self.pair_gbps.values())
        return statistics.median(v) if v else self.all_gbps


def flag_stragglers(results: Sequence[NodeResult], threshold: float = 2.0) -> list[NodeResult]:
    """Set each result's ``flags``; return the flagged ones. Pure.

    Each node is compared with the median of the others: its slowest device's matmul time
    above ``threshold`` x that median, or its median pair bandwidth below that median /
    ``threshold``, flags it.
    """
    flagged = []
    for r in results:
        others = [o for o in results if o is not r]
        r.flags = []
        if not others:
            continue
        ref_c = statistics.median(o.compute_s for o in others)
        if ref_c > 0 and r.compute_s > threshold * ref_c:
            r.flags.append(f"matmul {r.compute_s / ref_c:.1f}x slower than the other nodes' median")
        ref_b = statistics.median(o.bandwidth_gbps for o in others)
        if ref_b > 0 and 0 < r.bandwidth_gbps < ref_b / threshold:
            r.flags.append(
                f"all-reduce bandwidth {r.bandwidth_gbps:.2f} GB/s, "
                f"{ref_b / r.bandwidth_gbps:.1f}x below the other nodes' median"
            )
        if r.flags:
            flagged.append(r)
    return flagged


# -- the protocol ---------------------------------------------------------------------------
class _Keys:
    def __init__(self, run_id: str, session: str) -> None:
        root = f"flexrun/{run_id}/doctor/{session}/"
        self.nodes = root + "nodes/"
        self.roster = root + "roster"
        self.master = root + "master"


def meet(
    store: Store,
    keys: _Keys,
    node_id: str,
    nnodes: int,
    *,
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Register and wait until ``nnodes`` nodes are here; return the roster (rank order).

    Raises:
        RendezvousTimeout: fewer nodes arrived within ``timeout_s``.
        ConfigError: this node is not in the roster (more nodes than ``--nnodes``).
    """
    store.put(keys.nodes + node_id, b"1")
    deadline = monotonic() + timeout_s
    while True:
        entry = store.get(keys.roster)
        if entry is not None:
            roster = list(json.loads(entry.value))
            if node_id not in roster:
                raise ConfigError(
                    f"doctor: {len(roster)} nodes already met without {node_id} "
                    f"(--nnodes {nnodes}); use a new --session"
                )
            return roster
        here = sorted(k[len(keys.nodes) :] for k in store.get_prefix(keys.nodes))
        if len(here) >= nnodes:
            store.compare_and_set(
                keys.roster, json.dumps(here[:nnodes]).encode(), expected_revision=0
            )
            continue
        if monotonic() > deadline:
            raise RendezvousTimeout(
                f"doctor: {len(here)} of {nnodes} node(s) arrived within {timeout_s:g}s "
                f"({', '.join(here)}); start `flexrun doctor` on every node"
            )
        sleep(0.1)


def _matmul_s(device: str, size: int, iters: int, inject_delay_s: float) -> float:
    import torch

    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    times = []
    for i in range(iters + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ b).sum().item()
        if inject_delay_s:
            time.sleep(inject_delay_s)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _allreduce_gbps(tensor: Any, group: Any, n: int, iters: int) -> float:
    import torch.distributed as dist

    dist.all_reduce(tensor, group=group)  # warm-up (and connection set-up)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - t0)
    nbytes = tensor.numel() * tensor.element_size()
    return (2 * (n - 1) / n) * nbytes / statistics.median(times) / 1e9


def run_checks(
    roster: list[str],
    node_id: str,
    master: tuple[str, int],
    *,
    size_mb: float,
    matmul_size: int,
    iters: int,
    inject_delay_s: float,
    timeout_s: float,
) -> list[NodeResult]:
    """Form the group, time matmuls and all-reduces, and gather every node's figures."""
    import torch
    import torch.distributed as dist

    rank, n = roster.index(node_id), len(roster)
    cuda = torch.cuda.is_available()
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{master[0]}:{master[1]}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        me = NodeResult(node_id=node_id, rank=rank, host=socket.gethostname())
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
        for d in devices:
            me.devices[d] = _matmul_s(d, matmul_size, iters, inject_delay_s)
        dev = "cuda:0" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(0)
        tensor = torch.ones(max(int(size_mb * 2**20 / 4), 1), device=dev)
        for i in range(n):
            for j in range(i + 1, n):
                group = dist.new_group([i, j])  # every rank creates every group, in order
                if rank in (i, j):
                    peer = roster[j if rank == i else i]
                    me.pair_gbps[peer] = _allreduce_gbps(tensor, group, 2, iters)
                dist.barrier()
        if n > 1:
            me.all_gbps = _allreduce_gbps(tensor, None, n, iters)
        gathered: list[Any] = [None] * n
        dist.all_gather_object(gathered, asdict(me))
    finally:
        dist.destroy_process_group()
    return [NodeResult(**{k: v for k, v in g.items() if k != "flags"}) for g in gathered]


@contextlib.contextmanager
def _native_stdout_to_stderr() -> Iterator[None]:
    """Send what native code writes to stdout meanwhile to stderr: stdout carries only the
    report (torch 2.10's gloo prints "[Gloo] Rank 0 is connected to ..." lines on stdout,
    which made ``--json`` output unparseable)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        libc.fflush(None)  # (C stdio's buffer, which std::cout shares, before fd 1 is back)
        os.dup2(saved, 1)
        os.close(saved)


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr if addr not in ("localhost",) else "127.0.0.1", 0))
        return int(s.getsockname()[1])


def render(results: Sequence[NodeResult], threshold: float) -> str:
    lines = [
        f"{'node':<16} {'rank':>4} {'host':<20} {'matmul':>10} {'all-reduce':>12}  verdict",
    ]
    for r in sorted(results, key=lambda r: r.rank):
        verdict = "SLOW: " + "; ".join(r.flags) if r.flags else "ok"
        lines.append(
            f"{r.node_id:<16} {r.rank:>4} {r.host[:20]:<20} {r.compute_s * 1e3:>8.2f}ms "
            f"{r.bandwidth_gbps:>8.3f}GB/s  {verdict}"
        )
    lines.append(f"(flagged: more than {threshold:g}x slower than the other nodes' median)")
    return "\n".join(lines)


# -- command --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, rdzv_options: Callable[[Any], None]) -> None:
    rdzv_options(p)
    p.add_argument("--nnodes", default="1", help="nodes to wait for: N or MIN:MAX (waits for MAX)")
    p.add_argument("--node-id", "--node_id", dest="node_id", default=None, help="this node's id")
    p.add_argument(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=None,
        help="address other nodes reach this one at (default: loopback for a local store, else FQDN)",
    )
    p.add_argument(
        "--session", default="doctor", help="name of this check (use a new one to re-run)"
    )
    p.add_argument("--join-timeout", type=float, default=120.0, metavar="S")
    p.add_argument("--size-mb", type=float, default=8.0, help="all-reduce size (default 8 MB)")
    p.add_argument("--matmul-size", type=int, default=512, help="matrix side (default 512)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions (median)")
    p.add_argument("--threshold", type=float, default=2.0, help="slowness factor that flags a node")
    p.add_argument(
        "--inject-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="testing aid: add S seconds to each timed matmul on this node",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    """Run the pre-flight check on this node; 0 healthy, 1 a node flagged.

    Raises:
        ConfigError: bad options, or an unreachable store (StoreUnavailable).
        RendezvousTimeout: the other nodes did not arrive.
    """
    from flexrun.config import default_node_id, parse_nnodes
    from flexrun.observe.status import open_status_store, store_settings_from_args

    if not args.rdzv_id:
        raise ConfigError("--rdzv-id is required: the job id (the check uses its store)")
    from flexrun.config.parsing import check_name, parse_duration

    check_name(str(args.session), "--session")
    if args.node_id is not None:
        check_name(str(args.node_id), "--node-id")
    if not 1 < args.threshold < float("inf"):  # (NaN too)
        raise ConfigError("--threshold must be a finite number above 1")
    args.join_timeout = parse_duration(args.join_timeout, "--join-timeout", positive=True)
    args.inject_delay = parse_duration(args.inject_delay, "--inject-delay")
    if not 0 < args.size_mb <= 1 << 20:
        raise ConfigError(f"--size-mb {args.size_mb}: must be above 0 and at most 1048576")
    if not 1 <= args.matmul_size <= 1 << 16 or not 1 <= args.iters <= 10_000:
        raise ConfigError("--matmul-size must be 1-65536 and --iters 1-10000")
    _, nnodes = parse_nnodes(args.nnodes)
    settings = store_settings_from_args(
        args.rdzv_backend, args.rdzv_endpoint or "", args.rdzv_conf or ""
    )
    node_id = args.node_id or default_node_id()
    host = settings.endpoints[0][0]
    addr = args.local_addr or (
        "127.0.0.1"
        if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")
        else socket.getfqdn()
    )
    store = open_status_store(settings)
    keys = _Keys(args.rdzv_id, args.session)
    try:
        roster = meet(store, keys, node_id, nnodes, timeout_s=args.join_timeout)
        if roster[0] == node_id:
            store.compare_and_set(
                keys.master,
                json.dumps([addr, _free_port(addr)]).encode(),
                expected_revision=0,
            )
        deadline = time.monotonic() + args.join_timeout
        while (entry := store.get(keys.master)) is None:
            if time.monotonic() > deadline:
                raise RendezvousTimeout(f"doctor: {roster[0]} never published its address")
            time.sleep(0.05)
        m_addr, m_port = json.loads(entry.value)
        with _native_stdout_to_stderr():
            results = run_checks(
                roster,
                node_id,
                (str(m_addr), int(m_port)),
                size_mb=args.size_mb,
                matmul_size=args.matmul_size,
                iters=args.iters,
                inject_delay_s=args.inject_delay,
                timeout_s=args.join_timeout,
            )
        if roster[0] == node_id:  # everyone has met and finished: the session is reusable
            store.delete(keys.roster)
            store.delete(keys.master)
    finally:
        store.delete(keys.nodes + node_id)
        store.close()
    flagged = flag_stragglers(results, args.threshold)
    if args.json:
        print(
            json.dumps(
                {
                    "nodes": [
                        dict(asdict(r), compute_s=r.compute_s, bandwidth_gbps=r.bandwidth_gbps)
                        for r in results
                    ],
                    "flagged": [r.node_id for r in flagged],
                    "threshold": args.threshold,
                },
                indent=2,
                sort_keys=True,
            )
        )
    else:
        print(render(results, args.threshold))
    return 1 if flagged else 0
