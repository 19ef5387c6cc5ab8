"""Nothing read from a checkpoint directory can run code (issue 18): DCP metadata through
an exact allow-list, manifests, ``latest`` and ``fence.json`` as JSON or text only; and
retention counts only checkpoints that verify."""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from flexrun.errors import CheckpointError
from flexrun.events import EventLog, read_events
from flexrun.train import Checkpointer
from flexrun.train.commit import RenameCommit
from flexrun.train.context import single_process_context
from flexrun.train.sharded import (
    METADATA_GLOBALS,
    ShardedCheckpointer,
    _SafeReader,
    read_safe_metadata,
)


def four_opcode_payload(
    marker: Path, module: str = "torch.distributed.checkpoint.filesystem"
) -> bytes:
    """GLOBAL <module> os.mkdir, BINUNICODE <path>, TUPLE1, REDUCE (after the protocol-4
    header that lets a global be a dotted name; then STOP): calls ``os.mkdir(marker)``
    when unpickled, reaching ``os`` through a DCP module."""
    path = str(marker).encode()
    return (
        b"\x80\x04"
        + b"c"
        + module.encode()
        + b"\nos.mkdir\n"
        + b"X"
        + struct.pack("<I", len(path))
        + path
        + b"\x85R."
    )


def test_the_payload_is_real_plain_pickle_runs_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(four_opcode_payload(marker))
    assert marker.exists()


def test_dcp_metadata_payload_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(
        CheckpointError, match="refused global torch.distributed.checkpoint.filesystem.os.mkdir"
    ):
        read_safe_metadata(four_opcode_payload(marker))
    assert not marker.exists()
    # Any other DCP module, and a plain global outside the list, are refused the same way.
    for module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.api"):
        with pytest.raises(CheckpointError, match="refused global"):
            read_safe_metadata(four_opcode_payload(marker, module))
    assert not marker.exists()
    assert all("." not in name for _module, name in METADATA_GLOBALS)  # no dotted names


def test_a_sharded_checkpoint_whose_metadata_is_the_payload_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    c = ShardedCheckpointer(root, ctx=single_process_context())
    c.register("model", m)
    c.register("optim", opt)
    c.save(1)  # a real checkpoint with optimizer state loads through the allow-list
    assert c.load() is not None
    step = root / "step_1"
    marker = tmp_path / "pwned"
    evil = four_opcode_payload(marker)
    (step / ".metadata").write_bytes(evil)
    _rehash(step, ".metadata", evil)  # the manifest verifies: only the allow-list stops it
    with pytest.raises(CheckpointError, match="refused global"):
        c.load()
    assert not marker.exists()


def _rehash(step: Path, name: str, blob: bytes) -> None:
    import hashlib
    import json

    man = json.loads((step / "manifest.json").read_text())
    man["files"][name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(man))


