"""What the kubelet, Trainer's torch plugin and cluster DNS do to a rendered container, locally.

Shared by the rehearsals in this folder (a uniquely named module: every test dir has a
conftest). Each function mirrors one piece of Kubernetes:

- :func:`effective_trainer_container`: Trainer v2's JobSet builder (the TrainJob's image,
  command, args and env override the runtime's ``node`` container);
- :func:`torch_plugin_env`: the v2.3.0 torch plugin (``PET_NNODES`` = numNodes,
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` = the completion index, ``PET_MASTER_ADDR`` =
  ``<job>-node-0-0.<job>``, ``PET_MASTER_PORT`` = 29500) plus the Job controller's
  ``JOB_COMPLETION_INDEX`` (see ``src/flexrun/k8s/schemas/README.md``);
- :func:`container_env` and :func:`expand`: the container's own env (downward API fields
  resolved) and ``$(VAR)`` expansion in command and args;
- :class:`Mounts`: volume mounts, as local directories (a path under a mount point is
  rewritten to the same path under the local directory);
- :class:`Dns`: cluster DNS, as a rewrite of ``host:port`` to a loopback address.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Doc = dict[str, Any]


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion (unknown variables stay as written)."""
    return re.sub(
        r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text
    )


def container_env(container: Doc, fields: Mapping[str, str]) -> dict[str, str]:
    """The container's env, downward-API ``fieldRef`` values taken from ``fields``."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def node_container(runtime: Doc) -> Doc:
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "node"
    return container


def effective_trainer_container(runtime: Doc, trainjob: Doc) -> Doc:
    """The ``node`` container after Trainer applied the TrainJob's ``trainer`` to it."""
    container = dict(node_container(runtime))
    trainer = trainjob["spec"].get("trainer", {})
    for key in ("image", "command", "args"):
        if key in trainer:
            container[key] = trainer[key]
    if trainer.get("env"):
        names = {e["name"] for e in trainer["env"]}
        container["env"] = [e for e in container.get("env", []) if e["name"] not in names]
        container["env"] += trainer["env"]
    return container


def torch_plugin_env(runtime: Doc, trainjob: Doc, index: int) -> dict[str, str]:
    """What the v2.3.0 torch plugin and the Job controller inject into pod ``index``."""
    name = trainjob["metadata"]["name"]
    trainer = trainjob["spec"].get("trainer", {})
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": "29500",
        "JOB_COMPLETION_INDEX": str(index),
    }


class Mounts:
    """Volume mounts of one pod as local directories."""

    def __init__(self, mapping: Mapping[str, Path]) -> None:
        # Longest mount path first, so /a/b wins over /a.
        self.mapping = sorted(mapping.items(), key=lambda kv: -len(kv[0]))

    def rewrite(self, text: str) -> str:
        """``text`` with every mount path (as a path prefix) replaced by its directory."""
        for mount, local in self.mapping:
            text = re.sub(rf"(?<![\w/.-]){re.escape(mount)}(?=/|\b|$)", str(local), text)
        return text


class Dns:
    """Cluster DNS for ``host:port`` pairs: a Service or pod name -> a loopback endpoint."""

    def __init__(self, names: Mapping[tuple[str, int], tuple[str, int]]) -> None:
        self.names = dict(names)

    def rewrite(self, text: str) -> str:
        def repl(m: re.Match[str]) -> str:
            hit = self.names.get((m.group(1), int(m.group(2))))
            return f"{hit[0]}:{hit[1]}" if hit else m.group(0)

        return re.sub(r"([A-Za-z0-9$()_.-]+):(\d+)", repl, text)
