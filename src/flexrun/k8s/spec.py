"""flexrun's own Kubernetes job spec: the data ``flexrun k8s render`` turns into manifests.

Owns the whole job's schema (:class:`JobSpec`: fields, defaults, the checks that span
blocks) and its parsing from a YAML mapping through the shared reader
(:mod:`flexrun._spec`); the nested blocks are in ``spec_types.py``. Every error is a
:class:`~flexrun.errors.SpecError` whose message starts with the dotted field path
(``spec.nnodes: min 4 > max 2``). It does not know what the manifests look like
(``render.py``, ``trainjob.py``) nor how manifests are checked (``validate.py``).

The file format::

    apiVersion: flexrun.dev/v1alpha1
    kind: TrainingJob
    metadata: {name: resnet, namespace: ml}
    spec:
      target: pytorchjob          # or trainjob (Kubeflow Trainer v2: TrainJob + runtime)
      trainJob: {runtimeKind: TrainingRuntime}   # or ClusterTrainingRuntime
      image: registry.example.com/resnet-train:1.0
      script: train.py            # or module: pkg.train
      args: [--epochs, "90"]
      nnodes: "2:8"               # MIN:MAX, or one number for a fixed size
      nprocPerNode: 8             # int | auto | cpu | gpu (default: resources.gpu or auto)
      replicas: 8                 # pods created at first (TrainJob: numNodes; default: max)
      resources: {cpu: "30", memory: 200Gi, gpu: 8}
      checkpoint: {mountPath: /checkpoints, size: 500Gi, storageClass: nfs}
      # or an object store (no PVC; FLEXRUN_CHECKPOINT_DIR is the URL, the options go to
      # FLEXRUN_CHECKPOINT_STORAGE_OPTIONS as JSON; never a credential in either):
      # checkpoint:
      #   url: s3://ml-checkpoints/resnet
      #   storageOptions: {endpoint_url: "http://minio.storage:9000",
      #                    client_kwargs: {region_name: eu-west-1}}
      serviceAccountName: resnet-train   # the pods' identity (IRSA / workload identity)
      envFrom: [{secretRef: {name: s3-credentials}}]   # AWS_* etc. from a Secret, by name
      store: {type: tcp}          # tcp | etcd (TLS; existingSecret: certs from a Secret)
      jobSecret: {existingSecret: my-secret}     # default: render <name>-secret, no data
      networkPolicy: true         # only the job's pods reach the store / etcd
      metrics: {port: 9400}       # Prometheus endpoint on every worker pod (off if unset)
      spot:
        nodeSelector: {cloud.google.com/gke-spot: "true"}
        tolerations: [{key: cloud.google.com/gke-spot, value: "true", effect: NoSchedule}]
      scheduling: {priorityClassName: high, onePodPerNode: true, kueue: {queueName: q}}
      network: {hostNetwork: true, rdma: {resource: rdma/hca}}  # docs/user/k8s-scheduling.md
      gracePeriodSeconds: 30      # within the spot pool's reclaim notice
      maxRestarts: 3
      backoffLimit: 50
      env: {NCCL_DEBUG: WARN}
      hpa: {metrics: [...]}       # autoscaling/v2 MetricSpec list (pytorchjob only)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun._spec import SpecReader, fail, load_yaml
from flexrun.errors import SpecError
from flexrun.k8s.spec_placement import (
    NetworkSpec,
    RunDirSpec,
    SchedulingSpec,
    check_node_selectors,
    check_run_dir,
    parse_network,
    parse_run_dir,
    parse_scheduling,
)
from flexrun.k8s.spec_types import (
    API_VERSION,
    ENV_NAME,
    KIND,
    MAX_NAME_LEN,
    METRIC_TYPES,
    MIN_GRACE_PERIOD_S,
    MODULE,
    NPROC_WORDS,
    OPERATOR_ENV,
    RENDER_ENV,
    TARGET_PYTORCHJOB,
    TARGET_TRAINJOB,
    TARGETS,
    CheckpointVolume,
    NodeRange,
    Resources,
    SpotSpec,
    StoreSpec,
    Toleration,
    TrainJobOptions,
    check_quantity,
    check_secret_name,
    parse_checkpoint,
    parse_hpa,
    parse_nproc,
    parse_resources,
    parse_spot,
    parse_store,
)
from flexrun.k8s.spec_types import DNS1035 as _DNS1035
from flexrun.k8s.spec_types import DNS1123 as _DNS1123

_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_ENV_FROM_KINDS = ("secretRef", "configMapRef")
#: Credential variables an object store reads: only ever by reference (``spec.envFrom``).
_CREDENTIAL_ENV = frozenset(
    {
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AZURE_STORAGE_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_CLIENT_SECRET",
    }
)
_SECRET_CONF = frozenset({"secret", "password", "token"})
_ETCD_TLS_CONF = frozenset({"cacert", "cert", "key", "tls"})
#: JobSet names a trainer pod ``<trainjob>-node-0-<index>-<5 random>``; it must fit 63.
_JOBSET_POD_SUFFIX = len("-node-0-") + len("-abcde")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """A whole flexrun training job on Kubernetes."""

    name: str
    """``metadata.name``: the job's name, prefix of every object, the rendezvous id."""
    namespace: str | None = None
    """``metadata.namespace`` of every object (kubectl's current namespace if unset)."""
    target: str = TARGET_PYTORCHJOB
    """``pytorchjob`` (Kubeflow v1, elastic; the default) or ``trainjob`` (Trainer v2)."""
    trainjob: TrainJobOptions = field(default_factory=TrainJobOptions)
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
    """Worker pods requested at first (a TrainJob's fixed ``numNodes``); the job trains
    once ``nnodes.min`` have joined."""
    resources: Resources = field(default_factory=Resources)
    checkpoint: CheckpointVolume | None = None
    store: StoreSpec = field(default_factory=StoreSpec)
    spot: SpotSpec = field(default_factory=SpotSpec)
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    network: NetworkSpec = field(default_factory=NetworkSpec)
    run_dir: RunDirSpec | None = None
    """Run directories on a durable volume (``spec.runDir``); None: in the pod, lost with it."""
    existing_job_secret: str | None = None
    """A Secret (key ``secret``) to mount instead of rendering the empty ``<name>-secret``."""
    network_policy: bool = True
    """Render NetworkPolicies that admit only this job's pods to the store (and etcd)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port of every worker pod (``--metrics-host 0.0.0.0``)."""
    grace_period_s: int = 120
    """``terminationGracePeriodSeconds``: SIGTERM to SIGKILL, the final checkpoint's budget."""
    max_restarts: int = 3
    """In-pod restarts by the agent (``--max-restarts``; v1: ``elasticPolicy.maxRestarts``)."""
    backoff_limit: int | None = None
    """Pod re-creations before the job fails (unlimited if unset)."""
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    """Extra rendezvous settings (``--rdzv-conf``; v1: ``elasticPolicy.rdzvConf``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for the worker container."""
    env_from: tuple[Mapping[str, Any], ...] = ()
    """``envFrom`` sources of the worker container (``{secretRef: {name}}`` or
    ``{configMapRef: {name}}``, optional ``prefix``): credentials by reference, so no
    secret value is ever in a manifest."""
    service_account: str | None = None
    """``serviceAccountName`` of the worker pods: the identity an object-store checkpoint
    authenticates with (IRSA, GKE workload identity)."""
    hpa_metrics: tuple[Mapping[str, Any], ...] = ()
    """autoscaling/v2 MetricSpecs; when set the v1 operator creates an HPA for the Workers."""
    shm_size: str | None = "2Gi"
    """Size of the in-memory ``/dev/shm`` (DataLoader workers need more than 64Mi)."""

    def __post_init__(self) -> None:
        if len(self.name) > MAX_NAME_LEN or not _DNS1035.match(self.name):
            raise fail(
                "metadata.name",
                f"{self.name!r} must be a DNS-1035 label (lowercase letters, digits, '-', "
                f"starting with a letter) of at most {MAX_NAME_LEN} characters",
            )
        if self.namespace is not None and not _DNS1123.match(self.namespace):
            raise fail("metadata.namespace", f"{self.namespace!r} is not a valid namespace")
        if self.target not in TARGETS:
            raise fail("spec.target", f"{self.target!r} not one of {', '.join(TARGETS)}")
        if not self.image.strip():
            raise fail("spec.image", "must not be empty")
        if (self.script is None) == (self.module is None):
            raise fail("spec.script", "set exactly one of script and module")
        if self.module is not None and not MODULE.match(self.module):
            raise fail("spec.module", f"{self.module!r} is not a dotted module name")
        self._check_nproc()
        if not self.nnodes.min <= self.replicas <= self.nnodes.max:
            raise fail(
                "spec.replicas",
                f"{self.replicas} outside nnodes {self.nnodes.min}:{self.nnodes.max}",
            )
        if self.grace_period_s < MIN_GRACE_PERIOD_S:
            raise fail(
                "spec.gracePeriodSeconds",
                f"{self.grace_period_s} leaves no time for a final checkpoint; use >= {MIN_GRACE_PERIOD_S}",
            )
        if self.max_restarts < 0:
            raise fail("spec.maxRestarts", f"must be >= 0 (got {self.max_restarts})")
        if self.backoff_limit is not None and not 0 <= self.backoff_limit < 2**31:
            raise fail("spec.backoffLimit", f"must be >= 0 (got {self.backoff_limit})")
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise fail("spec.metrics.port", f"must be 1..65535 (got {self.metrics_port})")
        check_secret_name("spec.jobSecret.existingSecret", self.existing_job_secret)
        self._check_env()
        self._check_rdzv_conf()
        if self.shm_size is not None:
            check_quantity("spec.shmSize", self.shm_size)
        if self.service_account is not None and (
            len(self.service_account) > 253 or not _DNS1123_SUBDOMAIN.match(self.service_account)
        ):
            raise fail("spec.serviceAccountName", f"{self.service_account!r} is not a valid name")
        if (
            self.checkpoint is not None
            and self.checkpoint.has_volume
            and self.checkpoint.existing_claim is None
            and self.checkpoint.access_mode in ("ReadWriteOnce", "ReadWriteOncePod")
            and self.nnodes.max > 1
        ):
            raise fail(
                "spec.checkpoint.accessMode",
                f"{self.checkpoint.access_mode} cannot be mounted by {self.nnodes.max} pods on "
                "different nodes; use ReadWriteMany",
            )
        for i, metric in enumerate(self.hpa_metrics):
            if metric.get("type") not in METRIC_TYPES:
                raise fail(
                    f"spec.hpa.metrics[{i}].type",
                    f"{metric.get('type')!r} not one of {', '.join(METRIC_TYPES)}",
                )
        check_node_selectors(self.spot.node_selector, self.scheduling.node_selector)
        if self.run_dir is not None:
            check_run_dir(self.run_dir, self.env, self.checkpoint)
        if self.target == TARGET_TRAINJOB:
            self._check_trainjob()

    def _check_env(self) -> None:
        for key, _ in self.env:
            if not ENV_NAME.match(key):
                raise fail(f"spec.env.{key}", "is not a valid environment variable name")
            if key in RENDER_ENV:
                raise fail(f"spec.env.{key}", "is set by flexrun k8s render; remove it")
            if key in _CREDENTIAL_ENV:
                raise fail(
                    f"spec.env.{key}",
                    "a credential does not belong in a manifest; take it from a Secret "
                    "(spec.envFrom: [{secretRef: {name: ...}}]) or the pod's identity "
                    "(spec.serviceAccountName)",
                )
            if key in OPERATOR_ENV:
                raise fail(
                    f"spec.env.{key}",
                    "is injected by the Kubeflow operator from the job's fields; remove it",
                )

    def _check_rdzv_conf(self) -> None:
        for key, _ in self.rdzv_conf:
            where = f"spec.rdzvConf.{key}"
            if key in _SECRET_CONF:
                raise fail(
                    where,
                    "a secret value does not belong in a manifest (it would show in `ps` and "
                    "in the cluster's API); the job Secret is mounted for you (spec.jobSecret)",
                )
            if self.store.type == "etcd" and key in _ETCD_TLS_CONF:
                raise fail(where, "is set by flexrun k8s render (etcd's TLS files); remove it")

    def _check_trainjob(self) -> None:
        if self.hpa_metrics:
            raise fail(
                "spec.hpa",
                "only with target pytorchjob: a TrainJob's numNodes is fixed (Trainer v2 has "
                "no elastic policy); set replicas instead",
            )
        longest = len(self.name) + _JOBSET_POD_SUFFIX + len(str(self.replicas - 1))
        if longest > 63:
            raise fail(
                "metadata.name",
                f"{self.name!r} is too long for a TrainJob: JobSet names its pods "
                f"'{self.name}-node-0-<index>-xxxxx', which must fit 63 characters "
                f"(use at most {len(self.name) - (longest - 63)})",
            )

    def _check_nproc(self) -> None:
        nproc = self.nproc_per_node
        if nproc in NPROC_WORDS:
            if nproc == "gpu" and self.resources.gpu == 0:
                raise fail("spec.nprocPerNode", "gpu needs spec.resources.gpu > 0")
            return
        if not nproc.isdigit() or int(nproc) < 1:
            raise fail("spec.nprocPerNode", f"{nproc!r} is not a positive number or auto/cpu/gpu")
        if self.resources.gpu and int(nproc) > self.resources.gpu:
            raise fail(
                "spec.nprocPerNode",
                f"{nproc} processes but only {self.resources.gpu} GPUs per pod (spec.resources.gpu)",
            )

    @property
    def rdzv_backend(self) -> str:
        """The ``--rdzv-backend`` the workers use for this store."""
        return "etcd-v3" if self.store.type == "etcd" else "c10d"

    @property
    def job_secret_name(self) -> str:
        """The Secret whose key ``secret`` authenticates the job's store records."""
        return self.existing_job_secret or f"{self.name}-secret"

    @property
    def etcd_secret_name(self) -> str:
        """The Secret with etcd's CA, certificate and key (etcd store only)."""
        return self.store.existing_secret or f"{self.name}-etcd"


