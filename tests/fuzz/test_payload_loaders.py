"""Issue 18's four-opcode pickle payload against every loader of outside files and records
that the sharded-checkpoint tests (tests/unit/train/test_train_checkpoint_safety.py: DCP
``.metadata``, manifests, ``latest``, ``fence.json``, data files) do not cover: the
pipeline state file, spares exit records, event logs (report and the metrics follower),
the rendezvous and live-mode store records and the signed store. Each refuses it (a clear
error, or skips it) and the marker directory the payload would create never exists.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from fuzz_support import four_opcode_payload

from flexrun.errors import RendezvousError
from flexrun.live_protocol import EpochRecord, MemberReport, NodeWorkers
from flexrun.observe.analysis import load_events
from flexrun.observe.metrics import EventFollower
from flexrun.rendezvous.state import Claim, MasterRecord, NodeRecord, RoundRecord, Slice
from flexrun.spares.protocol import parse_assignment, parse_handover, read_returncode
from flexrun.store.signed import SignedStore
from flexrun.testing import MemoryStore

pytestmark = pytest.mark.timeout(120)
SRC = Path(__file__).resolve().parents[2] / "src"


def test_the_payload_is_live(tmp_path: Path) -> None:
    pickle.loads(four_opcode_payload(tmp_path / "ran"))
    assert (tmp_path / "ran").is_dir()


def test_store_records_refuse_the_payload(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = four_opcode_payload(marker)
    for decode in (
        NodeRecord.decode,
        Slice.decode,
        RoundRecord.decode,
        Claim.decode,
        MasterRecord.decode,
    ):
        with pytest.raises(RendezvousError):
            decode(payload)
    for live in (EpochRecord.decode, NodeWorkers.decode, MemberReport.decode):
        with pytest.raises(ValueError):
            live(payload)
    inner = MemoryStore()
    inner.put("flexrun/j/s/round", payload)
    assert SignedStore(inner, b"k" * 32).get("flexrun/j/s/round") is None
    assert not marker.exists()


def test_spares_messages_and_exit_records_refuse_the_payload(tmp_path: Path) -> None:
    from flexrun.errors import SparesProtocolError

    marker = tmp_path / "pwned"
    payload = four_opcode_payload(marker)
    record = tmp_path / "spare.exit"
    record.write_bytes(payload)
    assert read_returncode(record) is None
    for parse in (parse_assignment, parse_handover):
        with pytest.raises(SparesProtocolError):
            parse(payload)
    assert not marker.exists()


def test_event_logs_skip_the_payload(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (tmp_path / "events.jsonl").write_bytes(
        b'{"ts": 1.0, "event": "node_joined", "round": 0}\n' + four_opcode_payload(marker) + b"\n"
    )
    skipped: list[int] = []
    assert [e["event"] for e in load_events([tmp_path], skipped=skipped)] == ["node_joined"]
    assert skipped[0] >= 1  # (the payload's GLOBAL opcode holds newlines: several lines)
    follower = EventFollower(tmp_path, lambda e: None)
    assert follower.poll() == 1 and follower.skipped == skipped[0]
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_a_pipeline_state_file_holding_the_payload_is_one_clear_line(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    run.mkdir()
    (run / "pipeline-state.json").write_bytes(four_opcode_payload(marker))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = str(SRC)
    res = subprocess.run(
        [sys.executable, "-m", "flexrun", "pipeline", "status", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "not a pipeline state file" in res.stderr
    assert not marker.exists()
