"""Live mode's state plumbing: a model checksum that members compare, the gradient sum of
whole-model replicas, the broadcast that hands one member's model and optimizer state to
every other member of an epoch, and the deliberate leak of abandoned process groups.

Owns no membership decisions (``flexrun.train.live_plan`` says who sends) and no group
formation (``flexrun.train.live_group``); ``flexrun.train.live`` calls these.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flexrun.errors import CheckpointError

if TYPE_CHECKING:
    from flexrun.train.live_group import EpochGroup


def state_checksum(model: torch.nn.Module) -> str:
    """sha256 of the model's state in a fixed order (survivors must agree after recovery);
    of a sharded model, of this rank's shards (its replicas in other groups must agree)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = t.to_local() if hasattr(t, "to_local") else t  # (a shard: this rank's part)
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def sum_replicas(
    group: EpochGroup, params: Sequence[torch.Tensor], flags: torch.Tensor
) -> torch.Tensor:
    """Whole-model replicas: sum the gradients of ``params`` and ``flags`` in one all-reduce
    over the epoch's group (an aborting epoch change raises LiveAborted); returns the summed
    flags."""
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    if grads:  # (a model on a GPU: one buffer on its device)
        flags = flags.to(dtype=grads[0].dtype, device=grads[0].device)
    buf = torch.cat([*grads, flags]) if grads else flags
    group.wait(group.pg.allreduce([buf]))
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = buf[offset : offset + n].view_as(p).clone()
        offset += n
    return buf[-2:]


def broadcast_state(
    pg: Any,
    wait: Callable[[Any], None],
    *,
    rank: int,
    source: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    error: str | None = None,
) -> int:
    """Every member of ``pg`` takes ``source``'s model and optimizer state; returns the
    committed step that goes with it. ``wait`` waits for one collective (and raises
    ``LiveAborted`` when the epoch ends under it). ``error`` (on the source): it has no
    state to give.

    Raises:
        CheckpointError: on every member, with the source's ``error`` message.
    """
    payload = torch.empty(0, dtype=torch.uint8)
    if rank == source and error is not None:
        blob = error.encode()[:4096]
        payload = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        size = torch.tensor([-payload.numel()], dtype=torch.int64)
    elif rank == source:
        buf = io.BytesIO()
        torch.save(
            {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, buf
        )
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    wait(pg.broadcast(size, source))
    n = int(size.item())
    if rank != source:
        payload = torch.empty(abs(n), dtype=torch.uint8)
    wait(pg.broadcast(payload, source))
    if n < 0:
        raise CheckpointError(
            f"live recovery impossible (rank {source}): "
            + payload.numpy().tobytes().decode(errors="replace")
        )
    if rank == source:
        return step
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return int(state["step"])


_LEAKED: set[int] = set()


def leak(obj: Any) -> None:
    """Give ``obj`` one reference that is never released, so that interpreter shutdown
    never runs its destructor: a gloo group's destructor joins threads that may be stuck
    in ``recv`` from a peer of an old epoch, which would hang the process at exit."""
    if id(obj) not in _LEAKED:
        _LEAKED.add(id(obj))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


__all__ = ["broadcast_state", "leak", "state_checksum"]