# ---------------------------------------------------------------------------------------
# Parsing: YAML mapping -> JobSpec. Each reader checks type and unknown keys at its path.


def _parse_nnodes(value: object) -> NodeRange:
    if isinstance(value, bool):
        raise fail("spec.nnodes", f"must be N or MIN:MAX (got {value!r})")
    if isinstance(value, int):
        return NodeRange(min=value, max=value)
    if isinstance(value, str):
        parts = value.split(":")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            lo, hi = int(parts[0]), int(parts[-1])
            return NodeRange(min=lo, max=hi)
    raise fail("spec.nnodes", f"must be N or MIN:MAX (got {value!r})")


def _parse_env_from(s: SpecReader) -> tuple[Mapping[str, Any], ...]:
    out: list[Mapping[str, Any]] = []
    for i, item in enumerate(s.list_("envFrom")):
        r = SpecReader(item, f"spec.envFrom[{i}]")
        kinds = [k for k in _ENV_FROM_KINDS if r.has(k)]
        if len(kinds) != 1:
            raise fail(r.path, "set exactly one of secretRef and configMapRef")
        ref = r.sub(kinds[0])
        assert ref is not None
        name = ref.req_str("name")
        if len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
            raise fail(ref.at("name"), f"{name!r} is not a valid name")
        ref.done()
        source: dict[str, Any] = {kinds[0]: {"name": name}}
        if (prefix := r.str_("prefix")) is not None:
            if not ENV_NAME.match(prefix):
                raise fail(r.at("prefix"), f"{prefix!r} is not a valid variable name prefix")
            source["prefix"] = prefix
        r.done()
        out.append(source)
    return tuple(out)


