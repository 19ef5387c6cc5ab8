"""What a job's pods will run, against the object around them: the mistakes people make.

Owns the checks of a worker pod template (a PyTorchJob's replica, a Trainer runtime's
replicated job) that no schema can express because they relate two places of the object:

- the launcher's ``--nnodes`` (torchrun or ``flexrun run``, also inside ``sh -c``) against
  the pods the object starts: a fixed count must equal them, an elastic job's range must be
  ``elasticPolicy``'s ``minReplicas:maxReplicas`` (a PyTorchJob) or hold ``numNodes``;
- ``$VAR`` in ``command``/``args``: Kubernetes expands only ``$(VAR)`` there, so ``$RANK``
  reaches the launcher literally (a shell, ``sh -c``, does expand it);
- ``terminationGracePeriodSeconds`` longer than the reclaim notice of the spot pool the pod
  is steered to (``nodeSelector``/``tolerations``/node affinity keys of the providers);
- several processes per pod without a ``/dev/shm`` volume (the container runtime's 64Mi);
- GPUs requested against the processes per pod (``--nproc-per-node``/``nprocPerNode``).

Each finding says the fix. It does not parse whole manifests nor know schemas
(``validate.py`` dispatches; ``_pytorchjob_rules``/``validate_trainer`` check the shapes).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from flexrun.k8s.problems import Problem

#: Reclaim notice (seconds) of the spot/preemptible pools, by the node label that selects them.
SPOT_NOTICE_S = {
    "cloud.google.com/gke-spot": 30,
    "cloud.google.com/gke-preemptible": 30,
    "kubernetes.azure.com/scalesetpriority": 30,
    "eks.amazonaws.com/capacityType": 120,
    "karpenter.sh/capacity-type": 120,
}
GPU_RESOURCE = "nvidia.com/gpu"
_SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
_LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch", "flexrun"})
_UNEXPANDED = re.compile(r"(?<!\$)\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")
_NNODES = ("--nnodes",)
_NPROC = ("--nproc-per-node", "--nproc_per_node")


def _m(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _strings(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _is_shell(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0].rsplit("/", 1)[-1] in _SHELLS and "-c" in argv[1:3]


def launcher_options(argv: Sequence[str]) -> dict[str, str] | None:
    """``--nnodes`` / ``--nproc-per-node`` given to torchrun or ``flexrun run`` in ``argv``
    (or in the script of ``sh -c``); None when no launcher is found."""
    tokens = list(argv)
    if _is_shell(tokens):
        script = tokens[tokens.index("-c") + 1] if tokens.index("-c") + 1 < len(tokens) else ""
        try:
            tokens = shlex.split(script)
        except ValueError:
            return None
    start = None
    for i, tok in enumerate(tokens):
        base = tok.rsplit("/", 1)[-1]
        if base == "torchrun" or (base == "flexrun" and tokens[i + 1 : i + 2] == ["run"]):
            start = i + (2 if base == "flexrun" else 1)
            break
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] in _LAUNCHER_MODULES:
            start = i + 2 + (1 if tokens[i + 1] == "flexrun" else 0)
            break
    if start is None:
        return None
    found: dict[str, str] = {}
    rest = tokens[start:]
    for i, tok in enumerate(rest):
        if tok == "-m" or tok.endswith(".py") or tok in ("&&", ";", "|"):
            break  # the script (or the next command): its own flags are not the launcher's
        name, eq, value = tok.partition("=")
        if name in _NNODES or name in _NPROC:
            if not eq:
                value = rest[i + 1] if i + 1 < len(rest) else ""
            found["nnodes" if name in _NNODES else "nproc"] = value
    return found


def _range(text: str) -> tuple[int, int] | None:
    lo, sep, hi = text.partition(":")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        return None  # e.g. $(PET_NNODES): decided at run time
    return (int(lo), int(hi)) if sep else (int(lo), int(lo))


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _spot_notice(pod: Mapping[str, Any]) -> tuple[str, int] | None:
    keys = set(_m(pod.get("nodeSelector")))
    for t in _list(pod.get("tolerations")):
        keys.add(str(_m(t).get("key")))
    affinity = _m(_m(_m(pod.get("affinity")).get("nodeAffinity")))
    required = _m(affinity.get("requiredDuringSchedulingIgnoredDuringExecution"))
    for term in _list(required.get("nodeSelectorTerms")):
        for expr in _list(_m(term).get("matchExpressions")):
            keys.add(str(_m(expr).get("key")))
    hits = sorted((SPOT_NOTICE_S[k], k) for k in keys if k in SPOT_NOTICE_S)
    return (hits[0][1], hits[0][0]) if hits else None


def pod_problems(
    obj: str,
    base: str,
    pod: object,
    container_name: str,
    *,
    pods: int | None,
    elastic: tuple[int, int] | None,
    nproc: object,
) -> list[Problem]:
    """The checks above on one pod template's spec at ``base``.

    ``pods``: the pods the object starts (None: unknown); ``elastic``: its min/max pods when
    it scales (a PyTorchJob's elasticPolicy); ``nproc``: processes per pod set on the object
    (``nprocPerNode``/``numProcPerNode``), the launcher's flag wins.
    """
    if not isinstance(pod, Mapping):
        return []
    out: list[Problem] = []
    containers = [c for c in _list(pod.get("containers")) if isinstance(c, Mapping)]
    for i, c in enumerate(containers):
        argv = _strings(c.get("command")) + _strings(c.get("args"))
        if _is_shell(argv):
            continue
        for field in ("command", "args"):
            for j, arg in enumerate(_strings(c.get(field))):
                for m in _UNEXPANDED.finditer(arg):
                    name = m.group(1).strip("{}")
                    out.append(
                        Problem(
                            obj=obj,
                            path=f"{base}.containers[{i}].{field}[{j}]",
                            message=f"{m.group(0)} is passed literally: Kubernetes expands only "
                            f"$({name}) in command and args; write $({name}) (or run it "
                            "through sh -c)",
                        )
                    )
    main = next((i for i, c in enumerate(containers) if c.get("name") == container_name), None)
    if main is None:
        return out
    c = containers[main]
    where = f"{base}.containers[{main}]"
    opts = launcher_options(_strings(c.get("command")) + _strings(c.get("args"))) or {}
    out += _nnodes_problems(obj, where, opts.get("nnodes"), pods, elastic)
    nproc_value = opts.get("nproc", nproc)
    procs = _int(nproc_value)
    limits = _m(_m(c.get("resources")).get("limits"))
    gpus = _int(
        limits.get(GPU_RESOURCE, _m(_m(c.get("resources")).get("requests")).get(GPU_RESOURCE))
    )
    if procs is not None and gpus is not None and gpus > 0 and procs != gpus:
        out.append(
            Problem(
                obj=obj,
                path=f"{where}.resources.limits",
                message=f"{GPU_RESOURCE}: {gpus} for {procs} processes per pod "
                + (
                    "(processes would share a GPU; NCCL refuses that)"
                    if procs > gpus
                    else "(GPUs left idle)"
                )
                + f": set the processes per pod to {gpus} (--nproc-per-node {gpus}, or gpu)",
                error=procs > gpus,
            )
        )
    several = (procs is not None and procs > 1) or (
        procs is None and nproc_value in ("gpu", "auto") and (gpus or 0) != 1
    )
    mounts = {str(_m(v).get("mountPath")) for v in _list(c.get("volumeMounts"))}
    if several and "/dev/shm" not in mounts:
        out.append(
            Problem(
                obj=obj,
                path=f"{where}.volumeMounts",
                message="several processes per pod and no /dev/shm volume (the container "
                "runtime gives 64Mi; DataLoader workers and NCCL run out): mount an emptyDir "
                "{medium: Memory, sizeLimit: 2Gi} at /dev/shm (flexrun spec: shmSize)",
                error=False,
            )
        )
    grace = _int(pod.get("terminationGracePeriodSeconds"))
    spot = _spot_notice(pod)
    if grace is not None and spot is not None and grace > spot[1]:
        out.append(
            Problem(
                obj=obj,
                path=f"{base}.terminationGracePeriodSeconds",
                message=f"{grace} s is longer than the {spot[1]} s reclaim notice of the spot "
                f"nodes it runs on ({spot[0]}): the node is gone before the final checkpoint; "
                f"use at most {spot[1]} (flexrun spec: gracePeriodSeconds)",
                error=False,
            )
        )
    return out


def _nnodes_problems(
    obj: str,
    where: str,
    nnodes: str | None,
    pods: int | None,
    elastic: tuple[int, int] | None,
) -> list[Problem]:
    if nnodes is None:
        return []
    got = _range(nnodes)
    if got is None:
        return []
    path = f"{where}.args"

    def bad(message: str) -> list[Problem]:
        return [Problem(obj=obj, path=path, message=message)]

    if elastic is not None:
        want = f"{elastic[0]}:{elastic[1]}"
        if got != elastic:
            return bad(
                f"--nnodes={nnodes} but elasticPolicy scales between {elastic[0]} and "
                f"{elastic[1]} pods: use --nnodes={want} (or drop it: the operator sets "
                "PET_NNODES)"
            )
        return []
    if pods is not None and not got[0] <= pods <= got[1]:
        return bad(
            f"--nnodes={nnodes} but the job starts {pods} pods: use --nnodes={pods} (or drop "
            "it: the operator sets PET_NNODES); with fewer the extra pods never join, with "
            "more the rendezvous waits forever"
        )
    return []


def pytorchjob_pod_problems(obj: str, job: Mapping[str, Any]) -> list[Problem]:
    """:func:`pod_problems` for every replica of a PyTorchJob."""
    spec = _m(job.get("spec"))
    replicas = _m(spec.get("pytorchReplicaSpecs"))
    pods = 0
    for rspec in replicas.values():
        count = _m(rspec).get("replicas", 1)
        if _int(count) is None:
            pods = -1
            break
        pods += int(count)
    e = _m(spec.get("elasticPolicy"))
    lo, hi = _int(e.get("minReplicas")), _int(e.get("maxReplicas"))
    elastic = (lo, hi) if "elasticPolicy" in spec and lo is not None and hi is not None else None
    nproc = spec.get("nprocPerNode", _m(e).get("nProcPerNode"))
    out = []
    for rtype, rspec in replicas.items():
        template = _m(_m(rspec).get("template"))
        out += pod_problems(
            obj,
            f"spec.pytorchReplicaSpecs.{rtype}.template.spec",
            template.get("spec"),
            "pytorch",
            pods=pods if pods >= 0 else None,
            elastic=elastic,
            nproc=nproc,
        )
    return out


def runtime_pod_problems(obj: str, runtime: Mapping[str, Any]) -> list[Problem]:
    """:func:`pod_problems` for the replicated jobs of a Trainer runtime (container ``node``)."""
    spec = _m(runtime.get("spec"))
    ml = _m(spec.get("mlPolicy"))
    pods = _int(ml.get("numNodes"))
    nproc = _m(ml.get("torch")).get("numProcPerNode")
    jobs = _m(_m(spec.get("template")).get("spec")).get("replicatedJobs")
    out = []
    for i, job in enumerate(jobs if isinstance(jobs, list) else []):
        pod = _m(_m(_m(_m(job).get("template")).get("spec")).get("template")).get("spec")
        out += pod_problems(
            obj,
            f"spec.template.spec.replicatedJobs[{i}].template.spec.template.spec",
            pod,
            "node",
            pods=pods,
            elastic=None,
            nproc=nproc,
        )
    return out


__all__ = [
    "GPU_RESOURCE",
    "SPOT_NOTICE_S",
    "launcher_options",
    "pod_problems",
    "pytorchjob_pod_problems",
    "runtime_pod_problems",
]
