"""A fresh virtual environment resolves every extra the project declares, with the README's pins.

The README's test line is what a newcomer runs first; a pin set that stops resolving (a package
that ties itself to one release of another, a release the registry stops serving) must fail CI,
not the newcomer. The README's lines install with uv, so uv resolves here, as they do: ``uv pip
install --dry-run`` into a fresh venv made from the interpreter running the suite. Resolving the
union of all extras in one run proves they can live together, which a resolution of each alone
would not.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # the test extra declares tomli for 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _readme_install_lines() -> list[str]:
    return ROOT.joinpath("README.md").read_text(encoding="utf-8").splitlines()[:2]


def _extras() -> list[str]:
    meta = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text(encoding="utf-8"))
    return sorted(meta["project"]["optional-dependencies"])


def test_the_readme_starts_with_the_two_install_lines_using_the_constraints() -> None:
    first, second = _readme_install_lines()
    uv = "pip install uv -c constraints.txt && uv pip install -e"
    assert first.startswith(f"{uv} '.[examples]' -c constraints.txt && flexrun run ")
    assert second == f"{uv} '.[test]' -c constraints.txt && python -m pytest"


def test_the_ci_script_runs_the_readme_test_line_in_a_fresh_venv() -> None:
    ci = ROOT.joinpath(".ci", "run").read_text(encoding="utf-8")
    assert "-m venv" in ci
    assert re.search(r"sed -n 2p README\.md", ci), "CI must run the README's own test line"


@pytest.mark.timeout(600)
def test_every_extra_resolves_in_a_fresh_venv(tmp_path: Path) -> None:
    from uv import find_uv_bin

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    import torch  # the build the suite runs on: resolving must not pull another one

    pinned = tmp_path / "torch.txt"
    pinned.write_text(f"torch=={torch.__version__.split('+')[0]}\n", encoding="utf-8")
    extras = ",".join(_extras())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [find_uv_bin(), "pip", "install", "--dry-run", "--quiet", "--python", str(venv / "bin" / "python"),
         "--cache-dir", str(tmp_path / "uv-cache"),
         "-c", str(ROOT / "constraints.txt"), "-c", str(pinned), "-e", f".[{extras}]"],
        cwd=ROOT, capture_output=True, text=True, timeout=540, env=env,
    )  # fmt: skip
    assert done.returncode == 0, f"extras [{extras}] do not resolve:\n{done.stderr[-3000:]}"
