"""The observe commands are registered with the CLI and fail with one line, exit 2."""

from __future__ import annotations

import pytest

from flexrun.cli import build_parser, main
from flexrun.testing import MemoryStore


@pytest.mark.timeout(30)
def test_status_and_report_are_flexrun_commands_with_pet_defaults() -> None:
    ns = build_parser({"PET_RDZV_ENDPOINT": "h:1", "PET_RDZV_ID": "j"}).parse_args(
        ["report", "d1", "d2"]
    )
    assert ns.run_dir == ["d1", "d2"] and callable(ns.func)
    ns = build_parser({}).parse_args(
        ["status", "--rdzv_endpoint", "h:2", "--rdzv-id", "x", "--json", "--observe", "0"]
    )
    assert (ns.rdzv_endpoint, ns.rdzv_id, ns.json, ns.observe) == ("h:2", "x", True, 0.0)


@pytest.mark.timeout(60)
def test_status_of_an_unreachable_store_or_without_an_id_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert (
        main(
            [
                "status",
                "--rdzv-endpoint",
                "127.0.0.1:1",
                "--rdzv-id",
                "j",
                "--connect-timeout",
                "0.5",
            ]
        )
        == 2
    )
    assert main(["status", "--rdzv-endpoint", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "127.0.0.1:1" in err[0] and "--rdzv-id" in err[1]


@pytest.mark.timeout(60)
def test_status_json_of_a_job_in_a_store(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from flexrun.observe import status
    from flexrun.rendezvous.state import Keys, Member, RoundRecord

    store = MemoryStore()
    store.put(
        Keys("j").round,
        RoundRecord(number=1, state="running", members=(Member("a", "h", 2),)).encode(),
    )
    monkeypatch.setattr(status, "open_status_store", lambda settings: store)
    assert (
        main(["status", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--json", "--observe", "0"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["round"] == 1 and out["members"][0]["ranks"] == [0, 1]
    assert main(["status", "--rdzv-endpoint", "h:1", "--rdzv-id", "nope", "--observe", "0"]) == 2
