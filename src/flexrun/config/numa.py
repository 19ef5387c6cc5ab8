"""``--numa-binding``: which CPUs each local worker is bound to, decided as torch decides.

Owns the choice (one CPU set per local rank, from torch's own ``torch.numa.binding``: the
CPUs near GPU ``cuda:<local_rank>`` under the chosen affinity mode) and the one clear
error where the machine cannot tell (no CUDA device, no NUMA information, an old torch).
It binds nothing: the agent applies each set to its worker (``os.sched_setaffinity`` in
the child before ``exec``, so no ``numactl`` binary is needed, unlike torchrun).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from flexrun.errors import ConfigError

MODES = ("node", "socket", "exclusive", "core-complex")
"""torch 2.13's ``AffinityMode`` values (the test compares them with torch's own)."""
_NODE_DIR = Path("/sys/devices/system/node")


def cpus_per_local_rank(mode: str, nproc: int) -> tuple[frozenset[int], ...]:
    """The CPU set of each local rank ``0..nproc-1`` for ``--numa-binding mode``.

    Raises:
        ConfigError: unknown mode; torch without ``torch.numa.binding``; no CUDA device
            (the binding is relative to each worker's GPU); fewer GPUs than workers; no
            NUMA information on this host; torch's own computation failed.
    """
    if mode not in MODES:
        raise ConfigError(f"--numa-binding {mode!r}: choose one of {', '.join(MODES)}")
    try:
        import torch
        from torch.numa import binding
    except ImportError as exc:
        raise ConfigError(
            f"--numa-binding {mode}: this torch has no torch.numa.binding (torch 2.8 or newer "
            "binds workers to NUMA nodes); drop --numa-binding"
        ) from exc
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise ConfigError(
            f"--numa-binding {mode}: binds each worker to the CPUs near its GPU (local rank N "
            "uses cuda:N), and no CUDA device is visible on this node; drop --numa-binding"
        )
    count = torch.cuda.device_count()
    if nproc > count:
        raise ConfigError(
            f"--numa-binding {mode}: {nproc} workers but {count} visible GPUs (worker N is bound "
            "near cuda:N); use --nproc-per-node <= the GPU count or drop --numa-binding"
        )
    if not (_NODE_DIR / "possible").is_file():
        raise ConfigError(
            f"--numa-binding {mode}: this machine exposes no NUMA information "
            f"({_NODE_DIR}/possible is missing); drop --numa-binding"
        )
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
    choose: Any = binding._get_logical_cpus_to_bind_to
    # torch 2.13 names the device ``gpu_index``; 2.15 ``device_index``.
    key = "device_index" if "device_index" in inspect.signature(choose).parameters else "gpu_index"
    out = []
    for local_rank in range(nproc):
        try:
            cpus = choose(**{key: local_rank, "numa_options": options})
        except (OSError, RuntimeError, ValueError, AssertionError, AttributeError) as exc:
            raise ConfigError(
                f"--numa-binding {mode}: cannot find the CPUs near cuda:{local_rank} "
                f"({type(exc).__name__}: {exc}); drop --numa-binding"
            ) from exc
        if not cpus:
            raise ConfigError(f"--numa-binding {mode}: no CPU is near cuda:{local_rank}")
        out.append(frozenset(int(c) for c in cpus))
    return tuple(out)


def ranges(cpus: frozenset[int]) -> str:
    """``{0,1,2,5}`` -> ``"0-2,5"`` (numactl's notation, which the docs use)."""
    items = sorted(cpus)
    parts: list[str] = []
    start = prev = None
    for c in items:
        if start is None:
            start = prev = c
        elif prev is not None and c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = c
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)
