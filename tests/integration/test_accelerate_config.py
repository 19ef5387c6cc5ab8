"""``--accelerate-config FILE``: a script using accelerate gets under ``flexrun run`` the
configuration ``accelerate launch --config_file FILE`` gives it (mixed precision, FSDP
settings), computed by the real accelerate; a missing file, a file accelerate refuses and
an interpreter without accelerate are one clear line and exit 2."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexrun.config.accelerate import LAUNCHER_OWNED, accelerate_env
from flexrun.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

REPO_SRC = Path(__file__).resolve().parents[2] / "src"
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
needs_accelerate = pytest.mark.skipif(
    not HAVE_ACCELERATE,
    reason="accelerate is not installed (pip install 'flexrun[integrations]'; it is not in "
    "the test extra)",
)

CPU = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
mixed_precision: bf16
num_machines: 1
num_processes: 2
use_cpu: true
"""
FSDP = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: 2
fsdp_config:
  fsdp_version: 2
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Linear
"""
SCRIPT = """\
import json, os
from accelerate import Accelerator
a = Accelerator(cpu=True)
print("ACC " + json.dumps({"rank": int(os.environ["RANK"]), "mp": str(a.mixed_precision),
      "num": a.num_processes}), flush=True)
"""


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "ACCELERATE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_SRC), env.get("PYTHONPATH", "")])
    env["HF_HOME"] = str(tmp / "hf")  # (no default accelerate config of the user's)
    return env


def _flexrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flexrun", "run", "--nproc-per-node", "2", "--run-dir",
         str(tmp / f"run{len(list(tmp.glob('run*')))}"), *args],
        cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def _results(out: str) -> list[dict]:
    # Each worker's print is found by its JSON, not by line: two workers' output shares the
    # console, and where PYTHONUNBUFFERED is set a print's text and its newline are two
    # writes, so one worker's line can end after the other's.
    got = [json.loads(m) for m in re.findall(r"ACC (\{[^{}]*\})", out)]
    return sorted(got, key=lambda r: r["rank"])


@needs_accelerate
def test_the_workers_get_accelerates_mixed_precision_only_with_the_option(
    tmp_path: Path,
) -> None:
    (tmp_path / "cpu.yaml").write_text(CPU)
    (tmp_path / "acc.py").write_text(SCRIPT)
    plain = _flexrun(tmp_path, "acc.py")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert [r["mp"] for r in _results(plain.stdout)] == ["no", "no"]
    given = _flexrun(tmp_path, "--accelerate-config", "cpu.yaml", "acc.py")
    assert given.returncode == 0, given.stderr[-3000:]
    assert _results(given.stdout) == [
        {"rank": 0, "mp": "bf16", "num": 2},
        {"rank": 1, "mp": "bf16", "num": 2},
    ]


@needs_accelerate
def test_an_fsdp_config_gives_accelerates_fsdp_variables(tmp_path: Path) -> None:
    (tmp_path / "fsdp.yaml").write_text(FSDP)
    env = accelerate_env(tmp_path / "fsdp.yaml", sys.executable, _env(tmp_path))
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "Linear"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert not LAUNCHER_OWNED & set(env)


@needs_accelerate
def test_a_config_accelerate_refuses_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text(CPU.replace("bf16", "bf17"))
    (tmp_path / "acc.py").write_text(SCRIPT)
    done = _flexrun(tmp_path, "--accelerate-config", "bad.yaml", "acc.py")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--accelerate-config bad.yaml:" in done.stderr and "bf17" in done.stderr
    assert "ACC " not in done.stdout


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--accelerate-config .*nope.yaml: no such file"):
        accelerate_env(tmp_path / "nope.yaml", sys.executable, _env(tmp_path))


def test_an_interpreter_without_accelerate_is_refused(tmp_path: Path) -> None:
    """A venv with torch's interpreter but no site-packages of its own (``-I``-like: an
    empty ``PYTHONPATH`` and ``PYTHONNOUSERSITE``) cannot import accelerate."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (tmp_path / "cpu.yaml").write_text(CPU)
    with pytest.raises(ConfigError, match="accelerate is not installed for .*bare"):
        accelerate_env(tmp_path / "cpu.yaml", str(venv / "bin" / "python"), {"PATH": "/usr/bin"})
