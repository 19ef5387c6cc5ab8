"""The choice between fresh and in-place live groups, and the handle in a member's report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from flexrun.live_protocol import LiveEnv, MemberReport, worker_env
from flexrun.train.live_reconf import FRESH, RECONFIGURE, InPlaceGroups, unsupported_reason


def _env(**extra: str) -> dict[str, str]:
    env = worker_env(store=("127.0.0.1", 1), worker_id="n.w1", heartbeat=Path("/x"),
        heartbeat_interval_s=0.5)  # fmt: skip
    env["FLEXRUN_RUN_ID"] = "r"
    env.update(extra)
    return env


def test_a_report_carries_its_handle_and_one_without_encodes_as_before() -> None:
    plain = MemberReport(3, True, "abc", lost_s=1.5)
    assert "handle" not in plain.encode()
    assert plain.encode() == '{"step": 3, "has_state": true, "checksum": "abc", "lost_s": 1.5}'
    with_handle = MemberReport(3, True, "abc", lost_s=1.5, handle="gloo:7:4:7:127.0.0.1:5")
    assert MemberReport.decode(with_handle.encode()) == with_handle
    assert MemberReport.decode(plain.encode()).handle is None


def test_the_in_place_path_is_on_unless_the_environment_turns_it_off() -> None:
    assert LiveEnv.from_environ(_env()).reconfigure
    assert LiveEnv.from_environ(_env(FLEXRUN_LIVE_RECONFIGURE="1")).reconfigure
    assert not LiveEnv.from_environ(_env(FLEXRUN_LIVE_RECONFIGURE="0")).reconfigure


def test_turned_off_or_without_torch_support_every_epoch_gets_a_fresh_group() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    groups = InPlaceGroups(enabled=False, timeout_s=5.0, namespace="x/",
        raw_store=lambda: None, emit=lambda kind, **f: seen.append((kind, f)))  # fmt: skip
    assert groups.path == FRESH and not groups.active
    assert seen == [("live_group_path", {"group_path": FRESH, "reason": groups.reason})]
    assert "FLEXRUN_LIVE_RECONFIGURE=0" in str(groups.reason)
    assert groups.handle() is None
    assert groups.form(2, ["a", "b"], lambda: False) is None and groups.formed == FRESH


def test_the_path_chosen_at_start_follows_what_torch_offers() -> None:
    has_api = hasattr(dist.ProcessGroupGloo, "reconfigure")
    reason = unsupported_reason(True)
    assert (reason is None) == has_api, reason
    groups = InPlaceGroups(enabled=True, timeout_s=5.0, namespace="x/", raw_store=lambda: None,
        emit=lambda kind, **f: None)  # fmt: skip
    assert groups.path == (RECONFIGURE if has_api else FRESH)
    if not has_api:
        assert "2.14" in str(reason)


@pytest.mark.skipif(unsupported_reason(True) is not None, reason="needs torch >= 2.14")
def test_an_epoch_with_a_member_that_posted_no_handle_forms_fresh() -> None:
    groups = InPlaceGroups(enabled=True, timeout_s=5.0, namespace="x/", raw_store=lambda: None,
        emit=lambda kind, **f: None)  # fmt: skip
    assert groups.form(2, ["gloo:1:-1:1:h:1", None], lambda: False) is None
    assert groups.formed == FRESH and groups.active


@pytest.mark.skipif(unsupported_reason(True) is not None, reason="needs torch >= 2.14")
@pytest.mark.timeout(60)
def test_a_reconfigure_that_fails_falls_back_to_a_fresh_group_for_good_with_an_event() -> None:
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5))
    seen: list[tuple[str, dict[str, Any]]] = []
    groups = InPlaceGroups(enabled=True, timeout_s=1.0, namespace="x/", raw_store=lambda: store,
        emit=lambda kind, **f: seen.append((kind, f)))  # fmt: skip
    mine = groups.handle()
    assert mine is not None and mine.startswith("gloo:")
    # A member that never comes: the re-form cannot complete within the timeout.
    assert groups.form(3, [mine, "gloo:999:-1:999:127.0.0.1:1"], lambda: False) is None
    assert [k for k, _ in seen] == ["live_group_path", "live_group_fallback"]
    assert seen[-1][1]["group_path"] == FRESH and not groups.active
    assert groups.handle() is None and groups.formed == FRESH
