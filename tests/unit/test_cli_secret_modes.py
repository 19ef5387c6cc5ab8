"""Issue 18, "job authentication": where the job secret comes from for each kind of run.

``--standalone`` (restart mode) signs its records with a secret generated for the run; a
multi-node run takes the one it is given, from a file or the environment; live mode with
a secret is refused with one line (its workers cannot sign yet), and a secret value on
the command line is refused (it would show in ``ps``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.cli import build_parser
from flexrun.config import RunConfig, run_config_from_args
from flexrun.errors import ConfigError


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def cfg(argv: list[str], env: dict[str, str] | None = None) -> RunConfig:
    env = dict(env or {})
    return run_config_from_args(build_parser(env).parse_args(["run", *argv]), env)


def test_standalone_runs_get_a_fresh_generated_secret(script: str) -> None:
    a, b = cfg(["--standalone", script]), cfg(["--standalone", script])
    assert a.store.secret and b.store.secret and a.store.secret != b.store.secret
    assert len(a.store.secret) >= 32


def test_a_multi_node_run_signs_with_the_secret_it_is_given_and_only_then(
    script: str, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    multi = ["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "j", script]
    assert cfg(multi).store.secret is None  # runs, and the agents warn (test_store_auth)
    given = cfg(multi, {"FLEXRUN_JOB_SECRET_FILE": str(secret)}).store.secret
    assert given is not None and bytes(given) == bytes(
        cfg(["--rdzv-conf", f"secret_file={secret}", *multi]).store.secret or b""
    )


def test_live_mode_takes_a_secret_and_a_secret_on_the_command_line_is_refused(
    script: str, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    secret.chmod(0o600)
    given = cfg(
        ["--mode", "live", "--standalone", script], {"FLEXRUN_JOB_SECRET_FILE": str(secret)}
    )
    assert given.store.secret == b"ab" * 32
    generated = cfg(["--mode", "live", "--standalone", script]).store.secret
    assert generated is not None and len(generated) == 64  # one per standalone run, as restart
    with pytest.raises(ConfigError, match="secret"):
        cfg(["--rdzv-conf", "secret=" + "ab" * 32, "--standalone", script])
