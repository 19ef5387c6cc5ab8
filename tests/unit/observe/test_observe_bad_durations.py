"""Non-finite durations are refused everywhere one is parsed (issue 18): ``flexrun status``
(``--connect-timeout inf`` waited for ever), ``flexrun doctor`` and ``flexrun pipeline run``
(``--stop-grace inf`` and ``nan`` were accepted). One line, exit 2, before any connection."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrun.cli import main

STATUS = ["status", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x"]
DOCTOR = ["doctor", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*STATUS, "--connect-timeout", "inf"], "--connect-timeout"),
        ([*STATUS, "--connect-timeout", "0"], "--connect-timeout"),
        ([*STATUS, "--observe", "nan"], "--observe"),
        ([*STATUS, "--watch", "-1"], "--watch"),
        ([*STATUS, "--rdzv-conf", "connect_timeout=inf"], "connect_timeout"),
        ([*DOCTOR, "--join-timeout", "inf"], "--join-timeout"),
        ([*DOCTOR, "--inject-delay", "nan"], "--inject-delay"),
        ([*DOCTOR, "--size-mb", "inf"], "--size-mb"),
        ([*DOCTOR, "--threshold", "nan"], "--threshold"),
        ([*DOCTOR, "--iters", "0"], "--iters"),
    ],
)
def test_a_non_finite_duration_is_one_line_before_any_connection(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and needle in err[0] and "cannot reach" not in err[0], err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_pipeline_stop_grace_must_be_finite(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "p.yaml"
    spec.write_text("name: p\nstages:\n  - name: a\n    command: [touch, ran]\n")
    run = tmp_path / "run"
    assert main(["pipeline", "run", str(spec), "--run-dir", str(run), "--stop-grace", value]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "--stop-grace" in err[0], err
    assert not (run / "ran").exists()
