"""No worker and no warm spare gets a secret's value in its environment (issue 33):
restart mode, live mode and both warm pools."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.agent.spec import without_secrets
from flexrun.agent.warm import live_pool, restart_pool
from flexrun.cli import build_parser
from flexrun.config import run_config_from_args

pytestmark = pytest.mark.timeout(60)
SECRETS = {"FLEXRUN_JOB_SECRET": "v" * 40, "FLEXRUN_ETCD_PASSWORD": "pw"}


@pytest.mark.parametrize("mode", ["restart", "live"])
def test_warm_spares_start_without_the_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    env = {"PATH": "/usr/bin", "KEEP": "1", **SECRETS}
    argv = ["run", "--standalone", "--mode", mode, "--warm-spares", "1", "train.py"]
    config = run_config_from_args(build_parser(env).parse_args(argv), env)
    assert config.worker.environ.get("FLEXRUN_JOB_SECRET")  # the agent has it ...
    pool = restart_pool(config) if mode == "restart" else live_pool(config)
    assert pool is not None
    assert pool.environ["KEEP"] == "1"
    assert not set(SECRETS) & set(pool.environ)  # ... its spares do not


def test_without_secrets_keeps_everything_else() -> None:
    env = {"A": "1", "FLEXRUN_JOB_SECRET_FILE": "/p", **SECRETS}
    assert without_secrets(env) == {"A": "1", "FLEXRUN_JOB_SECRET_FILE": "/p"}