@pytest.fixture(params=["local", "memory"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "ck") if request.param == "local" else f"memory://ck-{uuid.uuid4().hex}"


class _State:
    def __init__(self) -> None:
        self.t = torch.zeros(10)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t = state["t"].clone()


def _ck(where: str, round: int = 0, **kw: Any) -> tuple[Checkpointer, _State]:
    c = Checkpointer(where, ctx=single_process_context(round=round), **kw)
    s = _State()
    c.register("state", s)
    return c, s


def _put(c: Checkpointer, rel: str, data: bytes) -> None:
    proto = c._proto
    if isinstance(proto, RenameCommit):
        path = Path(proto.path(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        proto.store.put(proto.store.join(proto.root, rel), data)  # type: ignore[attr-defined]


def _data_name(c: Checkpointer, step: int, name: str) -> str:
    data_dir = c._proto.read_manifest(step).data_dir
    return f"step_{step}/{data_dir}/{name}" if data_dir else f"step_{step}/{name}"


def test_payloads_in_manifest_latest_fence_and_data_files_run_nothing(
    where: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    payload = four_opcode_payload(marker)
    c, s = _ck(where)
    for step in (1, 2, 3):
        s.t.fill_(step)
        c.save(step, blocking=True)
    _put(c, "step_3/manifest.json", payload)  # a manifest is JSON: refused as malformed
    _put(c, _data_name(c, 2, "state.pt"), payload)  # a data file: weights_only refuses it
    _put(c, "latest", payload)  # a pointer is a hint: ignored
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (3, 2)
    assert c._proto.read_latest() is None
    _put(c, "fence.json", payload)  # the fence is JSON: a clear error
    with pytest.raises(CheckpointError, match="fence record .* malformed"):
        _ck(where, round=1)
    assert not marker.exists()


@pytest.mark.parametrize("fresh", [True, False], ids=["after-restart", "same-writer"])
def test_retention_with_a_corrupt_newest_checkpoint_keeps_two_good_ones(
    where: str, fresh: bool
) -> None:
    c, s = _ck(where, keep_last=2)
    for step in (10, 20):
        s.t.fill_(step)
        c.save(step, blocking=True)
    name = _data_name(c, 20, "state.pt")
    blob = bytearray(b"".join(c._proto.read_chunks(20, c._proto.read_manifest(20), "state.pt")))
    blob[len(blob) // 2] ^= 0xFF
    _put(c, name, bytes(blob))
    if fresh:
        c, s = _ck(where, round=1, keep_last=2)
    s.t.fill_(30)
    c.save(30, blocking=True)
    assert c.steps() == [10, 30]  # the corrupt 20 was not counted (and is gone)
    for step in (30, 10):
        loaded = c.load(step=step)
        assert loaded is not None and loaded.skipped == () and bool((s.t == step).all())


def test_the_only_good_checkpoint_is_never_removed(where: str) -> None:
    c, s = _ck(where, keep_last=1)
    s.t.fill_(1)
    c.save(1, blocking=True)
    assert c.steps() == [1]
    c2, _ = _ck(where, round=1, keep_last=1)
    assert c2.steps() == [1] and c2.load() is not None


def _aim_metadata_at(blob: bytes, target: str) -> bytes:
    """The same DCP metadata, every storage entry naming ``target`` instead of its file."""
    meta = pickle.loads(blob)  # the test's own checkpoint: plain pickle is fine here
    for info in meta.storage_data.values():
        info.relative_path = target
    return pickle.dumps(meta)


def _linear(fill: float) -> torch.nn.Linear:
    m = torch.nn.Linear(3, 2)
    with torch.no_grad():
        m.weight.fill_(fill)
        m.bias.fill_(fill)
    return m


_OPENED: list[str] = []
_WATCHING: list[bool] = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _WATCHING[0] and args and isinstance(args[0], (str, bytes, Path)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # (hooks cannot be removed; this one records only while watching)


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_dcp_metadata_naming_a_path_outside_the_checkpoint_is_refused_and_never_opened(
    tmp_path: Path, how: str
) -> None:
    outside_root = tmp_path / "outside"
    other = ShardedCheckpointer(outside_root, ctx=single_process_context())
    other.register("model", _linear(7.0))
    other.save(5)
    outside = outside_root / "step_5" / "__0_0.distcp"
    assert outside.is_file()
    root = tmp_path / "ck"
    log = EventLog(tmp_path / "run", run_id="r")
    c = ShardedCheckpointer(root, ctx=single_process_context(), events=log)
    m = _linear(1.0)
    c.register("model", m)
    c.save(1)
    with torch.no_grad():
        m.weight.fill_(2.0)
    c.save(2)
    step = root / "step_2"
    target = str(outside) if how == "absolute" else "../../outside/step_5/__0_0.distcp"
    evil = _aim_metadata_at((step / ".metadata").read_bytes(), target)
    (step / ".metadata").write_bytes(evil)
    _rehash(step, ".metadata", evil)  # the manifest verifies: only the path check stops it
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        read_safe_metadata(evil)
    with torch.no_grad():
        m.weight.zero_()
    _OPENED.clear()
    _WATCHING[0] = True
    try:
        loaded = c.load()
    finally:
        _WATCHING[0] = False
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,)
    assert bool((m.weight == 1.0).all())  # the older checkpoint's weights, not the outside 7s
    opened = [os.path.realpath(p) for p in _OPENED]
    assert str(outside.resolve()) not in opened, opened
    assert not any(p.startswith(str(outside_root.resolve())) for p in opened), opened
    falls = [
        e
        for e in read_events(tmp_path / "run" / "events.jsonl")
        if e["event"] == "checkpoint_fallback"
    ]
    assert [e["step"] for e in falls] == [2] and "outside the checkpoint" in falls[0]["reason"]


def test_every_reader_checks_the_metadata_paths_itself(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    c = ShardedCheckpointer(root, ctx=single_process_context())
    c.register("model", _linear(1.0))
    c.save(1)
    step = root / "step_1"
    (step / ".metadata").write_bytes(
        _aim_metadata_at((step / ".metadata").read_bytes(), "/etc/hostname")
    )
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        _SafeReader(step).read_metadata()


def test_dcp_metadata_naming_a_file_the_manifest_does_not_list_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    c = ShardedCheckpointer(root, ctx=single_process_context())
    c.register("model", _linear(1.0))
    c.save(1)
    blob = (root / "step_1" / ".metadata").read_bytes()
    files = json.loads((root / "step_1" / "manifest.json").read_text())["files"]
    read_safe_metadata(blob, files=files)
    with pytest.raises(CheckpointError, match="manifest does not list"):
        read_safe_metadata(_aim_metadata_at(blob, "__9_0.distcp"), files=files)


@pytest.mark.parametrize("name", ["../x.pt", "/etc/passwd", "a/b.pt", "..", ""])
def test_a_manifest_naming_a_path_outside_its_step_is_refused(tmp_path: Path, name: str) -> None:
    from flexrun.train.layout import Manifest

    man = Manifest(step=1, round=0, world_size=1, created=0.0, files={}).to_json()
    d = json.loads(man)
    d["files"] = {name: {"size": 1, "sha256": "0" * 64}}
    with pytest.raises(CheckpointError, match="plain file name"):
        Manifest.from_json(json.dumps(d).encode())
    d["files"] = {}
    d["data_dir"] = name or "/"
    with pytest.raises(CheckpointError, match="plain file name"):
        Manifest.from_json(json.dumps(d).encode())
