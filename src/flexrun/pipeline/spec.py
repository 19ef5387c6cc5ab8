"""The pipeline spec (``pipeline.yaml``): stages, their commands, files and dependencies.

Owns the file format, its parsing and its validation: a DAG whose every stage is known,
with no cycle, no output produced twice, and no stage reading a file that a stage it
does not depend on produces. Every error is a :class:`~flexrun.errors.SpecError` whose
message names the stage and field. It does not run anything (``runner``) nor know Argo
(``argo``); whether an external input exists is checked by the runner, on the machine
that runs it.

The file format::

    name: digits                       # DNS-1035 label: names the Argo Workflow and jobs
    pipelineDir: .                     # where {pipeline_dir} points (default: this file's dir)
    env: {PYTHONHASHSEED: "0"}         # every stage's environment
    argo:                              # only for `flexrun pipeline render --target argo`
      image: registry.example.com/digits:1.0
      pipelineDir: /app/examples/pipeline
      artifacts: {claimName: digits-artifacts, mountPath: /work}
    stages:
      - name: preprocess
        command: "{python} {pipeline_dir}/preprocess.py --out data"   # or a list
        inputs: ["{pipeline_dir}/preprocess.py"]
        outputs: [data]
      - name: train
        deps: [preprocess]             # plus, implicitly, the producers of its inputs
        inputs: [data]
        outputs: [model]
        train:                         # instead of command: `flexrun run` options
          script: "{pipeline_dir}/train.py"
          args: [--data, data, --ckpt-dir, ckpt]
          nprocPerNode: 2
          nnodes: "1:4"                # local runs are one node (standalone)
          maxRestarts: 3
          checkpointDir: ckpt          # kept across retries/resumes, wiped when inputs change
          # or, instead of checkpointDir, an object store (never wiped by the runner):
          # checkpointUrl: s3://ml-checkpoints/digits
          # storageOptions: {endpoint_url: "http://minio:9000"}   # no credentials
          k8s: {resources: {cpu: "4"}} # extra fields of the flexrun k8s job spec
        retries: 1
        timeout: 1800                  # seconds, per attempt
        env: {OMP_NUM_THREADS: "1"}

Paths in ``outputs`` and ``checkpointDir`` (what the runner writes, and may remove) are
relative to the run directory and must stay strictly below it: absolute paths, ``..``,
``.`` are refused here (``paths.check_relative``), and symlinks out of it before a run
(``paths.resolve_below``). A ``checkpointUrl`` (any fsspec URL, no credential in it) and
its ``storageOptions`` (checked by ``flexrun.storage_options.check_no_secrets``) reach the
stage as ``FLEXRUN_CHECKPOINT_DIR`` and ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS`` (JSON);
nothing under a URL is ever removed. Relative ``inputs`` must stay below it too; an absolute input
(or one under ``{pipeline_dir}``) names outside data, which is only ever read.
Placeholders: ``{python}`` (this interpreter locally, ``python`` in a container),
``{pipeline_dir}`` and ``{run_dir}``. Parsing goes through the shared reader
(:mod:`flexrun._spec`), as the k8s job spec's does.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrun._spec import SpecReader, load_yaml
from flexrun.errors import SpecError
from flexrun.pipeline.paths import check_relative
from flexrun.storage_options import (
    CHECKPOINT_DIR_ENV,
    STORAGE_OPTIONS_ENV,
    check_url,
    spec_storage_options,
)

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
PLACEHOLDERS = ("python", "pipeline_dir", "run_dir")
DEFAULT_TIMEOUT_S = 3600.0
# Room for the "-store" suffix k8s render adds to the job name: 63 - len("-etcd-peers").
_MAX_NAME_LEN = 40


def _fail(where: str, message: str) -> SpecError:
    return SpecError(f"{where}: {message}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """A stage that runs ``flexrun run`` (locally) or a PyTorchJob (on Argo)."""

    script: str
    """Training script (placeholders allowed)."""
    args: tuple[str, ...] = ()
    """Arguments of the script (placeholders allowed)."""
    nproc_per_node: str = "1"
    """Workers per node: N, auto, cpu or gpu."""
    nnodes: str = "1"
    """N or MIN:MAX for the cluster; a local run is always one standalone node."""
    max_restarts: int = 3
    """Failures the elastic agent tolerates before the stage fails."""
    checkpoint_dir: str | None = None
    """Run-dir-relative checkpoint directory: kept across resumes, wiped when the stage's
    inputs or command change (a checkpoint of other data must not be resumed)."""
    checkpoint_url: str | None = None
    """An fsspec URL for checkpoints (``s3://bucket/prefix``) instead of ``checkpoint_dir``:
    exported as ``FLEXRUN_CHECKPOINT_DIR``; the runner never removes anything under it."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec ``storage_options`` of ``checkpoint_url`` (no credential), exported as JSON in
    ``FLEXRUN_CHECKPOINT_STORAGE_OPTIONS``."""
    k8s: Mapping[str, Any] = field(default_factory=dict)
    """Extra fields of the flexrun k8s job spec (resources, spot, store, ...) for Argo."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One node of the pipeline graph."""

    name: str
    command: tuple[str, ...] | None = None
    """argv of the stage (placeholders allowed); exactly one of command and train."""
    train: TrainSpec | None = None
    inputs: tuple[str, ...] = ()
    """Files/directories read (run-dir relative); their content is part of the cache key."""
    outputs: tuple[str, ...] = ()
    """Files/directories written; must exist after success; hashed into the state file."""
    deps: tuple[str, ...] = ()
    """Stages that must succeed first: the declared ones plus the producers of inputs."""
    retries: int = 0
    """Extra attempts after a failure (not after an interrupt)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds one attempt may run before it is stopped and counted as failed."""
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        where = f"stages.{self.name}"
        if (self.command is None) == (self.train is None):
            raise _fail(where, "set exactly one of command and train")
        if self.command is not None and not self.command:
            raise _fail(f"{where}.command", "must not be empty")
        if self.retries < 0:
            raise _fail(f"{where}.retries", f"must be >= 0 (got {self.retries})")
        if not self.timeout_s > 0:
            raise _fail(f"{where}.timeout", f"must be > 0 seconds (got {self.timeout_s})")
        if self.train is not None and self.train.checkpoint_url is not None:
            for key, _ in self.env:
                if key in (CHECKPOINT_DIR_ENV, STORAGE_OPTIONS_ENV):
                    raise _fail(f"{where}.env.{key}", "is set from train.checkpointUrl")


@dataclass(frozen=True, kw_only=True, slots=True)
class ArgoSpec:
    """Cluster-side settings, used only by the Argo renderer."""

    image: str | None = None
    """Image holding flexrun, the stage scripts and their dependencies."""
    pipeline_dir: str = "/app"
    """Where ``{pipeline_dir}`` is inside the image."""
    claim_name: str | None = None
    """Existing ReadWriteMany PVC shared by every step (default ``<name>-artifacts``)."""
    mount_path: str = "/work"
    """Where the artifacts volume is mounted; the steps' working directory and ``{run_dir}``."""
    namespace: str | None = None
    service_account: str | None = None
    """Service account of the workflow: it must be allowed to create PyTorchJobs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pipeline:
    """A validated pipeline: stages in a topological order."""

    name: str
    stages: tuple[Stage, ...]
    """In dependency order (each stage after all of its deps), ties in file order."""
    env: tuple[tuple[str, str], ...] = ()
    pipeline_dir: Path = Path(".")
    """Absolute directory that ``{pipeline_dir}`` means locally."""
    argo: ArgoSpec = field(default_factory=ArgoSpec)
    source: str = "<pipeline>"

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def downstream(self, name: str) -> list[str]:
        """Stages that depend on ``name``, directly or not, in order."""
        hit = {name}
        out = []
        for s in self.stages:
            if any(d in hit for d in s.deps):
                hit.add(s.name)
                out.append(s.name)
        return out


def substitute(text: str, values: Mapping[str, str], where: str) -> str:
    """Replace ``{python}``, ``{pipeline_dir}``, ``{run_dir}``; others are an error.

    Raises:
        SpecError: an unknown placeholder.
    """

    def repl(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            raise _fail(where, f"unknown placeholder {{{key}}} (known: {', '.join(PLACEHOLDERS)})")
        return values[key]

    return _PLACEHOLDER.sub(repl, text)


# -- parsing --------------------------------------------------------------------------


def _env(r: SpecReader, key: str) -> tuple[tuple[str, str], ...]:
    return r.str_map(key, key_pattern=_ENV_NAME, what="environment variable name")


def _parse_command(r: SpecReader, key: str) -> tuple[str, ...] | None:
    value = r.raw(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise _fail(r.at(key), f"cannot be split into arguments ({exc})") from exc
    return r.str_list(key)


def _storage_options(r: SpecReader) -> dict[str, Any]:
    raw = r.raw("storageOptions")
    if raw is None:
        return {}
    if r.raw("checkpointUrl") is None:
        raise _fail(r.at("storageOptions"), "only with checkpointUrl (an object store)")
    return spec_storage_options(raw, r.at("storageOptions"), error=SpecError)


def _parse_train(r: SpecReader) -> TrainSpec:
    script = r.scalar("script")
    if script is None:
        raise _fail(r.at("script"), "is required")
    k8s = r.raw("k8s")
    if k8s is not None and not isinstance(k8s, Mapping):
        raise _fail(r.at("k8s"), f"must be a mapping (got {type(k8s).__name__})")
    nnodes = r.scalar("nnodes", "1")
    if not re.match(r"^\d+(:\d+)?$", nnodes):
        raise _fail(r.at("nnodes"), f"must be N or MIN:MAX (got {nnodes!r})")
    spec = TrainSpec(
        script=script,
        args=r.str_list("args"),
        nproc_per_node=r.scalar("nprocPerNode", "1"),
        nnodes=nnodes,
        max_restarts=r.int_("maxRestarts", 3),
        checkpoint_dir=r.scalar("checkpointDir"),
        checkpoint_url=r.scalar("checkpointUrl"),
        storage_options=_storage_options(r),
        k8s=dict(k8s or {}),
    )
    r.done()
    if spec.checkpoint_url is not None:
        if spec.checkpoint_dir is not None:
            raise _fail(r.at("checkpointUrl"), "set checkpointDir or checkpointUrl, not both")
        check_url(spec.checkpoint_url, r.at("checkpointUrl"), error=SpecError)
    if spec.max_restarts < 0:
        raise _fail(r.at("maxRestarts"), f"must be >= 0 (got {spec.max_restarts})")
    if spec.checkpoint_dir is not None:
        check_relative(spec.checkpoint_dir, r.at("checkpointDir"))
    return spec


def _parse_stage(value: object, index: int) -> Stage:
    r = SpecReader(value, f"stages[{index}]")
    name = r.scalar("name")
    if name is None:
        raise _fail(r.at("name"), "is required")
    if not _NAME.match(name):
        raise _fail(
            r.at("name"),
            f"{name!r} must be lowercase letters, digits and '-', starting with a letter",
        )
    r.path = f"stages.{name}"
    train_r = r.sub("train")
    stage = Stage(
        name=name,
        command=_parse_command(r, "command"),
        train=None if train_r is None else _parse_train(train_r),
        inputs=r.str_list("inputs"),
        outputs=r.str_list("outputs"),
        deps=r.str_list("deps"),
        retries=r.int_("retries", 0),
        timeout_s=r.num("timeout", DEFAULT_TIMEOUT_S),
        env=_env(r, "env"),
    )
    r.done()
    _check_placeholders(stage)
    for i, out in enumerate(stage.outputs):
        if "{" in out:
            raise _fail(f"stages.{name}.outputs[{i}]", "outputs are run-dir paths, no placeholders")
        check_relative(out, f"stages.{name}.outputs[{i}]")
    for i, inp in enumerate(stage.inputs):
        if not inp.startswith("{") and not Path(inp).is_absolute() and ".." in Path(inp).parts:
            raise _fail(
                f"stages.{name}.inputs[{i}]",
                f"{inp!r} must stay inside the run directory (no '..'); name data outside "
                "it by an absolute path (inputs are only read)",
            )
    return stage


def _check_placeholders(stage: Stage) -> None:
    # Fail at load time (run and render alike), not when the stage is about to start.
    dummy = dict.fromkeys(PLACEHOLDERS, "")
    where = f"stages.{stage.name}"
    fields: list[tuple[str, tuple[str, ...]]] = [
        ("command", stage.command or ()),
        ("inputs", stage.inputs),
        ("env", tuple(v for _, v in stage.env)),
    ]
    if stage.train is not None:
        fields += [("train.script", (stage.train.script,)), ("train.args", stage.train.args)]
    for name, values in fields:
        for v in values:
            substitute(v, dummy, f"{where}.{name}")


def _parse_argo(r: SpecReader | None) -> ArgoSpec:
    if r is None:
        return ArgoSpec()
    artifacts = r.sub("artifacts")
    claim, mount = None, "/work"
    if artifacts is not None:
        claim = artifacts.scalar("claimName")
        mount = artifacts.scalar("mountPath", "/work")
        artifacts.done()
        if not mount.startswith("/"):
            raise _fail(artifacts.at("mountPath"), f"must be absolute (got {mount!r})")
    spec = ArgoSpec(
        image=r.scalar("image"),
        pipeline_dir=r.scalar("pipelineDir", "/app"),
        claim_name=claim,
        mount_path=mount,
        namespace=r.scalar("namespace"),
        service_account=r.scalar("serviceAccountName"),
    )
    r.done()
    return spec


def _normalize(path: str) -> str:
    return Path(path).as_posix().rstrip("/") or "."


def _order(stages: list[Stage], source: str) -> tuple[Stage, ...]:
    """Topological order, file order among ready stages. Raises SpecError on a cycle."""
    by_name = {s.name: s for s in stages}
    done: set[str] = set()
    out: list[Stage] = []
    while len(out) < len(stages):
        ready = [s for s in stages if s.name not in done and set(s.deps) <= done]
        if not ready:
            left = [s.name for s in stages if s.name not in done]
            raise _fail(source, f"dependency cycle: {' -> '.join(_cycle(by_name, left))}")
        for s in ready[:1]:
            done.add(s.name)
            out.append(s)
    return tuple(out)


def _cycle(by_name: Mapping[str, Stage], left: list[str]) -> list[str]:
    # Walk deps from any unfinished stage until a name repeats: that loop is a cycle.
    path: list[str] = []
    node = left[0]
    while node not in path:
        path.append(node)
        node = next(d for d in by_name[node].deps if d in left)
    loop = path[path.index(node) :] + [node]
    return list(reversed(loop))


def parse_pipeline(data: object, *, base_dir: Path, source: str = "<pipeline>") -> Pipeline:
    """Build a validated :class:`Pipeline` from a parsed YAML document.

    ``base_dir`` is the directory relative ``pipelineDir`` values are resolved against.

    Raises:
        SpecError: a missing, mistyped or unknown field, an unknown dependency, a cycle,
            an output produced twice, or an input produced by a stage that is not upstream.
    """
    top = SpecReader(data, "", name="pipeline")
    name = top.scalar("name")
    if name is None:
        raise _fail("name", "is required")
    if not _NAME.match(name) or len(name) > _MAX_NAME_LEN:
        raise _fail(
            "name",
            f"{name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting "
            f"with a letter) of at most {_MAX_NAME_LEN} characters",
        )
    pdir = Path(top.scalar("pipelineDir", "."))
    pipeline_dir = (pdir if pdir.is_absolute() else base_dir / pdir).resolve()
    env = _env(top, "env")
    argo = _parse_argo(top.sub("argo"))
    raw_stages = top.raw("stages")
    top.done()
    if not isinstance(raw_stages, list) or not raw_stages:
        raise _fail("stages", "must be a non-empty list of stages")
    stages = [_parse_stage(v, i) for i, v in enumerate(raw_stages)]

    names: set[str] = set()
    for s in stages:
        if s.name in names:
            raise _fail(f"stages.{s.name}", "duplicate stage name")
        names.add(s.name)
    for s in stages:
        for d in s.deps:
            if d not in names:
                raise _fail(f"stages.{s.name}.deps", f"unknown stage {d!r}")
            if d == s.name:
                raise _fail(f"stages.{s.name}.deps", "a stage cannot depend on itself")

    producer: dict[str, str] = {}
    for s in stages:
        for out in s.outputs:
            key = _normalize(out)
            if key in producer:
                raise _fail(
                    f"stages.{s.name}.outputs",
                    f"{out!r} is also an output of stage {producer[key]!r}",
                )
            producer[key] = s.name
    # A stage depends on the producers of what it reads, declared or not.
    linked = []
    for s in stages:
        extra = []
        for inp in s.inputs:
            owner = _owner(_normalize(inp), producer)
            if owner == s.name:
                raise _fail(f"stages.{s.name}.inputs", f"{inp!r} is the stage's own output")
            if owner is not None and owner not in s.deps and owner not in extra:
                extra.append(owner)
        linked.append(_with_deps(s, s.deps + tuple(extra)))
    ordered = _order(linked, source)
    return Pipeline(
        name=name,
        stages=ordered,
        env=env,
        pipeline_dir=pipeline_dir,
        argo=argo,
        source=source,
    )


def _owner(path: str, producer: Mapping[str, str]) -> str | None:
    # An input inside a produced directory (data/train.pt of output data) belongs to it.
    p = Path(path)
    for candidate in (p, *p.parents):
        owner = producer.get(candidate.as_posix())
        if owner is not None:
            return owner
    return None


def _with_deps(s: Stage, deps: tuple[str, ...]) -> Stage:
    return Stage(
        name=s.name,
        command=s.command,
        train=s.train,
        inputs=s.inputs,
        outputs=s.outputs,
        deps=deps,
        retries=s.retries,
        timeout_s=s.timeout_s,
        env=s.env,
    )


def load_pipeline(path: str | Path) -> Pipeline:
    """Read, parse and validate a pipeline file.

    Raises:
        SpecError: unreadable, not YAML, or invalid (the message names the file and field).
    """
    p = Path(path)
    data = load_yaml(p, "pipeline spec")
    try:
        return parse_pipeline(data, base_dir=p.resolve().parent, source=str(path))
    except SpecError as exc:
        msg = str(exc)
        raise SpecError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
