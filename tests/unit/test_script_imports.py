"""flexrun.config.script_imports: what a script imports, read without running it, and the
warm-pool defaults built on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.cli import build_parser
from flexrun.config import run_config_from_args
from flexrun.config.script_imports import BEYOND, ScriptImports, read_source, script_imports

NONE = ScriptImports(at_start=False, anywhere=False)
LATER = ScriptImports(at_start=False, anywhere=True)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os, sys\nfrom pathlib import Path\nimport os.path\n", NONE),
        ("from __future__ import annotations\nimport json\n", NONE),
        ("import torch\n", BEYOND),
        ("import os\nimport torch.distributed as dist\n", BEYOND),
        ("from flexrun.train import save\n", BEYOND),
        ("try:\n    import numpy\nexcept ImportError:\n    pass\n", BEYOND),
        ("if True:\n    with open('x') as f:\n        import yaml\n", BEYOND),
        ("class A:\n    import torch\n", BEYOND),  # (a class body runs at definition)
        ("def main():\n    import torch\n\nmain()\n", LATER),
        ("async def f():\n    from torch import nn\n", LATER),
        ("f = lambda: __import__('torch')\n", LATER),
        ("def f(x=__import__('torch')):\n    pass\n", BEYOND),  # (a default runs at once)
        ("@__import__('functools').cache\ndef f():\n    pass\n", BEYOND),
        ("from . import sibling\n", BEYOND),  # (the script's package: unknown)
        ("import importlib\nimportlib.import_module('os')\n", BEYOND),
        ("import runpy\n", BEYOND),
        ("exec('import os')\n", BEYOND),
        ("eval('1')\n", BEYOND),
        ("import os\n)(\n", BEYOND),  # not Python
        (b"import os\x00\n", BEYOND),
    ],
)
def test_what_a_script_imports_is_read_from_its_syntax_tree(
    source: str | bytes, expected: ScriptImports
) -> None:
    assert read_source(source) == expected


def test_a_file_that_cannot_be_read_counts_as_beyond_the_standard_library(
    tmp_path: Path,
) -> None:
    assert script_imports(tmp_path / "missing.py") == BEYOND
    assert script_imports(tmp_path) == BEYOND  # a directory
    big = tmp_path / "big.py"
    big.write_text("import os\n" + "#" * (5 << 20))
    assert script_imports(big) == BEYOND
    ok = tmp_path / "ok.py"
    ok.write_text("import os\n")
    assert script_imports(ok) == NONE


def _spares(argv: list[str]) -> tuple[int, bool]:
    ns = build_parser({}).parse_args(["run", "--standalone", *argv])
    spares = run_config_from_args(ns, {}).spares
    return spares.warm_spares, spares.first_from_pool


def test_the_warm_pool_defaults_follow_what_the_script_imports(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("import time\n")
    (tmp_path / "later.py").write_text("def main():\n    import torch\n")
    (tmp_path / "torch.py").write_text("import torch\n")
    run = ["--nproc-per-node", "3", "--run-dir", str(tmp_path / "r")]
    assert _spares([*run, str(tmp_path / "plain.py")]) == (0, False)
    assert _spares([*run, str(tmp_path / "later.py")]) == (3, False)
    assert _spares([*run, str(tmp_path / "torch.py")]) == (3, True)
    # Given, --warm-spares is kept; a module or a program is not read.
    assert _spares([*run, "--warm-spares", "2", str(tmp_path / "plain.py")]) == (2, False)
    assert _spares([*run, "-m", "plain"]) == (3, True)
    # A node's `flexrun spares` are warm already: taken whatever the script imports.
    spares_dir = ["--spares-dir", str(tmp_path / "sp")]
    assert _spares([*run, *spares_dir, str(tmp_path / "plain.py")]) == (3, False)
    assert _spares([*run, "--no-python", "/bin/true"]) == (3, True)
