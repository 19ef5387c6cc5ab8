"""Trainer v2 checks: TrainJob and (Cluster)TrainingRuntime against v2.3.0, and across them.

Owns ``flexrun k8s validate``'s verdict on Kubeflow Trainer objects:

1. each object against its CRD's ``openAPIV3Schema`` (shipped, ``_trainer_schema``),
   closed against unknown fields, with the CRDs' creation-time CEL rules;
2. the rules only the controllers enforce, which a render relies on: the runtime a TrainJob
   references is in the same set (or declared installed); the runtime has ``mlPolicy.torch``
   and a trainer replicated job with a container named ``node``; ``numNodes`` is within
   the ``--nnodes MIN:MAX`` of a ``flexrun run`` command; no torchrun-reserved ``PET_*`` in
   ``trainer.env``; JobSet's webhook rules (failure policy rule names, reasons and
   targets; pod names within 63 characters); and the batch/v1 Job rules JobSet meets only
   when it creates the child Job (a pod failure policy needs ``restartPolicy: Never``,
   sorted unique exit codes without 0 under ``In``, ``podReplacementPolicy: Failed``; a
   success policy needs ``completionMode: Indexed``).

It does not check core objects (``core_checks``) and renders nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flexrun.k8s import _trainer_schema
from flexrun.k8s.problems import Problem, schema_problems

API_GROUP = "trainer.kubeflow.org"
RUNTIME_KINDS = ("TrainingRuntime", "ClusterTrainingRuntime")
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
NODE = "node"
#: torchrun's variables the torch plugin refuses in ``trainer.env``.
RESERVED_ENV = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)
_RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)
_POD_FAILURE_ACTIONS = ("FailJob", "FailIndex", "Ignore", "Count")


def _m(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _l(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    """What a TrainJob needs to know about the runtime it references."""

    obj: str
    kind: str
    name: str
    namespace: str | None
    num_nodes: int | None
    """``mlPolicy.numNodes``."""
    node_range: tuple[int, int] | None
    """``--nnodes MIN:MAX`` of the node container's ``flexrun run``, when it has one."""
    job_name: str
    """Name of the trainer replicated job (JobSet puts it in every pod's name)."""
    min_completions_needed: int
    """The largest ``successPolicy`` ``succeededCount`` (needs as many pods)."""


def _namespace(meta: Mapping[str, Any]) -> str | None:
    """``metadata.namespace`` when it is a string (anything else is a schema problem)."""
    ns = meta.get("namespace")
    return ns if isinstance(ns, str) else None


def is_trainer_kind(doc: Mapping[str, Any]) -> bool:
    api = doc.get("apiVersion")
    return doc.get("kind") in _trainer_schema.KINDS or (
        isinstance(api, str) and api.startswith(f"{API_GROUP}/")
    )


def schema_check(obj: str, doc: Mapping[str, Any]) -> list[Problem]:
    """The CRD schema (closed, with CEL rules) of the object's kind."""
    kind = doc.get("kind")
    if kind not in _trainer_schema.KINDS:
        return [
            Problem(
                obj=obj,
                path="kind",
                message=f"{kind!r} is not a Trainer v2.3.0 kind ({', '.join(_trainer_schema.KINDS)})",
            )
        ]
    return schema_problems(obj, _trainer_schema.validator_for(str(kind)), doc)


def _node_range(command: Sequence[Any]) -> tuple[int, int] | None:
    """``--nnodes MIN:MAX`` (or N) of a ``flexrun run`` argv, if it is one and has it."""
    argv = [str(a) for a in command]
    starts = [i for i in range(len(argv) - 1) if argv[i : i + 2] == ["flexrun", "run"]]
    if not starts:
        return None
    rest = argv[starts[0] + 2 :]
    for i, a in enumerate(rest):
        value = rest[i + 1] if a == "--nnodes" and i + 1 < len(rest) else None
        if a.startswith("--nnodes="):
            value = a.split("=", 1)[1]
        if value is not None:
            parts = value.split(":")
            if len(parts) in (1, 2) and all(p.isdigit() for p in parts):
                return int(parts[0]), int(parts[-1])
            return None
    return None


