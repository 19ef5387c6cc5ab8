"""The parts of flexrun's Kubernetes job spec: small frozen dataclasses, each self-checking.

Owns the schema of every nested block of the job spec (node range, resources, checkpoint
volume, store, spot placement, Trainer v2 options), each block's parsing from its YAML
mapping (``parse_*``, through the shared reader), and the constants both the spec and
the renderer use (target names, variables the operator or flexrun itself sets, secret
mount points). Each ``__post_init__`` raises a :class:`~flexrun.errors.SpecError` whose
message starts with the field's dotted path. The whole job (``JobSpec``) and the
top-level parsing live in ``spec.py``; nothing here knows what a manifest looks like.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flexrun._spec import SpecReader, fail
from flexrun.errors import SpecError
from flexrun.storage_options import (
    CHECKPOINT_DIR_ENV,
    STORAGE_OPTIONS_ENV,
    check_url,
    spec_storage_options,
)

API_VERSION = "flexrun.dev/v1alpha1"
KIND = "TrainingJob"

TARGET_PYTORCHJOB = "pytorchjob"
TARGET_TRAINJOB = "trainjob"
#: What ``flexrun k8s render`` can emit for the workers: Kubeflow v1 PyTorchJob (elastic,
#: the default) or Kubeflow Trainer v2 TrainJob + its runtime.
TARGETS = (TARGET_PYTORCHJOB, TARGET_TRAINJOB)
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")

#: Variables the Kubeflow operators inject (v1: from ``elasticPolicy``; Trainer v2's torch
#: plugin: the static PET_* set); a spec that sets them would fight the operator.
OPERATOR_ENV = frozenset(
    {
        "PYTHONUNBUFFERED",
        "PET_NPROC_PER_NODE",
        "PET_NNODES",
        "PET_RDZV_BACKEND",
        "PET_RDZV_ENDPOINT",
        "PET_RDZV_ID",
        "PET_RDZV_CONF",
        "PET_MAX_RESTARTS",
        "PET_STANDALONE",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "PET_NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "JOB_COMPLETION_INDEX",
    }
)

#: Where the job Secret (key ``secret``) is mounted in every worker pod (docs/user/kubernetes.md, the contract).
JOB_SECRET_DIR = "/var/run/flexrun/secret"
JOB_SECRET_KEY = "secret"
JOB_SECRET_FILE = f"{JOB_SECRET_DIR}/{JOB_SECRET_KEY}"
#: Where the etcd Secret (``ca.crt``, ``tls.crt``, ``tls.key``) is mounted, in the etcd
#: members and in the workers (docs/user/kubernetes.md, the contract).
ETCD_SECRET_DIR = "/var/run/flexrun/etcd"
ETCD_SECRET_KEYS = ("ca.crt", "tls.crt", "tls.key")

#: Variables render sets on the worker container itself.
RENDER_ENV = frozenset(
    {
        "POD_IP",
        CHECKPOINT_DIR_ENV,
        STORAGE_OPTIONS_ENV,
        "FLEXRUN_JOB_SECRET",
        "FLEXRUN_JOB_SECRET_FILE",
        "FLEXRUN_ETCD_PASSWORD",
        "FLEXRUN_ETCD_PASSWORD_FILE",
    }
)

#: Shortest grace period that leaves room for a final checkpoint after SIGTERM.
MIN_GRACE_PERIOD_S = 30

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
NPROC_WORDS = ("auto", "cpu", "gpu")
ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany")
TOLERATION_OPS = ("Equal", "Exists")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
METRIC_TYPES = ("Resource", "Pods", "Object", "External", "ContainerResource")
# Job name + the longest suffix render adds ("-etcd-peers") must fit a 63-char DNS label.
MAX_NAME_LEN = 63 - len("-etcd-peers")


def check_quantity(path: str, value: str) -> None:
    if not QUANTITY.match(value):
        raise fail(path, f"{value!r} is not a Kubernetes quantity (e.g. 500m, 8, 32Gi)")


def check_secret_name(path: str, value: str | None) -> None:
    if value is not None and (len(value) > 253 or not DNS1123.match(value)):
        raise fail(path, f"{value!r} is not a valid Secret name")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRange:
    """How many nodes (Worker pods) the job may run on."""

    min: int
    """Fewest nodes the job trains with (``elasticPolicy.minReplicas``, ``--nnodes MIN:``)."""
    max: int
    """Most nodes the job scales up to (``elasticPolicy.maxReplicas``, ``--nnodes :MAX``)."""

    def __post_init__(self) -> None:
        if self.min < 1:
            raise fail("spec.nnodes", f"min must be >= 1 (got {self.min})")
        if self.min > self.max:
            raise fail("spec.nnodes", f"min {self.min} > max {self.max}")

    def __str__(self) -> str:
        return f"{self.min}:{self.max}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Resources:
    """Per-Worker-pod resources. ``gpu`` becomes ``nvidia.com/gpu`` (requests = limits)."""

    cpu: str | None = None
    """CPU request as a Kubernetes quantity (``"8"``, ``"7500m"``)."""
    memory: str | None = None
    """Memory request and limit (``"64Gi"``); a limit too, so an OOM kills one pod, not a node."""
    gpu: int = 0
    """``nvidia.com/gpu`` per pod."""

    def __post_init__(self) -> None:
        if self.cpu is not None:
            check_quantity("spec.resources.cpu", self.cpu)
        if self.memory is not None:
            check_quantity("spec.resources.memory", self.memory)
        if self.gpu < 0:
            raise fail("spec.resources.gpu", f"must be >= 0 (got {self.gpu})")


#: The ``spec.checkpoint`` fields of a PVC; a ``url`` checkpoint has none of them.
_VOLUME_FIELDS = ("mountPath", "existingClaim", "size", "storageClass", "accessMode")


POD_LOCAL_PROTOCOLS = frozenset(
    {"file", "local", "memory", "simplecache", "filecache", "blockcache"}
)
"""fsspec protocols whose data stays in the pod (a checkpoint there dies with it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointVolume:
    """Where checkpoints live: a PVC mounted into every Worker pod, or (``url``) an object
    store every worker reaches itself (no volume)."""

    url: str | None = None
    """An fsspec URL (``s3://bucket/prefix``, ``gs://...``) exported as
    ``FLEXRUN_CHECKPOINT_DIR`` instead of a mount path; no PVC is rendered or mounted.
    Credentials come from the pod (workload identity / IRSA through
    ``spec.serviceAccountName``, or ``AWS_*`` variables from a Secret through
    ``spec.envFrom``), never from the URL."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec ``storage_options`` (endpoint, region, profile ...; no credential), exported
    as compact JSON in ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS``; only with ``url``."""

    mount_path: str = "/checkpoints"
    """Mount point in the worker container; exported as ``FLEXRUN_CHECKPOINT_DIR``."""
    existing_claim: str | None = None
    """Use this PVC instead of creating ``<name>-checkpoints``."""
    size: str | None = None
    """Size of the PVC render creates (required unless ``existing_claim``)."""
    storage_class: str | None = None
    """StorageClass of the created PVC (cluster default if unset)."""
    access_mode: str = "ReadWriteMany"
    """Access mode of the created PVC; several nodes write, so ReadWriteMany."""

    def __post_init__(self) -> None:
        if self.url is not None:
            self._check_url()
            return
        if self.storage_options:
            raise fail("spec.checkpoint.storageOptions", "only with url (an object store)")
        if not self.mount_path.startswith("/"):
            raise fail("spec.checkpoint.mountPath", f"must be absolute (got {self.mount_path!r})")
        if self.mount_path.rstrip("/").startswith("/var/run/flexrun"):
            raise fail("spec.checkpoint.mountPath", "/var/run/flexrun is where secrets mount")
        if self.existing_claim is not None:
            if self.size is not None or self.storage_class is not None:
                raise fail(
                    "spec.checkpoint.existingClaim",
                    "cannot be combined with size/storageClass (those create a new PVC)",
                )
            if not DNS1123.match(self.existing_claim):
                raise fail(
                    "spec.checkpoint.existingClaim", f"{self.existing_claim!r} is not a valid name"
                )
        elif self.size is None:
            raise fail("spec.checkpoint", "set size (a PVC is created) or existingClaim")
        else:
            check_quantity("spec.checkpoint.size", self.size)
        if self.access_mode not in ACCESS_MODES:
            raise fail(
                "spec.checkpoint.accessMode",
                f"{self.access_mode!r} not one of {', '.join(ACCESS_MODES)}",
            )

    def _check_url(self) -> None:
        assert self.url is not None
        check_url(self.url, "spec.checkpoint.url", error=SpecError)
        protocol = self.url.rsplit("::", 1)[-1].split("://", 1)[0].lower()
        if protocol in POD_LOCAL_PROTOCOLS:
            raise fail(
                "spec.checkpoint.url",
                f"{protocol}:// lives inside the pod and is lost with it; use an object store "
                "(s3://, gs://, az:// ...) or a volume (size/existingClaim instead of url)",
            )
        for key, value in (
            ("existingClaim", self.existing_claim),
            ("size", self.size),
            ("storageClass", self.storage_class),
        ):
            if value is not None:
                raise fail(f"spec.checkpoint.{key}", "contradicts url (no volume is rendered)")
        spec_storage_options(
            self.storage_options, "spec.checkpoint.storageOptions", error=SpecError
        )

    @property
    def location(self) -> str:
        """What workers get in ``FLEXRUN_CHECKPOINT_DIR``: the URL or the mount path."""
        return self.url if self.url is not None else self.mount_path

    @property
    def has_volume(self) -> bool:
        """A PVC is mounted (no ``url``)."""
        return self.url is None


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreSpec:
    """The rendezvous store, run on stable (non-spot) nodes so a reclaim never takes it."""

    type: str = "tcp"
    """``tcp``: one ``flexrun store`` pod; ``etcd``: a 3-member etcd StatefulSet (TLS)."""
    port: int = 29400
    """Port of ``flexrun store`` (tcp only; etcd clients always use 2379)."""
    image: str | None = None
    """Container image: the job's image for tcp, an etcd image for etcd."""
    node_selector: tuple[tuple[str, str], ...] = ()
    """Extra node labels the store pods require (e.g. an on-demand pool)."""
    existing_secret: str | None = None
    """etcd: a Secret with ``ca.crt``, ``tls.crt``, ``tls.key`` to use instead of rendering
    the empty ``<name>-etcd`` one (e.g. made by cert-manager)."""

    def __post_init__(self) -> None:
        if self.type not in ("tcp", "etcd"):
            raise fail("spec.store.type", f"{self.type!r} not one of tcp, etcd")
        if not 1 <= self.port <= 65535:
            raise fail("spec.store.port", f"must be 1..65535 (got {self.port})")
        if self.type == "etcd" and self.port != 29400:
            raise fail("spec.store.port", "not used with type etcd (clients use 2379)")
        if self.type != "etcd" and self.existing_secret is not None:
            raise fail("spec.store.existingSecret", "only for type etcd (its TLS certificates)")
        check_secret_name("spec.store.existingSecret", self.existing_secret)


@dataclass(frozen=True, kw_only=True, slots=True)
class Toleration:
    """A pod toleration (``core/v1 Toleration``)."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None

    def __post_init__(self) -> None:
        if self.operator not in TOLERATION_OPS:
            raise fail(
                "spec.spot.tolerations.operator", f"{self.operator!r} not one of Equal, Exists"
            )
        if self.operator == "Exists" and self.value is not None:
            raise fail("spec.spot.tolerations.value", "must be empty when operator is Exists")
        if self.key is None and self.operator != "Exists":
            raise fail("spec.spot.tolerations.key", "required unless operator is Exists")
        if self.effect is not None and self.effect not in TAINT_EFFECTS:
            raise fail(
                "spec.spot.tolerations.effect",
                f"{self.effect!r} not one of {', '.join(TAINT_EFFECTS)}",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class SpotSpec:
    """How Worker pods land on the spot pool (and how the store stays off it)."""

    node_selector: tuple[tuple[str, str], ...] = ()
    """Labels of spot nodes: Workers select them, the store pods require their absence."""
    tolerations: tuple[Toleration, ...] = ()
    """Tolerations for the spot pool's taints (Workers only; the store never tolerates them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainJobOptions:
    """Trainer v2 settings (``target: trainjob``)."""

    runtime_kind: str = "TrainingRuntime"
    """Kind of the runtime rendered beside the TrainJob: ``TrainingRuntime`` (namespaced,
    the default) or ``ClusterTrainingRuntime`` (cluster-scoped; for clusters where only
    administrators create runtimes)."""

    def __post_init__(self) -> None:
        if self.runtime_kind not in RUNTIME_KINDS:
            raise fail(
                "spec.trainJob.runtimeKind",
                f"{self.runtime_kind!r} not one of {', '.join(RUNTIME_KINDS)}",
            )


# -- parsing: each block from its YAML mapping (the shared reader names the field) ------


def parse_toleration(value: object, path: str) -> Toleration:
    r = SpecReader(value, path)
    try:
        tol = Toleration(
            key=r.str_("key"),
            operator=r.str_("operator", "Equal"),
            value=r.str_("value"),
            effect=r.str_("effect"),
            toleration_seconds=r.int_("tolerationSeconds"),
        )
    except SpecError as exc:
        raise SpecError(str(exc).replace("spec.spot.tolerations", path, 1)) from None
    r.done()
    return tol


def _quantity_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def parse_resources(s: SpecReader) -> Resources:
    rr = s.sub("resources")
    if rr is None:
        return Resources()
    resources = Resources(
        cpu=_quantity_or_none(rr.raw("cpu")),
        memory=_quantity_or_none(rr.raw("memory")),
        gpu=rr.int_("gpu", 0),
    )
    rr.done()
    return resources


def parse_nproc(s: SpecReader, resources: Resources) -> str:
    raw = s.raw("nprocPerNode")
    if raw is None:
        return str(resources.gpu) if resources.gpu else "auto"
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise fail("spec.nprocPerNode", f"must be a number or auto/cpu/gpu (got {raw!r})")
    return str(raw)


def parse_checkpoint(s: SpecReader) -> CheckpointVolume | None:
    cr = s.sub("checkpoint")
    if cr is None:
        return None
    url = cr.str_("url")
    if url is not None:
        for key in _VOLUME_FIELDS:
            if cr.has(key):
                raise fail(cr.at(key), "contradicts url: an object-store checkpoint has no volume")
        options = cr.raw("storageOptions")
        checkpoint = CheckpointVolume(
            url=url,
            storage_options=spec_storage_options(
                {} if options is None else options, cr.at("storageOptions"), error=SpecError
            ),
        )
        cr.done()
        return checkpoint
    if cr.has("storageOptions"):
        raise fail(cr.at("storageOptions"), "only with url (an object store)")
    checkpoint = CheckpointVolume(
        mount_path=cr.str_("mountPath", "/checkpoints"),
        existing_claim=cr.str_("existingClaim"),
        size=_quantity_or_none(cr.raw("size")),
        storage_class=cr.str_("storageClass"),
        access_mode=cr.str_("accessMode", "ReadWriteMany"),
    )
    cr.done()
    return checkpoint


def parse_store(s: SpecReader) -> StoreSpec:
    sr = s.sub("store")
    if sr is None:
        return StoreSpec()
    store = StoreSpec(
        type=sr.str_("type", "tcp"),
        port=sr.int_("port", 29400),
        image=sr.str_("image"),
        node_selector=sr.str_map("nodeSelector"),
        existing_secret=sr.str_("existingSecret"),
    )
    sr.done()
    return store


def parse_spot(s: SpecReader) -> SpotSpec:
    pr = s.sub("spot")
    if pr is None:
        return SpotSpec()
    tols = tuple(
        parse_toleration(t, f"spec.spot.tolerations[{i}]")
        for i, t in enumerate(pr.list_("tolerations"))
    )
    spot = SpotSpec(node_selector=pr.str_map("nodeSelector"), tolerations=tols)
    pr.done()
    return spot


def parse_hpa(s: SpecReader) -> tuple[Mapping[str, Any], ...]:
    hr = s.sub("hpa")
    if hr is None:
        return ()
    items = hr.list_("metrics")
    if not items:
        raise fail("spec.hpa.metrics", "must list at least one autoscaling/v2 MetricSpec")
    for i, m in enumerate(items):
        if not isinstance(m, Mapping):
            raise fail(f"spec.hpa.metrics[{i}]", "must be a mapping (a MetricSpec)")
    hr.done()
    return tuple(items)


__all__ = [
    "API_VERSION",
    "KIND",
    "OPERATOR_ENV",
    "RENDER_ENV",
    "TARGETS",
    "CheckpointVolume",
    "NodeRange",
    "Resources",
    "SpotSpec",
    "StoreSpec",
    "Toleration",
    "TrainJobOptions",
]
