"""Live mode for sharded models: replica groups of S shards, FSDP2 within a group.

Owns what changes when a live job's model is sharded (``flexrun run --mode live
--live-shards S``): the group-local process group and device mesh a script builds its
FSDP2 model on (:func:`shard_mesh`), the epoch's layout (which members form which group;
the replicate group of each shard index, shard ``i`` of every group), the recovery plan
over groups, the cross-group gradient sum, and the transfer of shard ``i``'s model and
optimizer state from a healthy group's shard ``i`` to a new group's (no storage read).

Why this shape: FSDP2's own collectives (all-gather in forward, reduce-scatter in
backward) run inside a group, on the process's default group, which lives as long as the
group does; they cannot be abandoned (gloo's abort does not unblock a peer stuck behind a
dead or frozen one), so a group is the unit of failure and the agents replace a failed
group whole (``flexrun.agent.live_groups``). Everything across groups is collectives the
step loop controls and abandons on an epoch change, as for whole-model replicas: the
gradient sum over the shard's replicate group, then a vote over the whole epoch (the
membership and preemption flags) before the optimizer steps, so that a failure inside the
sum leaves every group at the same committed step.

It does not run the loop (``flexrun.train.live``), form epochs (``live_group``) or decide
membership (the agents).
"""

from __future__ import annotations

import io
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flexrun.errors import CheckpointError, ConfigError, LiveAborted
from flexrun.live_protocol import LiveEnv, LiveKeys, MemberReport
from flexrun.train.live_group import EpochGroup
from flexrun.train.live_plan import RecoveryPlan, plan_recovery
from flexrun.train.live_portions import Portions, micro_chunks
from flexrun.train.live_settle import GroupJoins
from flexrun.train.live_sync import state_checksum

log = logging.getLogger(__name__)

_GROUP_STORE: list[Any] = []  # (the group's store client lives as long as its process group)


