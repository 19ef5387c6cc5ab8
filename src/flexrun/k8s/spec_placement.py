"""The job spec's placement, network and run-directory blocks (``spec.scheduling``,
``spec.network``, ``spec.runDir``).

Owns their fields, defaults and parsing (priority class, node selectors and tolerations
beside the spot pool's, affinity and topology spread as Kubernetes objects, the
one-pod-per-node and zone-spread shortcuts, the Kueue queue; host networking, the RDMA
device resource and the NCCL variables they imply; where each pod's run directory lives
so that it outlives the pod). It does not render them
(``pods.py``, ``objects.py``) nor check Kubernetes objects' fields (``validate``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flexrun._spec import SpecReader, fail
from flexrun.k8s.spec_types import DNS1123, CheckpointVolume

_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulingSpec:
    """Where and when Worker pods run (``spec.scheduling``); Kubernetes objects are kept as
    written (their fields are checked by Kubernetes' schemas in ``validate``)."""

    priority_class: str | None = None
    """``priorityClassName`` of the Worker pods."""
    node_selector: tuple[tuple[str, str], ...] = ()
    """More node labels the Workers require (beside ``spot.nodeSelector``)."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    """More tolerations (Kubernetes ``Toleration`` objects) beside the spot pool's."""
    affinity: Mapping[str, Any] | None = None
    """A Kubernetes ``Affinity`` for the Worker pods."""
    topology_spread: tuple[Mapping[str, Any], ...] = ()
    """``topologySpreadConstraints`` of the Worker pods."""
    one_pod_per_node: bool = False
    """Required pod anti-affinity on ``kubernetes.io/hostname`` among the job's Workers."""
    spread_zones: bool = False
    """Spread Workers across ``topology.kubernetes.io/zone`` (maxSkew 1, ScheduleAnyway)."""
    queue: str | None = None
    """Kueue ``LocalQueue``: the job carries ``kueue.x-k8s.io/queue-name`` and is created
    suspended, so Kueue admits all of its pods at once (gang) or none."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkSpec:
    """The Workers' network (``spec.network``): host networking and RDMA devices."""

    host_network: bool = False
    """``hostNetwork: true`` (with ``dnsPolicy: ClusterFirstWithHostNet``): NCCL sees the
    node's interfaces, InfiniBand/RoCE included."""
    rdma_resource: str | None = None
    """Extended resource of the RDMA device plugin (``rdma/hca``, ``rdma/rdma_shared_device_a``)."""
    rdma_count: int = 1
    """Devices of ``rdma_resource`` per pod."""
    ib_hca: str | None = None
    """``NCCL_IB_HCA`` (e.g. ``mlx5``): which HCAs NCCL uses."""
    socket_ifname: str | None = None
    """``NCCL_SOCKET_IFNAME`` (e.g. ``eth0`` or ``^lo,docker``): NCCL's bootstrap interface."""

    def __post_init__(self) -> None:
        if self.rdma_resource is not None and not _RESOURCE_NAME.match(self.rdma_resource):
            raise fail(
                "spec.network.rdma.resource", f"{self.rdma_resource!r} is not a resource name"
            )
        if self.rdma_count < 1:
            raise fail("spec.network.rdma.count", f"must be >= 1 (got {self.rdma_count})")

    def nccl_env(self) -> tuple[tuple[str, str], ...]:
        """The NCCL variables these settings imply (a user's ``spec.env`` wins)."""
        out: list[tuple[str, str]] = []
        if self.rdma_resource is not None:
            out.append(("NCCL_IB_DISABLE", "0"))
        if self.ib_hca is not None:
            out.append(("NCCL_IB_HCA", self.ib_hca))
        if self.socket_ifname is not None:
            out.append(("NCCL_SOCKET_IFNAME", self.socket_ifname))
        return tuple(out)


def _k8s_objects(r: SpecReader, key: str) -> tuple[Mapping[str, Any], ...]:
    items = r.list_(key)
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise fail(f"{r.at(key)}[{i}]", "must be a mapping (a Kubernetes object)")
    return tuple(items)


def parse_scheduling(s: SpecReader) -> SchedulingSpec:
    r = s.sub("scheduling")
    if r is None:
        return SchedulingSpec()
    affinity = r.raw("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise fail(r.at("affinity"), "must be a mapping (a Kubernetes Affinity)")
    queue = None
    if (k := r.sub("kueue")) is not None:
        queue = k.req_str("queueName")
        k.done()
        if len(queue) > 63 or not DNS1123.match(queue):
            raise fail("spec.scheduling.kueue.queueName", f"{queue!r} is not a valid name")
    priority = r.str_("priorityClassName")
    if priority is not None and (len(priority) > 253 or not DNS1123_SUBDOMAIN.match(priority)):
        raise fail("spec.scheduling.priorityClassName", f"{priority!r} is not a valid name")
    out = SchedulingSpec(
        priority_class=priority,
        node_selector=r.str_map("nodeSelector"),
        tolerations=_k8s_objects(r, "tolerations"),
        affinity=affinity,
        topology_spread=_k8s_objects(r, "topologySpreadConstraints"),
        one_pod_per_node=r.bool_("onePodPerNode", False),
        spread_zones=r.bool_("spreadZones", False),
        queue=queue,
    )
    r.done()
    return out


def parse_network(s: SpecReader) -> NetworkSpec:
    r = s.sub("network")
    if r is None:
        return NetworkSpec()
    resource, count = None, 1
    if (rd := r.sub("rdma")) is not None:
        resource = rd.str_("resource", "rdma/hca")
        count = rd.int_("count", 1)
        rd.done()
    out = NetworkSpec(
        host_network=r.bool_("hostNetwork", False),
        rdma_resource=resource,
        rdma_count=count,
        ib_hca=r.str_("ncclIbHca"),
        socket_ifname=r.str_("ncclSocketIfname"),
    )
    r.done()
    return out


RUNS_VOLUME = "runs"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDirSpec:
    """Each pod's run directory (events, per-rank logs, hang stack dumps, error files) on
    a volume that outlives the pod: ``<mountPath>/<job>/<pod name>`` (``PET_RUN_DIR``), on a
    PVC of its own or under the checkpoint PVC's mount. A recreated pod has its
    predecessor's name (PyTorchJob and TrainJob pods are named by index) and continues in
    its directory; ``flexrun report <mountPath>/<job>/*`` reads all pods together."""

    existing_claim: str | None = None
    """A ReadWriteMany PVC mounted at ``mount_path`` (None: the checkpoint PVC)."""
    mount_path: str = "/runs"
    """Mount point of ``existing_claim`` (with the checkpoint PVC: its mount path + ``/runs``)."""

    def __post_init__(self) -> None:
        if self.existing_claim is not None and (
            len(self.existing_claim) > 253 or not DNS1123_SUBDOMAIN.match(self.existing_claim)
        ):
            raise fail("spec.runDir.existingClaim", f"{self.existing_claim!r} is not a valid name")
        if not self.mount_path.startswith("/") or self.mount_path.rstrip("/") in ("", "/dev"):
            raise fail(
                "spec.runDir.mountPath", f"must be an absolute directory (got {self.mount_path!r})"
            )
        if self.mount_path.rstrip("/").startswith(("/var/run/flexrun", "/dev/shm")):
            raise fail("spec.runDir.mountPath", f"{self.mount_path!r} is reserved")


def parse_run_dir(s: SpecReader) -> RunDirSpec | None:
    r = s.sub("runDir")
    if r is None:
        return None
    claim = r.str_("existingClaim")
    on_checkpoint = r.bool_("checkpointVolume", False)
    if (claim is None) == (not on_checkpoint):
        raise fail(
            "spec.runDir",
            "set existingClaim (a ReadWriteMany PVC) or checkpointVolume: true, not both",
        )
    out = RunDirSpec(existing_claim=claim, mount_path=r.str_("mountPath", "/runs"))
    if on_checkpoint and r.has("mountPath"):
        raise fail(
            "spec.runDir.mountPath", "only with existingClaim (else under the checkpoint mount)"
        )
    r.done()
    return out


def check_node_selectors(
    spot: tuple[tuple[str, str], ...], more: tuple[tuple[str, str], ...]
) -> None:
    """``scheduling.nodeSelector`` may add labels to ``spot.nodeSelector``, not contradict it."""
    spot_keys = dict(spot)
    for key, value in more:
        if spot_keys.get(key, value) != value:
            raise fail(
                f"spec.scheduling.nodeSelector.{key}",
                f"{value!r} contradicts spot.nodeSelector ({spot_keys[key]!r}): no node has both",
            )


def check_run_dir(
    run_dir: RunDirSpec, env: tuple[tuple[str, str], ...], checkpoint: CheckpointVolume | None
) -> None:
    """``spec.runDir`` against the rest of the spec."""
    if any(k in ("PET_RUN_DIR", "POD_NAME") for k, _ in env):
        raise fail("spec.env", "PET_RUN_DIR/POD_NAME are set by spec.runDir; remove them")
    if run_dir.existing_claim is None and (checkpoint is None or not checkpoint.has_volume):
        raise fail("spec.runDir.checkpointVolume", "needs a checkpoint PVC (spec.checkpoint)")
    if (
        run_dir.existing_claim is not None
        and checkpoint is not None
        and checkpoint.has_volume
        and run_dir.mount_path.rstrip("/") == checkpoint.mount_path.rstrip("/")
    ):
        raise fail("spec.runDir.mountPath", "is the checkpoint volume's mount path")


__all__ = [
    "RUNS_VOLUME",
    "check_node_selectors",
    "check_run_dir",
    "RunDirSpec",
    "parse_run_dir",
    "KUEUE_QUEUE_LABEL",
    "NetworkSpec",
    "SchedulingSpec",
    "parse_network",
    "parse_scheduling",
]
