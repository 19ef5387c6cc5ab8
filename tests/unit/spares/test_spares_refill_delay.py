"""``flexrun spares --refill-delay``: a finite number of seconds, 0 or more (``inf`` was
accepted: issue 18, "non-finite numbers rejected everywhere a duration is parsed")."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_spares_refill_delay_must_be_a_finite_number(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flexrun.cli import main

    assert main(["spares", "--dir", str(tmp_path / "sp"), "--refill-delay", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--refill-delay" in err[0], err
    assert not (tmp_path / "sp" / "pool.sock").exists()