def shard_mesh(
    device_type: str = "cpu",
    *,
    backend: str | None = None,
    timeout_s: float = 120.0,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """This worker's replica group as a 1-D device mesh (dimension ``"shard"``): build the
    model with ``fully_shard(module, mesh=shard_mesh())`` before the ``LiveLoop``. Forms
    the group-local default process group (``backend``: gloo on CPU, nccl on CUDA) with
    the other shards of the group; the same mesh on a second call.

    Raises:
        ConfigError: not a sharded live worker (``flexrun run --mode live --live-shards
            S`` with S > 1), or a default process group of another size exists.
    """
    env = LiveEnv.from_environ(os.environ if environ is None else environ)
    if env.shards < 2:
        raise ConfigError(
            "shard_mesh() needs replica groups of 2 or more shards: flexrun run --mode live "
            "--live-shards S (S workers per group, S dividing --nproc-per-node)"
        )
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        if dist.get_world_size() != env.shards:
            raise ConfigError(
                f"a default process group of {dist.get_world_size()} ranks exists; a sharded "
                f"live worker's is its replica group of {env.shards} (do not call "
                "init_process_group yourself)"
            )
    else:
        raw = dist.TCPStore(
            env.store_host, env.store_port, None, False, timedelta(seconds=timeout_s)
        )
        _GROUP_STORE.append(raw)
        dist.init_process_group(
            backend or ("nccl" if device_type == "cuda" else "gloo"),
            store=dist.PrefixStore(LiveKeys(env.run_id).group_namespace(env.group), raw),
            rank=env.shard,
            world_size=env.shards,
            timeout=timedelta(seconds=timeout_s),
        )
    return init_device_mesh(device_type, (env.shards,), mesh_dim_names=("shard",))


def local(t: Any) -> torch.Tensor:
    """The local part of a DTensor (a view: writing it writes the DTensor), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(frozen=True, slots=True)
class Layout:
    """An epoch's replica groups: ``groups[g][i]`` is the epoch rank of group ``g``'s shard
    ``i``, groups in the order their first member appears."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, reports: Sequence[MemberReport], shards: int) -> Layout:
        """Raises LiveAborted: some group is incomplete or names a shard twice (the agents
        publish whole groups only: a newer epoch is on its way)."""
        found: dict[str, dict[int, int]] = {}
        for rank, m in enumerate(reports):
            if m.group is None or not 0 <= m.shard < shards:
                raise LiveAborted(f"rank {rank} reports no shard of {shards}")
            if m.shard in found.setdefault(m.group, {}):
                raise LiveAborted(f"group {m.group} has shard {m.shard} twice")
            found[m.group][m.shard] = rank
        if any(len(ranks) != shards for ranks in found.values()):
            raise LiveAborted("an epoch with an incomplete replica group")
        return cls(tuple(tuple(r[i] for i in range(shards)) for r in found.values()))

    def replicas(self, shard: int) -> list[int]:
        """Epoch ranks of shard ``shard`` in every group, in group order."""
        return [g[shard] for g in self.groups]


def plan_groups(
    reports: Sequence[MemberReport], layout: Layout, shard: int, *, formed: bool
) -> RecoveryPlan:
    """This shard's plan (``source``: a position in its replicate group). Each shard index
    is planned over its replicas; every member computes every shard's plan and all of
    them fall back together when one would, or when the shards' newest steps differ (a
    failure tore a commit: no group holds one consistent state)."""
    shards = len(layout.groups[0])
    plans = [plan_recovery([reports[r] for r in layout.replicas(i)], formed=formed)
             for i in range(shards)]  # fmt: skip
    bests = {
        max((reports[r].step for r in layout.replicas(i) if reports[r].has_state), default=-1)
        for i in range(shards)
    }
    reason = next((p.fallback for p in plans if p.fallback is not None), None)
    if reason is None and len(bests) > 1 and -1 not in bests:
        reason = f"the shards' newest committed steps differ: {sorted(bests)}"
    if reason is None and -1 in bests and len(bests) > 1:
        reason = "some shard has no holder left in any group"
    if reason is None:
        return plans[shard]
    return RecoveryPlan(
        source=0, transfer=len(layout.groups) > 1, load_durable=True, fallback=reason
    )


class Shards:
    """A sharded live worker's side of the groups (one per LiveLoop)."""

    def __init__(
        self,
        env: LiveEnv,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        group: EpochGroup,
    ) -> None:
        if not dist.is_initialized() or dist.get_world_size() != env.shards:
            raise ConfigError(
                f"a sharded live job (--live-shards {env.shards}) builds its model on "
                "flexrun.train.shard_mesh() before the LiveLoop"
            )
        from torch.distributed.fsdp import FSDPModule

        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ConfigError(
                "a sharded live job's model is sharded with fully_shard(module, "
                "mesh=shard_mesh()) before the LiveLoop; this one has no FSDP module"
            )
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # (sums, not means: the loop scales each micro-batch by its share of the
                # global batch, so the gradient is the same whatever the group count)
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
        self.env = env
        self.model = model
        self.optimizer = optimizer
        self.params = list(model.parameters())
        self.pg: Any = None
        """The replicate group of this shard in the current epoch."""
        self.position = 0
        self.joins = GroupJoins(group, env)
        self.portions = Portions(env.shards, env.shard)
        """This worker's part of each step's batch (``flexrun.train.live_portions``)."""

    def report(self, committed: int, has_state: bool) -> MemberReport:
        return MemberReport(
            committed,
            has_state,
            state_checksum(self.model) if has_state else None,
            self.env.group,
            self.env.shard,
            portions=self.portions.count,
            held=self.portions.held,
        )

    def plan(self, reports: Sequence[MemberReport], *, formed: bool) -> tuple[Layout, RecoveryPlan]:
        layout = Layout.of(reports, self.env.shards)
        return layout, plan_groups(reports, layout, self.env.shard, formed=formed)

    def reduce(self, wait: Callable[[Any], None], flags: torch.Tensor, vote_pg: Any) -> None:
        """Sum this shard's gradients over its replicate group, then agree on ``flags``
        over the whole epoch (``vote_pg``); the caller steps the optimizer after both.

        Raises:
            LiveAborted: either collective failed or the epoch ended under it.
        """
        grads = [
            self.portions.summed(
                i, (local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
            )
            for i, p in enumerate(self.params)
        ]
        buf = torch.cat(grads) if grads else torch.zeros(0)
        if len(grads) and self.pg.size() > 1:
            wait(self.pg.allreduce([buf]))
        wait(vote_pg.allreduce([flags]))
        offset = 0
        for p in self.params:
            n = local(p).numel()
            if p.grad is None:
                p.grad = _like(p, buf[offset : offset + n].view_as(local(p)).clone())
            else:
                local(p.grad).copy_(buf[offset : offset + n].view_as(local(p.grad)))
            offset += n

    def transfer(
        self,
        wait: Callable[[Any], None],
        *,
        source: int,
        step: int,
        error: str | None = None,
        on_send: Callable[..., object] | None = None,
        vote_pg: Any = None,
    ) -> int:
        """Every replica of this shard takes ``source``'s (a position in the replicate
        group): the model's and the optimizer's local shards, as raw bytes in one buffer
        beside a small description of them; returns the committed step that goes with
        them. The source calls ``on_send(bytes=<size>)`` once its state is packed, before
        the first byte goes out. With ``vote_pg`` (the whole epoch's group), it returns
        only once every member of the epoch has its shard: each shard's transfer is a
        collective of its own, and one can complete while another's source dies; nobody
        may then hold state, or run an FSDP collective with a group-mate still waiting
        for its shard.

        Raises:
            CheckpointError: on every replica, with the source's ``error`` message, or on
                a replica whose model does not match the description.
            LiveAborted: a transfer or the vote failed, or the epoch ended under them.
        """
        head = torch.zeros(2, dtype=torch.int64)  # (description bytes, <0: an error; data)
        meta = data = torch.empty(0, dtype=torch.uint8)
        if self.position == source:
            if error is not None:
                meta = torch.frombuffer(bytearray(error.encode()[:4096]), dtype=torch.uint8)
                head[0] = -meta.numel()
            else:
                meta, data = self._pack(step)
                head[0], head[1] = meta.numel(), data.numel()
                if on_send is not None:
                    on_send(bytes=meta.numel() + data.numel())
        wait(self.pg.broadcast(head, source))
        if self.position != source:
            meta = torch.empty(abs(int(head[0])), dtype=torch.uint8)
            data = torch.empty(int(head[1]), dtype=torch.uint8)
        wait(self.pg.broadcast(meta, source))
        if int(head[0]) < 0:
            raise CheckpointError(
                f"live recovery impossible (shard {self.env.shard}, replica {source}): "
                + meta.numpy().tobytes().decode(errors="replace")
            )
        if data.numel():
            wait(self.pg.broadcast(data, source))
        if self.position != source:
            step = self._unpack(meta, data)
        if vote_pg is not None:
            wait(vote_pg.allreduce([torch.zeros(1)]))
        return step

    def _pack(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(description, data): every local tensor's bytes in ``data`` (each at an offset
        that is a multiple of 8, so that any dtype can be viewed there again)."""
        pieces: list[torch.Tensor] = []
        offset = 0

        def place(t: Any) -> tuple[int, str, list[int]]:
            nonlocal offset
            loc = local(t).detach().contiguous()
            raw = loc.reshape(-1).view(torch.uint8)
            at, offset = offset, offset + -(-raw.numel() // 8) * 8
            pieces.extend([raw, torch.zeros(offset - at - raw.numel(), dtype=torch.uint8)])
            return at, str(loc.dtype).removeprefix("torch."), list(loc.shape)

        osd = self.optimizer.state_dict()
        desc = {
            "model": {k: place(v) for k, v in self.model.state_dict().items()},
            "state": {
                i: {
                    k: ("t", place(v)) if isinstance(v, torch.Tensor) else ("v", v)
                    for k, v in st.items()
                }
                for i, st in osd["state"].items()
            },  # fmt: skip
            "groups": osd["param_groups"],
            "step": step,
        }
        buf = io.BytesIO()
        torch.save(desc, buf)
        meta = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        return meta, (torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8))

    def _unpack(self, meta: torch.Tensor, data: torch.Tensor) -> int:
        desc = torch.load(io.BytesIO(meta.numpy().tobytes()), weights_only=True)

        def view(spec: Any) -> torch.Tensor:
            at, dtype, shape = spec
            kind = getattr(torch, str(dtype), None)
            if not isinstance(kind, torch.dtype):
                raise CheckpointError(f"live transfer: unknown dtype {dtype!r}")
            n = math.prod(shape) * torch.empty(0, dtype=kind).element_size()
            if at < 0 or at + n > data.numel():
                raise CheckpointError("live transfer: a tensor lies outside the data sent")
            return data[at : at + n].view(kind).reshape(shape)

        mine = self.model.state_dict()
        if set(mine) != set(desc["model"]):
            raise CheckpointError("live transfer: the replicas' models differ in their keys")
        with torch.no_grad():
            for k, v in mine.items():
                got, dst = view(desc["model"][k]), local(v)
                if dst.shape != got.shape or dst.dtype != got.dtype:
                    raise CheckpointError(f"live transfer: {k} has another shard shape or dtype")
                dst.copy_(got)
        state: dict[Any, dict[str, Any]] = {}
        for i, st in desc["state"].items():
            p = self.params[int(i)]
            state[i] = {}
            for k, (kind, v) in st.items():
                t = view(v).clone() if kind == "t" else v
                state[i][k] = _like(p, t) if kind == "t" and t.dim() > 0 else t
        self.optimizer.load_state_dict({"state": state, "param_groups": desc["groups"]})
        return int(desc["step"])


def _like(param: Any, t: torch.Tensor) -> Any:
    """``t`` (a local shard) as a tensor laid out like ``param`` (a DTensor: its mesh and
    placements), for gradients and optimizer state."""
    if not hasattr(param, "device_mesh"):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        t, param.device_mesh, param.placements, run_check=False, shape=param.shape,
        stride=param.stride(),
    )  # fmt: skip


__all__ = [
    "GroupJoins",
    "Layout",
    "Shards",
    "local",
    "micro_chunks",
    "plan_groups",
    "shard_mesh",
]
