"""What a Slurm step tells ``flexrun run``: node count, this node's rank, the head host, the
job's id, so that ``srun flexrun run train.py`` needs nothing else.

Owns the mapping from ``SLURM_*`` variables to ``flexrun run`` option defaults, below the
command line and ``PET_*`` (precedence CLI > ``PET_*`` > ``SLURM_*`` > default), and the
parsing of Slurm's hostlist syntax (``n[1-3,05],gpu01``). It does not decide the job's shape
(:mod:`flexrun.config.topology` does, from the values filled in here) and reads no
environment itself: it is given the mapping the CLI captured.

The forms (docs/user/slurm.md):

- static (the default): ``--nnodes $SLURM_STEP_NUM_TASKS --node-rank $SLURM_PROCID
  --master-addr <first host of the step> --master-port <port from the job id>``;
- elastic, when ``--nnodes MIN:MAX``, ``--rdzv-endpoint`` or an elastic ``--rdzv-backend``
  is given: ``--rdzv-backend c10d --rdzv-endpoint <first host>:<port from the job id>``;
  a MAX below the step's task count leaves the other tasks as spare nodes: their agents
  wait on standby and join the round that replaces a lost member. The first round waits
  for the step's tasks (up to MAX; ``RendezvousSettings.expected_nodes``), each of them
  up to 30 s late, rather than closing after the 1 s last call with the first arrivals;

and ``--rdzv-id`` is the job id (``<array job id>_<task id>`` for an array task) in both.
One flexrun per node (``--ntasks-per-node=1``) is the usual step. Several tasks per node (one
per GPU) each count as a node of their own (their rank is ``SLURM_PROCID``) and, with one
worker each, that worker's local rank is the task's ``SLURM_LOCALID`` (``WorkerSpec.slurm_task``).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from flexrun.config.parsing import parse_nnodes, pet_name
from flexrun.errors import ConfigError

log = logging.getLogger("flexrun.config")

OFF_ENV = "FLEXRUN_SLURM"
"""``FLEXRUN_SLURM=0``: ignore the ``SLURM_*`` variables (a flexrun started inside an
allocation for something else, e.g. a one-node test in an interactive ``salloc`` shell)."""
PORT_BASE = 11000
PORT_SPAN = 10000
"""The port a job's store uses: ``PORT_BASE + 2 * (job id % PORT_SPAN)`` (even offsets: from
when a static job also used the master port + 1; it uses the master port alone now)."""
_ELASTIC_BACKENDS = ("c10d", "tcp", "etcd", "etcd-v2", "etcd-v3")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmStep:
    """The ``SLURM_*`` facts flexrun uses."""

    job_id: str
    run_id: str
    tasks: int
    rank: int
    nodelist: str
    in_step: bool
    """Inside an ``srun`` step (else: a batch script or an ``salloc`` shell)."""
    nodes: int
    local_id: int = 0
    """``SLURM_LOCALID``: this task's index among the step's tasks on this node."""
    node_tasks: int = 1
    """The step's tasks on this node (from ``SLURM_STEP_TASKS_PER_NODE``)."""

    @property
    def port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return PORT_BASE + 2 * (int(digits) % PORT_SPAN)


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    # SLURM_TASKS_PER_NODE-style values such as "2(x3)" are not read here; counts are plain.
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer (set by Slurm)") from None


