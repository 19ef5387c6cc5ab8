"""The warm interpreters' place in the layers: spares/ imports neither the agent nor the CLI
(only the spare's entry point imports flexrun.train), train/ imports none of agent, spares
or proc, the warm agent's entry point sits beside __main__, and nothing but the spare's
entry point loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import flexrun

pytestmark = pytest.mark.timeout(60)

SRC = Path(flexrun.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (function-local imports too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _under(names: set[str], package: str) -> set[str]:
    return {n for n in names if n == package or n.startswith(package + ".")}


def test_spares_imports_only_proc_the_base_and_for_the_spare_train() -> None:
    allowed = {"flexrun", "flexrun.errors", "flexrun._clock", "flexrun.proc", "flexrun.spares"}
    for path in sorted((SRC / "spares").glob("*.py")):
        ours = _under(_imports(path), "flexrun")
        extra = {n for n in ours if not any(n == a or n.startswith(a + ".") for a in allowed)}
        if path.name == "spare.py":
            extra -= _under(extra, "flexrun.train")
        assert not extra, f"{path.name} imports {sorted(extra)}"
        assert not _under(ours, "flexrun.agent") and not _under(ours, "flexrun.cli")


def test_train_imports_nothing_of_agent_spares_or_proc() -> None:
    for path in sorted((SRC / "train").rglob("*.py")):
        ours = _imports(path)
        for package in ("flexrun.agent", "flexrun.spares", "flexrun.proc"):
            assert not _under(ours, package), f"train/{path.name} imports {package}"


def test_the_entry_points_sit_where_their_imports_allow() -> None:
    assert not (SRC / "agent" / "warm_agent.py").exists()
    assert not (SRC / "train" / "spare.py").exists()
    assert (SRC / "warm_agent.py").exists() and (SRC / "spares" / "spare.py").exists()


def test_only_the_spares_entry_point_loads_torch() -> None:
    code = (
        "import sys\n"
        "import flexrun.spares.pool, flexrun.spares.daemon, flexrun.spares.client\n"
        "import flexrun.spares.become, flexrun.spares.protocol, flexrun.spares.trust\n"
        "import flexrun.spares.forks, flexrun.spares.forkserver\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('flexrun.agent',"
        " 'flexrun.cli', 'flexrun.train'))]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