def _override(in_file: str, from_cli: str | None) -> str:
    # The file's value is read (and type-checked) even when the command line overrides it.
    return in_file if from_cli is None else from_cli


def _parse_one_key(s: SpecReader, key: str, inner: str, kind: str = "str") -> Any:
    r = s.sub(key)
    if r is None:
        return None
    value = r.int_(inner) if kind == "int" else r.str_(inner)
    r.done()
    if value is None:
        raise fail(r.at(inner), "is required")
    return value


def parse_job_spec(
    data: object, *, target: str | None = None, runtime_kind: str | None = None
) -> JobSpec:
    """Build a :class:`JobSpec` from a parsed YAML document.

    ``target`` / ``runtime_kind`` (the CLI's ``--target`` / ``--runtime-kind``) override
    ``spec.target`` / ``spec.trainJob.runtimeKind``.

    Raises:
        SpecError: a missing, mistyped, unknown or inconsistent field (the message names it).
    """
    top = SpecReader(data, "")
    api_version = top.str_("apiVersion", API_VERSION)
    if api_version != API_VERSION:
        raise fail("apiVersion", f"{api_version!r} is not {API_VERSION}")
    kind = top.str_("kind", KIND)
    if kind != KIND:
        raise fail("kind", f"{kind!r} is not {KIND}")
    meta = top.sub("metadata")
    if meta is None:
        raise fail("metadata.name", "is required")
    name = meta.req_str("name")
    namespace = meta.str_("namespace")
    meta.done()
    s = top.sub("spec")
    if s is None:
        raise fail("spec", "is required")
    top.done()

    nnodes_raw = s.raw("nnodes")
    if nnodes_raw is None:
        raise fail("spec.nnodes", "is required (N or MIN:MAX)")
    nnodes = _parse_nnodes(nnodes_raw)
    resources = parse_resources(s)
    kind_in_file = "TrainingRuntime"
    if (tr := s.sub("trainJob")) is not None:
        kind_in_file = tr.str_("runtimeKind", "TrainingRuntime")
        tr.done()
    trainjob = TrainJobOptions(runtime_kind=_override(kind_in_file, runtime_kind))

    args = s.list_("args")
    for i, a in enumerate(args):
        if isinstance(a, Mapping | list) or a is None:
            raise fail(f"spec.args[{i}]", f"must be a string (got {a!r})")
    shm = s.raw("shmSize") if s.has("shmSize") else "2Gi"

    spec = JobSpec(
        name=name,
        namespace=namespace,
        target=_override(s.str_("target", TARGET_PYTORCHJOB), target),
        trainjob=trainjob,
        image=s.req_str("image"),
        script=s.str_("script"),
        module=s.str_("module"),
        args=tuple(str(a) for a in args),
        nnodes=nnodes,
        nproc_per_node=parse_nproc(s, resources),
        replicas=s.int_("replicas", nnodes.max),
        resources=resources,
        checkpoint=parse_checkpoint(s),
        store=parse_store(s),
        spot=parse_spot(s),
        scheduling=parse_scheduling(s),
        network=parse_network(s),
        run_dir=parse_run_dir(s),
        existing_job_secret=_parse_one_key(s, "jobSecret", "existingSecret"),
        network_policy=s.bool_("networkPolicy", True),
        metrics_port=_parse_one_key(s, "metrics", "port", "int"),
        grace_period_s=s.int_("gracePeriodSeconds", 120),
        max_restarts=s.int_("maxRestarts", 3),
        backoff_limit=s.int_("backoffLimit"),
        rdzv_conf=s.str_map("rdzvConf"),
        env=s.str_map("env"),
        env_from=_parse_env_from(s),
        service_account=s.str_("serviceAccountName"),
        hpa_metrics=parse_hpa(s),
        shm_size=None if shm is None else str(shm),
    )
    s.done()
    return spec


def load_job_spec(
    path: str | Path, *, target: str | None = None, runtime_kind: str | None = None
) -> JobSpec:
    """Read and parse a job spec file (see :func:`parse_job_spec` for the overrides).

    Raises:
        SpecError: the file is unreadable, binary, not UTF-8, not YAML, or not a valid spec.
    """
    data = load_yaml(path, "job spec")
    try:
        return parse_job_spec(data, target=target, runtime_kind=runtime_kind)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from exc


__all__ = [
    "API_VERSION",
    "KIND",
    "OPERATOR_ENV",
    "RENDER_ENV",
    "CheckpointVolume",
    "JobSpec",
    "NodeRange",
    "Resources",
    "SpotSpec",
    "StoreSpec",
    "Toleration",
    "TrainJobOptions",
    "load_job_spec",
    "parse_job_spec",
]
