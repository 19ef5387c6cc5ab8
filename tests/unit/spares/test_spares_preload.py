"""``--spare-preload``: the modules a run names are imported by its spares before they are
ready (real fork server and spare, ``python -m flexrun.spares.spare``), so the worker handed
out finds them in ``sys.modules``; a module that fails to import is reported and the spare
still serves; the option parses from the command line and ``PET_SPARE_PRELOAD`` and refuses
what is not a module name; the agent's pools pass it, and only when named."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flexrun.agent.warm import live_pool, restart_pool
from flexrun.cli import build_parser
from flexrun.config import RunConfig, run_config_from_args
from flexrun.errors import ConfigError
from flexrun.spares.pool import WarmPool, assign
from flexrun.spares.protocol import PRELOAD_ENV

REPO_SRC = Path(__file__).resolve().parents[3] / "src"


def _cfg(argv: list[str], env: dict[str, str] | None = None) -> RunConfig:
    env = dict(env or {})
    return run_config_from_args(build_parser(env).parse_args(["run", *argv]), env)


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    # (Never run; it imports torch, so restart mode's default pool is there.)
    (tmp_path / "train.py").write_text("import torch\n")
    return "train.py"


def test_option_and_pet_variable_name_the_modules(script: str) -> None:
    assert _cfg([script]).spares.spare_preload == ()
    got = _cfg(["--spare-preload", "transformers, lightning.pytorch,", script])
    assert got.spares.spare_preload == ("transformers", "lightning.pytorch")
    env = {"PET_SPARE_PRELOAD": "accelerate"}
    assert _cfg([script], env).spares.spare_preload == ("accelerate",)


@pytest.mark.parametrize("bad", ["os;rm", "a..b", "1abc", "a b", "../x"])
def test_what_is_not_a_module_name_is_refused(script: str, bad: str) -> None:
    with pytest.raises(ConfigError, match="--spare-preload .*not a module name"):
        _cfg(["--spare-preload", bad, script])


def test_the_agents_pools_carry_the_names_only_when_given(script: str) -> None:
    for mode in ("restart", "live"):
        plain = _cfg(["--mode", mode, script])
        named = _cfg(["--mode", mode, "--spare-preload", "json.tool,wave", script])
        make = restart_pool if mode == "restart" else live_pool
        p0, p1 = make(plain), make(named)
        assert p0 is not None and p1 is not None
        assert PRELOAD_ENV not in p0.environ
        assert p1.environ[PRELOAD_ENV] == "json.tool,wave"
        assert PRELOAD_ENV not in named.worker.environ  # (the workers' environment is untouched)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "fresh"])
def test_a_preloaded_module_is_in_the_handed_out_workers_sys_modules(
    tmp_path: Path, fork_server: bool
) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    probe = f"preload_probe_{os.getpid()}"
    broken = f"preload_broken_{os.getpid()}"
    (mods / f"{probe}.py").write_text(
        "import os\nIMPORTED_IN = os.getpid()\n"
        f"open({str(tmp_path / 'imports')!r}, 'a').write(str(IMPORTED_IN) + '\\n')\n"
    )
    (mods / f"{broken}.py").write_text("raise RuntimeError('broken on purpose')\n")
    path = os.pathsep.join([str(REPO_SRC), str(mods), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, PRELOAD_ENV: f"{broken},{probe}"}
    pool = WarmPool(1, env, tmp_path / "pool", fork_server=fork_server)
    try:
        pool.fill()
        w = pool.take(wait_s=180)
        assert w is not None, "no spare became ready"
        worker = tmp_path / "w.py"
        worker.write_text(
            "import json, os, sys\n"
            f"m = sys.modules.get({probe!r})\n"
            "print(json.dumps({'loaded': m is not None, 'in': getattr(m, 'IMPORTED_IN', None),"
            f" 'pid': os.getpid(), 'broken': {broken!r} in sys.modules,"
            f" 'env': {PRELOAD_ENV!r} in os.environ}}))\n"
        )
        log_dir = tmp_path / "rank0"
        worker_env = {k: v for k, v in env.items() if k != PRELOAD_ENV}
        assign(w, env=worker_env, entry=str(worker), args=[], module=False, rank=0,
               local_rank=0, log_dir=log_dir)  # fmt: skip
        assert w.proc.wait(timeout=60) == 0, (log_dir / "stderr.log").read_text()
        out = json.loads((log_dir / "stdout.log").read_text())
    finally:
        pool.close()
    assert out["loaded"] and not out["broken"] and not out["env"]
    imports = (tmp_path / "imports").read_text().split()
    assert len(imports) == 1  # imported once, before the hand-over, not by the worker
    if fork_server:
        assert int(imports[0]) != out["pid"]  # in the zygote the spare was forked from
    else:
        assert int(imports[0]) == out["pid"]
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "pool").rglob("*.log"))
    assert f"preload of {broken} failed" in logs and "broken on purpose" in logs


def test_nothing_is_preloaded_when_none_is_named(tmp_path: Path) -> None:
    """The spare's entry point imports no module beyond torch and flexrun's own: a module
    it would find on ``sys.path`` (as a script's neighbour would be) stays unimported."""
    import subprocess

    probe = f"preload_never_{os.getpid()}"
    (tmp_path / f"{probe}.py").write_text("raise SystemExit('imported')\n")
    code = (
        "import sys, flexrun.spares.spare as s\n"
        f"assert s.preload('') == 0 and {probe!r} not in sys.modules\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_SRC), str(tmp_path)])}
    env.pop(PRELOAD_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == b"ok", done.stderr
