"""The layering of src/flexrun, asserted on its real imports (docs/contributor/architecture.md, Layers).

Every import of a flexrun module by another (at any depth in a module, lazy imports in
functions too) is an arrow between two units: a subpackage (``agent``, ``store``...) or a
top-level module (``config``, ``events``...). Each unit may import only the units listed
for it below, and the graph of units has no cycle, so no two packages point at each
other and nothing imports upward. A new arrow is a decision: add it here, with a reason,
and to docs/contributor/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "flexrun"

BASE = {"errors", "_clock", "cause", "exitcodes", "__init__", "storage_options"}
# (__init__: __version__; storage_options: the checkpoint options env variable and the
# no-credentials rule, shared by train, k8s and pipeline)

ALLOWED: dict[str, set[str]] = {
    # The base: imported by everything, importing (almost) nothing.
    "errors": set(),
    "_clock": set(),
    "cause": set(),
    "exitcodes": set(),
    "__init__": {"errors", "api"},  # (api: a lazy re-export in __getattr__, see LAZY)
    "events": {"_clock"},
    "live_protocol": {"errors"},
    "storage_options": {"errors"},
    "config": {"errors", "__init__"},  # (a package: settings, build, parsing, topology...)
    "_cmdutil": {"errors"},
    "_spec": {"errors"},  # the one spec-file reader of k8s and pipeline specs
    # The recovery rules (restart budget, crash loop, hang calibration): pure; config only
    # for the settings they are built from.
    "recovery": {"config"},
    "worker_hook": set(),  # runs inside every worker before the script: stdlib only
    "_hookboot": {"worker_hook"},  # the workers' sitecustomize that installs it
    # Below the agent.
    "store": BASE | {"config", "events"},
    "rendezvous": BASE | {"config", "events", "recovery", "store"},
    "proc": BASE,
    "spares": BASE
    | {"proc", "train", "worker_hook"},  # (train: the spare pre-imports what workers use)
    # The training library runs inside workers: never agent, proc or spares.
    "train": BASE | {"config", "events", "live_protocol", "store", "worker_hook"},
    # The training libraries' loops (HF Trainer, Lightning) on top of the training library:
    # imported by training scripts only, like train.
    "integrations": BASE | {"train"},
    # Users of the layers below.
    "agent": BASE
    | {
        "config",
        "events",
        "live_protocol",
        "observe",
        "proc",
        "recovery",
        "rendezvous",
        "spares",
        "store",
        "worker_hook",
    },
    "observe": BASE | {"_cmdutil", "config", "events", "rendezvous", "store"},
    "k8s": BASE | {"_cmdutil", "_spec", "config"},
    "pipeline": BASE | {"_cmdutil", "_spec", "config", "k8s", "train"},  # (k8s: Argo pods)
    "testing": BASE
    | {
        "_cmdutil",
        "agent",
        "config",
        "events",
        "live_protocol",
        "proc",
        "rendezvous",
        "store",
        "train",
    },
    # Entry points.
    "run_args": BASE | {"config"},  # flexrun run's argparse options (torchrun's, one for one)
    "cli": {"*"},
    # The Python launch API (flexrun.launch, elastic_launch): above the agent, like cli; it
    # starts a `flexrun run` agent and uses the run parser and config to validate options.
    "api": {"*"},
    "__main__": {"cli"},
    "warm_agent": BASE | {"agent", "cli", "spares"},
}


def unit_of(module: str) -> str:
    """``flexrun.agent.live`` -> ``agent``; ``flexrun.config`` -> ``config``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every flexrun module ``path`` imports (absolute and relative, anywhere)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "flexrun"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] == "flexrun":
                out.add(mod)
    return out


def unit_graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the modules (files) responsible."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        src = unit_of(module_name(path))
        for mod in imports_of(path):
            dst = unit_of(mod)
            if dst != src:
                graph.setdefault(src, {}).setdefault(dst, set()).add(module_name(path))
    return graph