def tasks_per_node(text: str) -> list[int]:
    """Slurm's per-node task counts, expanded: ``2(x3),1`` -> [2, 2, 2, 1].

    Raises:
        ConfigError: not in that syntax.
    """
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None or int(m.group(2) or 1) > 100_000:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: expected e.g. 2(x3),1")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def step_of(environ: Mapping[str, str]) -> SlurmStep | None:
    """The Slurm job this process runs in, or None (not in one, or ``FLEXRUN_SLURM=0``).

    Raises:
        ConfigError: a Slurm variable that is not what Slurm sets.
    """
    job_id = environ.get("SLURM_JOB_ID", "").strip() or environ.get("SLURM_JOBID", "").strip()
    if not job_id or environ.get(OFF_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return None
    nodes = _int(environ, "SLURM_STEP_NUM_NODES") or _int(environ, "SLURM_NNODES")
    nodes = nodes or _int(environ, "SLURM_JOB_NUM_NODES") or 1
    in_step = bool(environ.get("SLURM_STEP_ID", "").strip()) and "SLURM_PROCID" in environ
    if environ.get("SLURM_STEP_ID", "").strip() in ("batch", "extern", "interactive"):
        in_step = False
    tasks = _int(environ, "SLURM_STEP_NUM_TASKS") or _int(environ, "SLURM_NTASKS") or nodes
    rank = _int(environ, "SLURM_PROCID")
    if rank is None:
        rank = _int(environ, "SLURM_NODEID") or 0
    nodelist = (
        environ.get("SLURM_STEP_NODELIST", "").strip()
        or environ.get("SLURM_JOB_NODELIST", "").strip()
        or environ.get("SLURM_NODELIST", "").strip()
    )
    array_job = environ.get("SLURM_ARRAY_JOB_ID", "").strip()
    array_task = environ.get("SLURM_ARRAY_TASK_ID", "").strip()
    run_id = f"{array_job}_{array_task}" if array_job and array_task else job_id
    run_id = "slurm-" + re.sub(r"[^A-Za-z0-9_.\-]", "_", run_id)
    if not 0 <= rank < max(tasks, 1):
        raise ConfigError(
            f"SLURM_PROCID={rank} with {tasks} tasks in the step: not a rank of the step"
        )
    per_node = tasks_per_node(
        environ.get("SLURM_STEP_TASKS_PER_NODE", "") or environ.get("SLURM_TASKS_PER_NODE", "")
    )
    node_index = _int(environ, "SLURM_NODEID") or 0
    return SlurmStep(
        local_id=_int(environ, "SLURM_LOCALID") or 0,
        node_tasks=per_node[node_index] if node_index < len(per_node) else 1,
        job_id=job_id,
        run_id=run_id,
        tasks=tasks,
        rank=rank,
        nodelist=nodelist,
        in_step=in_step,
        nodes=nodes,
    )


# -- hostlists ---------------------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"hostlist {text!r}: ']' without '['")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ConfigError(f"hostlist {text!r}: '[' without ']'")
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _range(spec: str, text: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ConfigError(f"hostlist {text!r}: bad range {part!r} in [{spec}]")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ConfigError(f"hostlist {text!r}: range {part!r} runs backwards")
        if hi - lo > 100_000:
            raise ConfigError(f"hostlist {text!r}: range {part!r} is too large")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(item: str, text: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    return [head + n + rest for n in _range(m.group(1), text) for rest in _expand_one(tail, text)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax, expanded in order: ``n[1-3,05],gpu01`` -> n1, n2, n3, n05,
    gpu01 (zero padding kept; several bracket groups in one name give their product).

    Raises:
        ConfigError: unbalanced brackets or a bad range.
    """
    return [host for item in _split_top(text.strip()) for host in _expand_one(item, text)]


def first_host(nodelist: str, environ: Mapping[str, str]) -> str:
    """The first host of a Slurm nodelist: ``scontrol show hostnames`` where it runs (on the
    step's ``PATH``; it is the reference), else :func:`expand_hostlist`."""
    scontrol = shutil.which("scontrol", path=environ.get("PATH", ""))
    if scontrol is not None:
        try:
            done = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
                env=dict(environ),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("scontrol show hostnames %s: %s; parsing it here", nodelist, exc)
        else:
            names = done.stdout.split()
            if done.returncode == 0 and names:
                return names[0]
            log.debug("scontrol show hostnames %s: %s", nodelist, done.stderr.strip())
    hosts = expand_hostlist(nodelist)
    if not hosts:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: no host in it")
    return hosts[0]


# -- defaults ----------------------------------------------------------------------------------
def _given(a: Mapping[str, Any], environ: Mapping[str, str], dest: str) -> bool:
    return dest in a.get("explicit", ()) or pet_name(dest) in environ


def apply_slurm_defaults(a: MutableMapping[str, Any], environ: Mapping[str, str]) -> None:
    """Fill the options neither the command line nor ``PET_*`` gave from the Slurm job this
    process runs in (nothing outside one). ``a``: the parsed options (``vars(namespace)``),
    changed in place; the filled ones are added to ``a["slurm_filled"]``.

    Raises:
        ConfigError: a multi-node job's flexrun outside an ``srun`` step (it would wait for
            nodes that never come, or train alone), or bad ``SLURM_*`` values.
    """
    step = step_of(environ)
    if step is None:
        return
    filled: dict[str, str] = {}

    def fill(dest: str, value: str) -> None:
        if not _given(a, environ, dest):
            a[dest] = value
            filled[dest] = value

    if _given(a, environ, "standalone") and a.get("standalone"):
        if step.tasks > 1 and step.in_step:
            raise ConfigError(
                f"--standalone in a Slurm step of {step.tasks} tasks would train {step.tasks} "
                "independent one-node jobs; drop --standalone (flexrun reads the step's nodes "
                "from SLURM_*) or run one task (srun --ntasks=1)"
            )
        return
    if not step.in_step:
        if step.nodes > 1:
            raise ConfigError(
                f"flexrun run in Slurm job {step.job_id}'s batch script or shell, outside a "
                f"step, with {step.nodes} nodes allocated: start it on every node with "
                "`srun --ntasks-per-node=1 flexrun run ...` (or FLEXRUN_SLURM=0 for a "
                "one-node run here)"
            )
        return  # a one-node allocation: the plain one-host defaults are right
    if step.tasks == 1:
        fill("rdzv_id", step.run_id)  # one task: a one-host run, with the job's id
        a["slurm_filled"] = filled
        return
    head = first_host(step.nodelist, environ) if step.nodelist else None
    if head is None:
        raise ConfigError(
            f"Slurm step of {step.tasks} tasks without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: "
            "cannot tell the head host; give --master-addr or --rdzv-endpoint"
        )
    fill("rdzv_id", step.run_id)
    if step.node_tasks > 1:
        # One task per GPU: with one worker each, the worker's local rank is the task's.
        a["slurm_task"] = (step.local_id, step.node_tasks)
    backend = str(a.get("rdzv_backend") or "static").strip().lower()
    nnodes_given = _given(a, environ, "nnodes")
    elastic = (
        _given(a, environ, "rdzv_endpoint")
        or (_given(a, environ, "rdzv_backend") and backend in _ELASTIC_BACKENDS)
        or (nnodes_given and ":" in str(a.get("nnodes")))
    )
    if nnodes_given:
        lo, hi = parse_nnodes(str(a["nnodes"]))
        if hi < step.tasks and not elastic:
            raise ConfigError(
                f"--nnodes {a['nnodes']} but the Slurm step runs {step.tasks} flexrun tasks: "
                f"give --nnodes {step.tasks}, or --nnodes MIN:{hi} to keep "
                f"{step.tasks - hi} of them as spare nodes"
            )
        if hi < step.tasks:
            log.info(
                "Slurm step of %d tasks, --nnodes %s: %d spare node(s) wait on standby and "
                "join when a member is lost",
                step.tasks,
                a["nnodes"],
                step.tasks - hi,
            )
    if elastic:
        if not _given(a, environ, "rdzv_backend") or backend == "static":
            fill("rdzv_backend", "c10d")
        fill("rdzv_endpoint", f"{head}:{step.port}")
        fill("nnodes", f"1:{step.tasks}")
        # The step's tasks start together: the first round waits for them (up to MAX)
        # instead of closing 1 s after the first with whoever srun had started by then.
        a["expected_nodes"] = min(parse_nnodes(str(a["nnodes"]))[1], step.tasks)
    else:
        fill("nnodes", str(step.tasks))
        fill("node_rank", str(step.rank))
        fill("master_addr", head)
        fill("master_port", str(step.port))
    a["explicit"] = set(a.get("explicit", ())) | set(filled)
    a["slurm_filled"] = filled
    log.debug(
        "Slurm job %s: %s",
        step.job_id,
        " ".join(f"--{k.replace('_', '-')} {v}" for k, v in filled.items()),
    )