def _exit_code_rule_problems(
    bad: Any, base: str, rule: Mapping[str, Any], names: list[Any]
) -> None:
    codes = rule.get("onExitCodes")
    if codes is None:
        return
    values = _l(_m(codes).get("values"))
    where = f"{base}.onExitCodes"
    if _m(codes).get("operator") not in ("In", "NotIn"):
        bad(f"{where}.operator", f"{_m(codes).get('operator')!r} not one of In, NotIn")
    if not 1 <= len(values) <= 255:
        bad(f"{where}.values", f"{len(values)} values; 1 to 255 allowed")
    if any(not isinstance(v, int) for v in values):
        return
    if values != sorted(set(values)):
        bad(f"{where}.values", "must be sorted ascending, without duplicates")
    if _m(codes).get("operator") == "In" and 0 in values:
        bad(f"{where}.values", "0 cannot be used with In (a success is not a failure)")
    container = _m(codes).get("containerName")
    if container is not None and container not in names:
        bad(f"{where}.containerName", f"no container {container!r} in the pod template")


def _job_template_problems(obj: str, base: str, job: Mapping[str, Any]) -> list[Problem]:
    """batch/v1 Job validation the API server applies when JobSet creates the child Job."""
    out: list[Problem] = []

    def bad(path: str, message: str) -> None:
        out.append(Problem(obj=obj, path=path, message=message))

    spec = _m(job.get("spec"))
    pod = _m(_m(spec.get("template")).get("spec"))
    pod_base = f"{base}.template.spec.template.spec"
    names = [_m(c).get("name") for c in _l(pod.get("containers"))]
    policy = spec.get("podFailurePolicy")
    if policy is not None:
        restart = pod.get("restartPolicy")
        if restart != "Never":
            bad(
                f"{pod_base}.restartPolicy",
                f"{restart or 'unset (JobSet defaults it to OnFailure)'}: a podFailurePolicy "
                "needs restartPolicy Never",
            )
        replacement = spec.get("podReplacementPolicy")
        if replacement not in (None, "Failed"):
            bad(
                f"{base}.template.spec.podReplacementPolicy",
                "must be Failed with a podFailurePolicy",
            )
        rules = _l(_m(policy).get("rules"))
        if len(rules) > 20:
            bad(f"{base}.template.spec.podFailurePolicy.rules", f"{len(rules)} rules; at most 20")
        for i, rule in enumerate(rules):
            rb = f"{base}.template.spec.podFailurePolicy.rules[{i}]"
            rule = _m(rule)
            action = rule.get("action")
            if action not in _POD_FAILURE_ACTIONS:
                bad(f"{rb}.action", f"{action!r} not one of {', '.join(_POD_FAILURE_ACTIONS)}")
            if action == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
                bad(f"{rb}.action", "FailIndex needs backoffLimitPerIndex")
            if (rule.get("onExitCodes") is None) == (not rule.get("onPodConditions")):
                bad(rb, "set exactly one of onExitCodes and onPodConditions")
            _exit_code_rule_problems(bad, rb, rule, names)
            for j, cond in enumerate(_l(rule.get("onPodConditions"))):
                if _m(cond).get("status") not in ("True", "False", "Unknown"):
                    bad(f"{rb}.onPodConditions[{j}].status", "required: True, False or Unknown")
    success = spec.get("successPolicy")
    if success is not None and spec.get("completionMode") != "Indexed":
        bad(f"{base}.template.spec.completionMode", "a successPolicy needs completionMode Indexed")
    return out