def test_every_unit_is_known() -> None:
    units = {unit_of(module_name(p)) for p in SRC.rglob("*.py")}
    unknown = units - set(ALLOWED)
    assert not unknown, f"new units need a line in ALLOWED (tests/test_layers.py): {unknown}"


def test_no_import_runs_against_the_layers() -> None:
    bad = [
        f"{src} -> {dst} (in {', '.join(sorted(files))})"
        for src, dsts in unit_graph().items()
        for dst, files in dsts.items()
        if "*" not in ALLOWED.get(src, set()) and dst not in ALLOWED.get(src, set())
    ]
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


LAZY = {("__init__", "api")}
"""Arrows taken only when an attribute is first asked for (``flexrun.launch`` resolves
``flexrun.api`` in the package's ``__getattr__``), never while a module imports: they
cannot form an import cycle, so the cycle check leaves them out."""


def test_no_two_units_import_each_other_even_through_others() -> None:
    graph = {s: {d for d in dsts if (s, d) not in LAZY} for s, dsts in unit_graph().items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(u: str, path: list[str]) -> bool:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                cycle.extend([*path[path.index(v) :], v] if v in path else [u, v])
                return True
            if state.get(v) is None and visit(v, [*path, v]):
                return True
        state[u] = 2
        return False

    for u in sorted(graph):
        if state.get(u) is None and visit(u, [u]):
            break
    assert not cycle, "import cycle between units: " + " -> ".join(cycle)


def test_the_training_library_imports_nothing_of_the_agent_side() -> None:
    train = unit_graph().get("train", {})
    assert not {"agent", "spares", "proc", "cli"} & set(train), train


def test_the_graph_is_read_from_real_imports() -> None:
    # (A walker that found nothing would pass every test above.)
    graph = unit_graph()
    assert "rendezvous" in graph["agent"] and "store" in graph["rendezvous"]
    assert "events" in graph["rendezvous"]


MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def test_no_module_or_class_outgrows_its_budget() -> None:
    """The size budget (CONTRIBUTING.md): a module past 500 lines or a class past 300 is split."""
    big = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_MODULE_LINES:
            big.append(f"{module_name(path)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    big.append(f"{module_name(path)}.{node.name}: {size} lines")
    assert not big, "over the size budget:\n" + "\n".join(big)


PURE = (
    "agent/policy.py",
    "recovery.py",
    "rendezvous/decide.py",
    "rendezvous/static.py",
    "train/live_plan.py",
)
"""The decisions: given their inputs (events, views, ``now``) they return what to do."""
PURE_STDLIB = {"__future__", "collections", "dataclasses", "enum", "math", "typing"}


def test_the_decisions_are_pure() -> None:
    # No I/O, no clock, no threads: a decision module imports only data types from the
    # standard library, and the names it calls are its own or its inputs'.
    for rel in PURE:
        tree = ast.parse((SRC / rel).read_text(), filename=rel)
        stdlib = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                stdlib |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                stdlib.add((node.module or "").split(".")[0])
        stdlib.discard("flexrun")
        assert stdlib <= PURE_STDLIB, f"{rel} imports {sorted(stdlib - PURE_STDLIB)}"
        calls = {
            n.func.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not calls & {"open", "print", "input", "exec", "eval"}, f"{rel} calls {calls}"


def module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (every import: lazy ones and those
    only for type checking too; a circle of those is still two files that need each other)."""
    prefix = f"flexrun.{package}"
    graph: dict[str, set[str]] = {}
    for path in sorted((SRC / package).rglob("*.py")):
        me = module_name(path)
        graph[me] = {m for m in imports_of(path) if m.startswith(prefix) and m != me}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    found: list[str] = []

    def visit(u: str, path: list[str]) -> bool:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                found.extend([*path[path.index(v) :], v])
                return True
            if state.get(v) is None and visit(v, [*path, v]):
                return True
        state[u] = 2
        return False

    for u in sorted(graph):
        if state.get(u) is None and visit(u, [u]):
            break
    return found


def test_no_import_circle_inside_the_rendezvous() -> None:
    """The roles (watcher, claims, follower, masters) share a session
    (``rendezvous/session.py``) and the handler sequences them: none of them holds the
    handler, so no two of its files need each other."""
    graph = module_graph("rendezvous")
    assert "flexrun.rendezvous.state" in graph["flexrun.rendezvous.watcher"]  # (read)
    cycle = cycle_in(graph)
    assert not cycle, "import circle inside the rendezvous: " + " -> ".join(cycle)


RUNNERS = ("agent/runner.py", "agent/restart.py", "agent/live.py")
"""The runners: they run a round's workers, handed the round and its master address."""
ROUND_RECORDS = {"flexrun.rendezvous.state", "flexrun.rendezvous.keys"}
"""What of the rendezvous a runner may name: the round's records (data, no store access)."""


def test_no_runner_steps_the_rendezvous() -> None:
    """The agent's loop publishes or awaits each round's master address and hands it to
    ``Runner.run_round``: a runner, and every agent module it imports, names no part of
    the rendezvous beyond the round's records."""
    seen: set[str] = set()
    todo = [module_name(SRC / rel) for rel in RUNNERS]
    bad = []
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = SRC.parent / (mod.replace(".", "/") + ".py")
        if not path.exists():
            path = SRC.parent / mod.replace(".", "/") / "__init__.py"
        for dst in imports_of(path):
            if unit_of(dst) == "rendezvous" and dst not in ROUND_RECORDS:
                bad.append(f"{mod} -> {dst}")
            elif unit_of(dst) == "agent":
                todo.append(dst)
    assert "flexrun.agent.spec" in seen  # (the walk follows the runners' own imports)
    assert not bad, "a runner reaches the rendezvous:\n" + "\n".join(bad)
    # Nor is it handed a way to: the master source is the agent loop's, not a runner's.
    handed = [rel for rel in RUNNERS[1:] if "MasterSource" in (SRC / rel).read_text()]
    assert not handed, f"a runner is handed the master source: {handed}"


REGISTRY = "config/backends.py"
"""The store backends' registry: their names and traits (``flexrun.config.backends``)."""
NOT_A_STORE = {"static"}
"""torchrun's static rendezvous: a shape of the job (``config/topology.py`` resolves it),
served by the tcp store; not a choice of store."""
NAMES_ITS_OWN = ("store/", REGISTRY, "k8s/")
"""Where backends may be named: the backends themselves, the registry, and the Kubernetes
renderer (whose spec's ``store.type`` says which server to deploy, and whose manifest
rules list the PyTorchJob operator's own backend names)."""


def test_no_module_outside_the_store_and_the_registry_names_a_backend() -> None:
    """A new backend is a row in the registry, a constructor in ``store/factory.py``, its
    module and its contract-suite entry: nobody else decides by a backend's name (they ask
    for a trait: ``backend_named(name).hosted``, ``.live``, ``.shares_worker_store``...)."""
    from flexrun.config.backends import ALIASES, BACKENDS

    names = (set(BACKENDS) | set(ALIASES)) - NOT_A_STORE
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(NAMES_ITS_OWN):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            named = ""
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    elts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                    for e in elts:
                        if isinstance(e, ast.Constant) and e.value in names:
                            named = repr(e.value)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "startswith"
                and any(
                    isinstance(a, ast.Constant)
                    and isinstance(a.value, str)
                    and any(n.startswith(a.value) for n in names)
                    for a in node.args
                )
            ):
                named = "startswith"
            elif isinstance(node, ast.Name) and node.id in ("BACKENDS_ETCD", "BACKENDS_TCP"):
                named = node.id
            if named:
                bad.append(f"{rel}:{getattr(node, 'lineno', '?')}: {named}")
    assert not bad, "a backend named outside store/ and the registry:\n" + "\n".join(bad)
