"""Checkpointable state: host snapshots of state dicts and per-rank RNG states.

Owns (1) copying a nested state dict to host memory fast enough that the training loop
may continue while a copy is persisted (buffers are reused across saves, pinned when the
source is on a GPU) and (2) capturing and restoring the RNG states of torch, CUDA, numpy
and Python as plain tensors and ints, so a checkpoint loads with ``weights_only=True``.
It does not decide where or when state is written (``flexrun.train.checkpoint`` does).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG is then simply not captured
    np = None  # type: ignore[assignment]


class HostSnapshot:
    """Copies nested state (dicts, lists, tuples, tensors, scalars) into reusable host buffers.

    ``take()`` returns a structure of the same shape whose tensors are CPU buffers, plus
    the copies it deferred: tensors for which ``defer(tensor)`` is true get their buffer
    now but are copied only when the caller runs :func:`run_copies` (on a background
    thread, while something else guarantees the source does not change). Buffers are
    reused across calls when shapes and dtypes match, so a steady-state save costs one
    memcpy per tensor and no allocation. The caller must not ``take()`` again while a
    previous result is still being copied or persisted.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(
        self, state: Any, defer: Callable[[torch.Tensor], bool] | None = None
    ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        seen: set[str] = set()
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        out = self._copy(state, "", seen, defer, pending)
        for stale in set(self._buffers) - seen:
            del self._buffers[stale]
        return out, pending

    def _copy(
        self,
        obj: Any,
        path: str,
        seen: set[str],
        defer: Callable[[torch.Tensor], bool] | None,
        pending: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> Any:
        if isinstance(obj, torch.Tensor):
            seen.add(path)
            return self._copy_tensor(obj, path, defer, pending)
        if isinstance(obj, Mapping):
            return {k: self._copy(v, f"{path}/{k}", seen, defer, pending) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v, f"{path}/{i}", seen, defer, pending) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(
                self._copy(v, f"{path}/{i}", seen, defer, pending) for i, v in enumerate(obj)
            )
        return obj

    def _copy_tensor(
        self,
        t: torch.Tensor,
        path: str,
        defer: Callable[[torch.Tensor], bool] | None,
        pending: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        src = t.detach()
        if not _plain(src):  # sparse, quantized, DTensor...: plain clone now, no reuse
            return src.to("cpu", copy=True)
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
            self._buffers[path] = buf
        if defer is not None and defer(src):
            pending.append((buf, src))
        else:
            buf.copy_(src, non_blocking=src.is_cuda)
        return buf


def run_copies(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Perform the copies :meth:`HostSnapshot.take` deferred."""
    for buf, src in pending:
        buf.copy_(src, non_blocking=src.is_cuda)
    synchronize_device()


def _plain(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and type(t) is torch.Tensor and not t.is_quantized


def synchronize_device() -> None:
    """Wait for pending non-blocking device-to-host copies."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), numpy and Python, as weights-only-loadable data."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    version, internal, gauss_next = random.getstate()
    state["python"] = {
        "version": int(version),
        "internal": torch.tensor(internal, dtype=torch.int64),
        "gauss_next": gauss_next,
    }
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (missing parts are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    if "numpy" in state and np is not None:
        n = state["numpy"]
        np.random.set_state(
            (
                n["kind"],
                n["keys"].numpy().astype(np.uint32),
                n["pos"],
                n["has_gauss"],
                n["cached_gaussian"],
            )
        )
    if "python" in state:
        p = state["python"]
        internal = tuple(int(x) for x in p["internal"].tolist())
        random.setstate((p["version"], internal, p["gauss_next"]))