def _failure_policy_problems(obj: str, spec: Mapping[str, Any], jobs: list[str]) -> list[Problem]:
    """JobSet's webhook rules for ``failurePolicy``."""
    out = []
    rules = _l(_m(spec.get("failurePolicy")).get("rules"))
    seen: set[str] = set()
    for i, rule in enumerate(rules):
        base = f"spec.template.spec.failurePolicy.rules[{i}]"
        name = _m(rule).get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 128 or not _RULE_NAME.match(name):
            out.append(
                Problem(
                    obj=obj,
                    path=f"{base}.name",
                    message=f"{name!r}: a letter, then letters, digits or '_,:' (no '-'), at most 128",
                )
            )
        elif name in seen:
            out.append(
                Problem(obj=obj, path=f"{base}.name", message=f"duplicate rule name {name!r}")
            )
        else:
            seen.add(name)
        for j, reason in enumerate(_l(_m(rule).get("onJobFailureReasons"))):
            if reason not in _JOB_FAILURE_REASONS:
                out.append(
                    Problem(
                        obj=obj,
                        path=f"{base}.onJobFailureReasons[{j}]",
                        message=f"{reason!r} not one of {', '.join(_JOB_FAILURE_REASONS)}",
                    )
                )
        for j, target in enumerate(_l(_m(rule).get("targetReplicatedJobs"))):
            if target not in jobs:
                out.append(
                    Problem(
                        obj=obj,
                        path=f"{base}.targetReplicatedJobs[{j}]",
                        message=f"no replicated job {target!r} (have {', '.join(map(str, jobs))})",
                    )
                )
    return out


def _trainer_job(obj: str, jobs: list[Any]) -> tuple[list[Problem], int | None]:
    """The one replicated job labelled as the trainer's (its index), or the problem."""
    trainers = [
        i
        for i, j in enumerate(jobs)
        if _m(_m(_m(_m(j).get("template")).get("metadata")).get("labels")).get(ANCESTOR_LABEL)
        == "trainer"
    ]
    if len(trainers) == 1:
        return [], trainers[0]
    problem = Problem(
        obj=obj,
        path="spec.template.spec.replicatedJobs",
        message=f"{len(trainers)} replicated jobs labelled {ANCESTOR_LABEL}: trainer; "
        "exactly one runs the trainer's pods",
    )
    return [problem], None


def runtime_problems(obj: str, doc: Mapping[str, Any]) -> tuple[list[Problem], Runtime | None]:
    """A runtime's controller rules; also what a TrainJob referencing it needs to know.

    The rules a render depends on come first (torch policy, trainer job, container
    ``node``), then JobSet's and the child Job's.
    """
    out: list[Problem] = []
    spec = _m(doc.get("spec"))
    ml = _m(spec.get("mlPolicy"))
    if ml.get("torch") is None:
        out.append(
            Problem(
                obj=obj,
                path="spec.mlPolicy.torch",
                message="is required: without the torch policy no PET_* reach container "
                "'node' and numNodes is not applied",
            )
        )
    js = _m(_m(spec.get("template")).get("spec"))
    jobs = _l(js.get("replicatedJobs"))
    found, index = _trainer_job(obj, jobs)
    out += found
    runtime = None
    if index is not None:
        job_path = f"spec.template.spec.replicatedJobs[{index}]"
        job_spec = _m(_m(_m(jobs[index]).get("template")).get("spec"))
        containers = _l(_m(_m(job_spec.get("template")).get("spec")).get("containers"))
        node = [c for c in containers if _m(c).get("name") == NODE]
        if not node:
            names = ", ".join(str(_m(c).get("name")) for c in containers) or "none"
            out.append(
                Problem(
                    obj=obj,
                    path=f"{job_path}.template.spec.template.spec.containers",
                    message=f"no container named 'node' (found {names}): the torch plugin "
                    "injects PET_* and the TrainJob's image, command and args only there",
                )
            )
        command = [*_l(_m(node[0]).get("command")), *_l(_m(node[0]).get("args"))] if node else []
        counts = [
            c
            for c in (
                _m(r).get("succeededCount")
                for r in _l(_m(job_spec.get("successPolicy")).get("rules"))
            )
            if isinstance(c, int)
        ]
        num_nodes = ml.get("numNodes")
        meta = _m(doc.get("metadata"))
        runtime = Runtime(
            obj=obj,
            kind=str(doc.get("kind")),
            name=str(meta.get("name")),
            namespace=_namespace(meta) if doc.get("kind") == "TrainingRuntime" else None,
            num_nodes=num_nodes if isinstance(num_nodes, int) else None,
            node_range=_node_range(command),
            job_name=str(_m(jobs[index]).get("name")),
            min_completions_needed=max(counts, default=0),
        )
    out += _failure_policy_problems(obj, js, [str(_m(j).get("name")) for j in jobs])
    for i, j in enumerate(jobs):
        out += _job_template_problems(
            obj, f"spec.template.spec.replicatedJobs[{i}]", _m(_m(j).get("template"))
        )
    return out, runtime


