"""flexrun's own Kubernetes job spec: the data ``flexrun k8s render`` turns into manifests.

Owns the spec's schema (field names, types, defaults), its parsing from a YAML mapping and
its validation; every error is a :class:`~flexrun.errors.SpecError` whose message starts
with the dotted field path (``spec.nnodes: min 4 > max 2``). It does not know what the
manifests look like (``render.py``) nor how manifests are checked (``validate.py``).

The file format::

    apiVersion: flexrun.dev/v1alpha1
    kind: TrainingJob
    metadata: {name: resnet, namespace: ml}
    spec:
      image: registry.example.com/resnet-train:1.0
      script: train.py            # or module: pkg.train
      args: [--epochs, "90"]
      nnodes: "2:8"               # MIN:MAX, or one number for a fixed size
      nprocPerNode: 8             # int | auto | cpu | gpu (default: resources.gpu or auto)
      replicas: 8                 # Worker pods created at first (default: max)
      resources: {cpu: "30", memory: 200Gi, gpu: 8}
      checkpoint: {mountPath: /checkpoints, size: 500Gi, storageClass: nfs}
      store: {type: tcp}          # tcp | etcd
      spot:
        nodeSelector: {cloud.google.com/gke-spot: "true"}
        tolerations: [{key: cloud.google.com/gke-spot, value: "true", effect: NoSchedule}]
      gracePeriodSeconds: 120
      maxRestarts: 3
      env: {NCCL_DEBUG: WARN}
      hpa: {metrics: [...]}       # autoscaling/v2 MetricSpec list
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun.errors import SpecError

API_VERSION = "flexrun.dev/v1alpha1"
KIND = "TrainingJob"

#: Variables the Kubeflow v1 operator injects into every replica of an elastic job; a spec
#: that sets them would fight the operator (and the launcher reads them as its defaults).
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
    }
)

#: Variables render sets on the worker container itself.
RENDER_ENV = frozenset({"POD_IP", "FLEXRUN_CHECKPOINT_DIR"})

#: Shortest grace period that leaves room for a final checkpoint after SIGTERM.
MIN_GRACE_PERIOD_S = 30

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NPROC_WORDS = ("auto", "cpu", "gpu")
_ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod", "ReadOnlyMany")
_TOLERATION_OPS = ("Equal", "Exists")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_METRIC_TYPES = ("Resource", "Pods", "Object", "External", "ContainerResource")
# Job name + the longest suffix render adds ("-etcd-peers") must fit a 63-char DNS label.
_MAX_NAME_LEN = 63 - len("-etcd-peers")


def _fail(path: str, message: str) -> SpecError:
    return SpecError(f"{path}: {message}")


def _check_quantity(path: str, value: str) -> None:
    if not _QUANTITY.match(value):
        raise _fail(path, f"{value!r} is not a Kubernetes quantity (e.g. 500m, 8, 32Gi)")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeRange:
    """How many nodes (Worker pods) the job may run on."""

    min: int
    """Fewest nodes the job trains with (``elasticPolicy.minReplicas``)."""
    max: int
    """Most nodes the job scales up to (``elasticPolicy.maxReplicas``)."""

    def __post_init__(self) -> None:
        if self.min < 1:
            raise _fail("spec.nnodes", f"min must be >= 1 (got {self.min})")
        if self.min > self.max:
            raise _fail("spec.nnodes", f"min {self.min} > max {self.max}")

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
            _check_quantity("spec.resources.cpu", self.cpu)
        if self.memory is not None:
            _check_quantity("spec.resources.memory", self.memory)
        if self.gpu < 0:
            raise _fail("spec.resources.gpu", f"must be >= 0 (got {self.gpu})")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointVolume:
    """Where checkpoints live: a PVC mounted into every Worker pod."""

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
        if not self.mount_path.startswith("/"):
            raise _fail("spec.checkpoint.mountPath", f"must be absolute (got {self.mount_path!r})")
        if self.existing_claim is not None:
            if self.size is not None or self.storage_class is not None:
                raise _fail(
                    "spec.checkpoint.existingClaim",
                    "cannot be combined with size/storageClass (those create a new PVC)",
                )
            if not _DNS1123.match(self.existing_claim):
                raise _fail(
                    "spec.checkpoint.existingClaim", f"{self.existing_claim!r} is not a valid name"
                )
        elif self.size is None:
            raise _fail("spec.checkpoint", "set size (a PVC is created) or existingClaim")
        else:
            _check_quantity("spec.checkpoint.size", self.size)
        if self.access_mode not in _ACCESS_MODES:
            raise _fail(
                "spec.checkpoint.accessMode",
                f"{self.access_mode!r} not one of {', '.join(_ACCESS_MODES)}",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreSpec:
    """The rendezvous store, run on stable (non-spot) nodes so a reclaim never takes it."""

    type: str = "tcp"
    """``tcp``: one ``flexrun store`` pod; ``etcd``: a 3-member etcd StatefulSet."""
    port: int = 29400
    """Port of ``flexrun store`` (tcp only; etcd clients always use 2379)."""
    image: str | None = None
    """Container image: the job's image for tcp, an etcd image for etcd."""
    node_selector: tuple[tuple[str, str], ...] = ()
    """Extra node labels the store pods require (e.g. an on-demand pool)."""

    def __post_init__(self) -> None:
        if self.type not in ("tcp", "etcd"):
            raise _fail("spec.store.type", f"{self.type!r} not one of tcp, etcd")
        if not 1 <= self.port <= 65535:
            raise _fail("spec.store.port", f"must be 1..65535 (got {self.port})")
        if self.type == "etcd" and self.port != 29400:
            raise _fail("spec.store.port", "not used with type etcd (clients use 2379)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Toleration:
    """A pod toleration (``core/v1 Toleration``)."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None

    def __post_init__(self) -> None:
        if self.operator not in _TOLERATION_OPS:
            raise _fail(
                "spec.spot.tolerations.operator", f"{self.operator!r} not one of Equal, Exists"
            )
        if self.operator == "Exists" and self.value is not None:
            raise _fail("spec.spot.tolerations.value", "must be empty when operator is Exists")
        if self.key is None and self.operator != "Exists":
            raise _fail("spec.spot.tolerations.key", "required unless operator is Exists")
        if self.effect is not None and self.effect not in _TAINT_EFFECTS:
            raise _fail(
                "spec.spot.tolerations.effect",
                f"{self.effect!r} not one of {', '.join(_TAINT_EFFECTS)}",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class SpotSpec:
    """How Worker pods land on the spot pool (and how the store stays off it)."""

    node_selector: tuple[tuple[str, str], ...] = ()
    """Labels of spot nodes: Workers select them, the store pods require their absence."""
    tolerations: tuple[Toleration, ...] = ()
    """Tolerations for the spot pool's taints (Workers only; the store never tolerates them)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """A whole flexrun training job on Kubernetes."""

    name: str
    """``metadata.name``: the PyTorchJob's name, prefix of every object, the rendezvous id."""
    namespace: str | None = None
    """``metadata.namespace`` of every object (kubectl's current namespace if unset)."""
    image: str
    """Worker image; it must contain flexrun and the training code."""
    script: str | None = None
    """Training script path inside the image (exactly one of script/module)."""
    module: str | None = None
    """Training module run as ``python -m`` (exactly one of script/module)."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script."""
    nnodes: NodeRange
    """Elastic node range."""
    nproc_per_node: str = "auto"
    """Workers per pod: a number, or auto/cpu/gpu (``spec.nprocPerNode``)."""
    replicas: int
    """Worker pods requested at first; the job trains once ``nnodes.min`` have joined."""
    resources: Resources = field(default_factory=Resources)
    checkpoint: CheckpointVolume | None = None
    store: StoreSpec = field(default_factory=StoreSpec)
    spot: SpotSpec = field(default_factory=SpotSpec)
    grace_period_s: int = 120
    """``terminationGracePeriodSeconds``: SIGTERM to SIGKILL, the final checkpoint's budget."""
    max_restarts: int = 3
    """In-pod restarts by the agent (``elasticPolicy.maxRestarts`` -> ``PET_MAX_RESTARTS``)."""
    backoff_limit: int | None = None
    """Pod re-creations by the operator before the job fails (unlimited if unset)."""
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    """Extra rendezvous settings (``elasticPolicy.rdzvConf`` -> ``PET_RDZV_CONF``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for the worker container."""
    hpa_metrics: tuple[Mapping[str, Any], ...] = ()
    """autoscaling/v2 MetricSpecs; when set the operator creates an HPA for the Workers."""
    shm_size: str | None = "2Gi"
    """Size of the in-memory ``/dev/shm`` (DataLoader workers need more than 64Mi)."""

    def __post_init__(self) -> None:
        if len(self.name) > _MAX_NAME_LEN or not _DNS1035.match(self.name):
            raise _fail(
                "metadata.name",
                f"{self.name!r} must be a DNS-1035 label (lowercase letters, digits, '-', "
                f"starting with a letter) of at most {_MAX_NAME_LEN} characters",
            )
        if self.namespace is not None and not _DNS1123.match(self.namespace):
            raise _fail("metadata.namespace", f"{self.namespace!r} is not a valid namespace")
        if not self.image.strip():
            raise _fail("spec.image", "must not be empty")
        if (self.script is None) == (self.module is None):
            raise _fail("spec.script", "set exactly one of script and module")
        if self.module is not None and not _MODULE.match(self.module):
            raise _fail("spec.module", f"{self.module!r} is not a dotted module name")
        self._check_nproc()
        if not self.nnodes.min <= self.replicas <= self.nnodes.max:
            raise _fail(
                "spec.replicas",
                f"{self.replicas} outside nnodes {self.nnodes.min}:{self.nnodes.max}",
            )
        if self.grace_period_s < MIN_GRACE_PERIOD_S:
            raise _fail(
                "spec.gracePeriodSeconds",
                f"{self.grace_period_s} leaves no time for a final checkpoint; use >= {MIN_GRACE_PERIOD_S}",
            )
        if self.max_restarts < 0:
            raise _fail("spec.maxRestarts", f"must be >= 0 (got {self.max_restarts})")
        if self.backoff_limit is not None and self.backoff_limit < 0:
            raise _fail("spec.backoffLimit", f"must be >= 0 (got {self.backoff_limit})")
        for key, _ in self.env:
            if not _ENV_NAME.match(key):
                raise _fail(f"spec.env.{key}", "is not a valid environment variable name")
            if key in RENDER_ENV:
                raise _fail(f"spec.env.{key}", "is set by flexrun k8s render; remove it")
            if key in OPERATOR_ENV:
                raise _fail(
                    f"spec.env.{key}",
                    "is injected by the Kubeflow operator from the job's fields; remove it",
                )
        if self.shm_size is not None:
            _check_quantity("spec.shmSize", self.shm_size)
        if (
            self.checkpoint is not None
            and self.checkpoint.existing_claim is None
            and self.checkpoint.access_mode in ("ReadWriteOnce", "ReadWriteOncePod")
            and self.nnodes.max > 1
        ):
            raise _fail(
                "spec.checkpoint.accessMode",
                f"{self.checkpoint.access_mode} cannot be mounted by {self.nnodes.max} pods on "
                "different nodes; use ReadWriteMany",
            )
        for i, metric in enumerate(self.hpa_metrics):
            if metric.get("type") not in _METRIC_TYPES:
                raise _fail(
                    f"spec.hpa.metrics[{i}].type",
                    f"{metric.get('type')!r} not one of {', '.join(_METRIC_TYPES)}",
                )

    def _check_nproc(self) -> None:
        nproc = self.nproc_per_node
        if nproc in _NPROC_WORDS:
            if nproc == "gpu" and self.resources.gpu == 0:
                raise _fail("spec.nprocPerNode", "gpu needs spec.resources.gpu > 0")
            return
        if not nproc.isdigit() or int(nproc) < 1:
            raise _fail("spec.nprocPerNode", f"{nproc!r} is not a positive number or auto/cpu/gpu")
        if self.resources.gpu and int(nproc) > self.resources.gpu:
            raise _fail(
                "spec.nprocPerNode",
                f"{nproc} processes but only {self.resources.gpu} GPUs per pod (spec.resources.gpu)",
            )

    @property
    def rdzv_backend(self) -> str:
        """The ``--rdzv-backend`` the workers use for this store."""
        return "etcd-v3" if self.store.type == "etcd" else "c10d"


# ---------------------------------------------------------------------------------------
# Parsing: YAML mapping -> JobSpec. Each reader checks type and unknown keys at its path.


class _Reader:
    """A mapping at a dotted path; typed getters that fail naming the field."""

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise _fail(path, f"must be a mapping (got {type(data).__name__})")
        self._data = data
        self._path = path
        self._used: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def raw(self, key: str) -> object:
        self._used.add(key)
        return self._data.get(key)

    def str_(self, key: str, default: str | None = None) -> str | None:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise _fail(self.at(key), f"must be a non-empty string (got {value!r})")
        return value

    def req_str(self, key: str) -> str:
        value = self.str_(key)
        if value is None:
            raise _fail(self.at(key), "is required")
        return value

    def int_(self, key: str, default: int | None = None) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(self.at(key), f"must be an integer (got {value!r})")
        return value

    def int_d(self, key: str, default: int) -> int:
        value = self.int_(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return key in self._data

    def str_map(self, key: str) -> tuple[tuple[str, str], ...]:
        value = self.raw(key)
        if value is None:
            return ()
        if not isinstance(value, Mapping):
            raise _fail(self.at(key), f"must be a mapping (got {type(value).__name__})")
        out = []
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, str | int | float):
                raise _fail(f"{self.at(key)}.{k}", f"must be a string (got {v!r})")
            out.append((str(k), str(v)))
        return tuple(out)

    def sub(self, key: str) -> _Reader | None:
        value = self.raw(key)
        return None if value is None else _Reader(value, self.at(key))

    def list_(self, key: str) -> list[object]:
        value = self.raw(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise _fail(self.at(key), f"must be a list (got {type(value).__name__})")
        return value

    def done(self) -> None:
        unknown = sorted(str(k) for k in self._data if k not in self._used)
        if unknown:
            raise _fail(self.at(unknown[0]), "unknown field")


def _parse_nnodes(value: object) -> NodeRange:
    if isinstance(value, bool):
        raise _fail("spec.nnodes", f"must be N or MIN:MAX (got {value!r})")
    if isinstance(value, int):
        return NodeRange(min=value, max=value)
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            lo, hi = int(parts[0]), int(parts[-1])
            return NodeRange(min=lo, max=hi)
    raise _fail("spec.nnodes", f"must be N or MIN:MAX (got {value!r})")


def _parse_toleration(value: object, path: str) -> Toleration:
    r = _Reader(value, path)
    try:
        tol = Toleration(
            key=r.str_("key"),
            operator=r.str_("operator", "Equal") or "Equal",
            value=r.str_("value"),
            effect=r.str_("effect"),
            toleration_seconds=r.int_("tolerationSeconds"),
        )
    except SpecError as exc:
        raise SpecError(str(exc).replace("spec.spot.tolerations", path, 1)) from None
    r.done()
    return tol


def parse_job_spec(data: object) -> JobSpec:
    """Build a :class:`JobSpec` from a parsed YAML document.

    Raises:
        SpecError: a missing, mistyped, unknown or inconsistent field (the message names it).
    """
    top = _Reader(data, "")
    api_version = top.str_("apiVersion", API_VERSION)
    if api_version != API_VERSION:
        raise _fail("apiVersion", f"{api_version!r} is not {API_VERSION}")
    kind = top.str_("kind", KIND)
    if kind != KIND:
        raise _fail("kind", f"{kind!r} is not {KIND}")
    meta = top.sub("metadata")
    if meta is None:
        raise _fail("metadata.name", "is required")
    name = meta.req_str("name")
    namespace = meta.str_("namespace")
    meta.done()
    s = top.sub("spec")
    if s is None:
        raise _fail("spec", "is required")
    top.done()

    nnodes_raw = s.raw("nnodes")
    if nnodes_raw is None:
        raise _fail("spec.nnodes", "is required (N or MIN:MAX)")
    nnodes = _parse_nnodes(nnodes_raw)

    resources = Resources()
    if (rr := s.sub("resources")) is not None:
        cpu, mem = rr.raw("cpu"), rr.raw("memory")
        resources = Resources(
            cpu=None if cpu is None else str(cpu),
            memory=None if mem is None else str(mem),
            gpu=rr.int_d("gpu", 0),
        )
        rr.done()

    nproc_raw = s.raw("nprocPerNode")
    if nproc_raw is None:
        nproc = str(resources.gpu) if resources.gpu else "auto"
    elif isinstance(nproc_raw, bool) or not isinstance(nproc_raw, int | str):
        raise _fail("spec.nprocPerNode", f"must be a number or auto/cpu/gpu (got {nproc_raw!r})")
    else:
        nproc = str(nproc_raw)

    checkpoint = None
    if (cr := s.sub("checkpoint")) is not None:
        size = cr.raw("size")
        checkpoint = CheckpointVolume(
            mount_path=cr.str_("mountPath", "/checkpoints") or "/checkpoints",
            existing_claim=cr.str_("existingClaim"),
            size=None if size is None else str(size),
            storage_class=cr.str_("storageClass"),
            access_mode=cr.str_("accessMode", "ReadWriteMany") or "ReadWriteMany",
        )
        cr.done()

    store = StoreSpec()
    if (sr := s.sub("store")) is not None:
        store = StoreSpec(
            type=sr.str_("type", "tcp") or "tcp",
            port=sr.int_d("port", 29400),
            image=sr.str_("image"),
            node_selector=sr.str_map("nodeSelector"),
        )
        sr.done()

    spot = SpotSpec()
    if (pr := s.sub("spot")) is not None:
        tols = tuple(
            _parse_toleration(t, f"spec.spot.tolerations[{i}]")
            for i, t in enumerate(pr.list_("tolerations"))
        )
        spot = SpotSpec(node_selector=pr.str_map("nodeSelector"), tolerations=tols)
        pr.done()

    metrics: tuple[Mapping[str, Any], ...] = ()
    if (hr := s.sub("hpa")) is not None:
        items = hr.list_("metrics")
        if not items:
            raise _fail("spec.hpa.metrics", "must list at least one autoscaling/v2 MetricSpec")
        for i, m in enumerate(items):
            if not isinstance(m, Mapping):
                raise _fail(f"spec.hpa.metrics[{i}]", "must be a mapping (a MetricSpec)")
        metrics = tuple(items)  # type: ignore[arg-type]  # checked just above
        hr.done()

    args = s.list_("args")
    for i, a in enumerate(args):
        if isinstance(a, Mapping | list) or a is None:
            raise _fail(f"spec.args[{i}]", f"must be a string (got {a!r})")
    shm = s.raw("shmSize") if s.has("shmSize") else "2Gi"

    spec = JobSpec(
        name=name,
        namespace=namespace,
        image=s.req_str("image"),
        script=s.str_("script"),
        module=s.str_("module"),
        args=tuple(str(a) for a in args),
        nnodes=nnodes,
        nproc_per_node=nproc,
        replicas=s.int_d("replicas", nnodes.max),
        resources=resources,
        checkpoint=checkpoint,
        store=store,
        spot=spot,
        grace_period_s=s.int_d("gracePeriodSeconds", 120),
        max_restarts=s.int_d("maxRestarts", 3),
        backoff_limit=s.int_("backoffLimit"),
        rdzv_conf=s.str_map("rdzvConf"),
        env=s.str_map("env"),
        hpa_metrics=metrics,
        shm_size=None if shm is None else str(shm),
    )
    s.done()
    return spec


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and parse a job spec file.

    Raises:
        SpecError: the file is unreadable, not YAML, or not a valid spec.
    """
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{path}: cannot read job spec ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({exc})".replace("\n", " ")) from exc
    try:
        return parse_job_spec(data)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from exc