def trainjob_problems(
    obj: str,
    doc: Mapping[str, Any],
    runtimes: Mapping[tuple[str, str, str | None], Runtime],
    installed: Iterable[str] = (),
) -> list[Problem]:
    """A TrainJob's controller rules, against the runtimes of the same set.

    ``runtimes`` is keyed by (kind, name, namespace or None for cluster-scoped);
    ``installed``: ``Kind/name`` of runtimes the cluster has (not in the set).
    """
    out: list[Problem] = []
    spec = _m(doc.get("spec"))
    meta = _m(doc.get("metadata"))
    ref = _m(spec.get("runtimeRef"))
    kind = ref.get("kind") or "ClusterTrainingRuntime"
    name = ref.get("name")
    if (ref.get("apiGroup") or API_GROUP) != API_GROUP:
        out.append(
            Problem(obj=obj, path="spec.runtimeRef.apiGroup", message=f"must be {API_GROUP}")
        )
    runtime = None
    if kind not in RUNTIME_KINDS:
        out.append(
            Problem(
                obj=obj,
                path="spec.runtimeRef.kind",
                message=f"{kind!r} not one of {', '.join(RUNTIME_KINDS)}",
            )
        )
    elif isinstance(name, str):
        ns = _namespace(meta) if kind == "TrainingRuntime" else None
        runtime = runtimes.get((kind, name, ns))
        if runtime is None and f"{kind}/{name}" not in set(installed):
            out.append(
                Problem(
                    obj=obj,
                    path="spec.runtimeRef.name",
                    message=f"unknown runtime reference: {kind}/{name} is not among these "
                    "manifests (the controller rejects a TrainJob whose runtime does not "
                    "exist); validate them together, or name an installed one with "
                    "--installed-runtime KIND/NAME",
                )
            )
    trainer = _m(spec.get("trainer"))
    for i, env in enumerate(_l(trainer.get("env"))):
        if _m(env).get("name") in RESERVED_ENV:
            out.append(
                Problem(
                    obj=obj,
                    path=f"spec.trainer.env[{i}]",
                    message=f"{_m(env).get('name')} is reserved: the torch plugin sets it",
                )
            )
    if runtime is None:
        return out
    num = trainer.get("numNodes", runtime.num_nodes)
    path = "spec.trainer.numNodes" if "numNodes" in trainer else "spec.runtimeRef.name"
    where = "spec.trainer.numNodes" if "numNodes" in trainer else f"{runtime.obj} mlPolicy.numNodes"
    if isinstance(num, int) and runtime.node_range is not None:
        lo, hi = runtime.node_range
        if not lo <= num <= hi:
            out.append(
                Problem(
                    obj=obj,
                    path=path,
                    message=f"{num} pods ({where}) outside the runtime's flexrun run "
                    f"--nnodes {lo}:{hi}: "
                    + (
                        "the job could never start"
                        if num < lo
                        else "the extra pods would never join"
                    ),
                )
            )
    if isinstance(num, int) and num < runtime.min_completions_needed:
        out.append(
            Problem(
                obj=obj,
                path=path,
                message=f"{num} pods, but the runtime's successPolicy waits for "
                f"{runtime.min_completions_needed} to succeed",
            )
        )
    if isinstance(num, int) and isinstance(meta.get("name"), str):
        pod = f"{meta['name']}-{runtime.job_name}-0-{num - 1}-abcde"
        if len(pod) > 63:
            out.append(
                Problem(
                    obj=obj,
                    path="metadata.name",
                    message=f"too long: JobSet would name its pods like {pod!r} "
                    f"({len(pod)} > 63 characters)",
                )
            )
    return out


__all__ = [
    "RESERVED_ENV",
    "Runtime",
    "is_trainer_kind",
    "runtime_problems",
    "schema_check",
    "trainjob_problems",
]
