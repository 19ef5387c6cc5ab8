"""Checkpoints on S3 (issue 19), against a real S3 API server (moto's server mode):
save/load, fallback past corrupted or missing objects, objects without a manifest,
retention, fencing with conditional writes, multipart uploads that fail or are killed,
and sharded (DCP) checkpoints."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_support import PART_BYTES, S3

from flexrun.errors import CheckpointError, FencedError, PreconditionFailed
from flexrun.events import read_events
from flexrun.train import Checkpointer, ShardedCheckpointer
from flexrun.train.context import single_process_context
from flexrun.train.objstore import open_object_store
from flexrun.train.objstore_s3 import S3ObjectStore

pytestmark = pytest.mark.timeout(120)


class Big:
    """State of ``n`` float32 values, all equal to the step it was set to."""

    def __init__(self, n: int) -> None:
        self.t = torch.zeros(n)

    def set(self, step: int) -> None:
        self.t.fill_(step)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"].clone()


def _ctx(tmp_path: Path, *, round: int = 0, run: str = "local") -> Any:
    ctx = single_process_context(run_dir=str(tmp_path / "run"), round=round)
    return dataclasses.replace(ctx, run_id=run)


def _ck(s3: S3, prefix: str, tmp_path: Path, **kw: Any) -> Checkpointer:
    ctx = _ctx(tmp_path, round=kw.pop("round", 0), run=kw.pop("run", "local"))
    return Checkpointer(s3.url(prefix), storage_options=s3.options, ctx=ctx, **kw)


def _data_key(s3: S3, prefix: str, step: int, name: str) -> str:
    manifest = json.loads(s3.read(f"{prefix}/step_{step}/manifest.json"))
    return f"{prefix}/step_{step}/{manifest['data_dir']}/{name}"


def _flip(s3: S3, key: str) -> None:
    blob = bytearray(s3.read(key))
    blob[len(blob) // 2] ^= 0x01
    s3.write(key, bytes(blob))


def test_save_and_load_write_data_under_the_step_prefix_and_the_manifest_last(
    s3: S3, tmp_path: Path
) -> None:
    m = torch.nn.Linear(8, 4)
    big = Big(3 * PART_BYTES // 4)  # 15 MiB: a three-part multipart upload
    c = _ck(s3, "job", tmp_path)
    c.register("model", m)
    c.register("big", big)
    big.set(5)
    c.save(5, extra={"epoch": 1})
    c.wait()
    keys = s3.keys("job/")
    manifest = json.loads(s3.read("job/step_5/manifest.json"))
    attempt = manifest["data_dir"]
    assert attempt.startswith("r0-")
    assert keys == sorted(
        ["job/fence.json", "job/latest", "job/step_5/manifest.json"]
        + [f"job/step_5/{attempt}/{n}" for n in ("model.pt", "big.pt", "extra.pt", "rng.pt")]
    )
    assert set(manifest["files"]) == {"model.pt", "big.pt", "extra.pt", "rng.pt"}
    assert s3.read("job/latest") == b"step_5"
    head = s3.client.head_object(Bucket=s3.bucket, Key=f"job/step_5/{attempt}/big.pt")
    assert head["ETag"].strip('"').endswith("-3")  # really multipart
    assert head["ContentLength"] == manifest["files"]["big.pt"]["size"]
    assert s3.uploads() == []
    want = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    big.set(0)
    loaded = c.load()
    assert loaded is not None and loaded.step == 5 and loaded.extra == {"epoch": 1}
    assert torch.equal(m.weight, want) and bool((big.t == 5).all())
    c.close()


def test_a_corrupted_or_missing_object_falls_back_to_the_previous_checkpoint(
    s3: S3, tmp_path: Path
) -> None:
    big = Big(1000)
    c = _ck(s3, "job", tmp_path)
    c.register("big", big)
    for step in (1, 2, 3):
        big.set(step)
        c.save(step, blocking=True)
    _flip(s3, _data_key(s3, "job", 3, "big.pt"))
    s3.client.delete_object(Bucket=s3.bucket, Key=_data_key(s3, "job", 2, "extra.pt"))
    big.set(0)
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (3, 2)
    assert bool((big.t == 1).all())
    reasons = [
        e["reason"] for e in read_events(tmp_path / "run") if e["event"] == "checkpoint_fallback"
    ]
    assert "sha256 mismatch" in reasons[0] and "missing" in reasons[1]


def test_objects_no_manifest_names_are_ignored_and_removed_by_the_next_writer(
    s3: S3, tmp_path: Path
) -> None:
    big = Big(1000)
    c = _ck(s3, "job", tmp_path)
    c.register("big", big)
    big.set(1)
    c.save(1, blocking=True)
    s3.write("job/step_3/r0-0123456789ab/big.pt", b"torn")  # a writer killed mid-save
    s3.write("job/step_1/r0-ba9876543210/big.pt", b"torn")  # a failed re-save of step 1
    assert c.steps() == [1]
    again = _ck(s3, "job", tmp_path, round=1)  # the next round's writer cleans up
    again.register("big", big)
    assert not [k for k in s3.keys("job/") if "0123456789ab" in k or "ba9876543210" in k]
    big.set(0)
    loaded = again.load()
    assert loaded is not None and loaded.step == 1 and bool((big.t == 1).all())


def test_retention_deletes_whole_checkpoints_and_counts_only_those_that_verify(
    s3: S3, tmp_path: Path
) -> None:
    big = Big(1000)
    c = _ck(s3, "job", tmp_path, keep_last=2)
    c.register("big", big)
    for step in range(1, 6):
        big.set(step)
        c.save(step)
    c.close()
    assert c.steps() == [4, 5]
    assert {k.split("/")[1] for k in s3.keys("job/step_")} == {"step_4", "step_5"}
    # A corrupt newest checkpoint is not counted: one more save leaves two GOOD ones.
    _flip(s3, _data_key(s3, "job", 5, "big.pt"))
    fresh = _ck(s3, "job", tmp_path, keep_last=2, round=1)
    fresh.register("big", big)
    loaded = fresh.load()
    assert loaded is not None and loaded.step == 4
    big.set(6)
    fresh.save(6, blocking=True)
    assert fresh.steps() == [4, 6]
    for step in (6, 4):
        assert fresh.load(step=step) is not None and bool((big.t == step).all())


def test_a_straggler_of_an_older_round_never_overwrites_a_newer_rounds_checkpoint(
    s3: S3, tmp_path: Path
) -> None:
    big = Big(1000)
    old = _ck(s3, "job", tmp_path, round=1)
    old.register("big", big)
    big.set(10)
    old.save(10, blocking=True)
    old_attempt = json.loads(s3.read("job/step_10/manifest.json"))["data_dir"]
    new = _ck(s3, "job", tmp_path, round=2)  # the new round claims the directory
    new.register("big", big)
    big.set(100)
    new.save(10, blocking=True)  # and re-saves step 10: the manifest is replaced by CAS
    manifest = json.loads(s3.read("job/step_10/manifest.json"))
    assert manifest["round"] == 2 and manifest["data_dir"] != old_attempt
    assert not [k for k in s3.keys("job/step_10/") if old_attempt in k]  # replaced, deleted
    with pytest.raises(CheckpointError, match="round 2"):
        old.save(11, blocking=True)  # fenced before it writes anything
    assert new.steps() == [10] and not s3.keys("job/step_11/")

    # A straggler that passed its fence check just before the new round wrote the same
    # step: its conditional manifest write loses, the new round's checkpoint stands.
    def fence(generation: int) -> None:
        record = {"generation": generation, "round": generation, "run": "local"}
        s3.write("job/fence.json", json.dumps(record).encode())

    def race(stage: str) -> None:
        if stage == "fence_checked":  # the straggler checked: now round 2 comes back
            fence(2)
            big.set(12)
            new.save(12, blocking=True)
            big.set(-1)

    late = _ck(s3, "job", tmp_path, round=2)
    late.register("big", big)
    fence(1)  # as if the straggler had checked before round 2 claimed the directory
    straggler = _ck(s3, "job", tmp_path, round=1, fault_hook=race)
    straggler.register("big", big)
    big.set(-1)
    with pytest.raises(FencedError, match="round 2"):
        straggler.save(12, blocking=True)
    assert json.loads(s3.read("job/step_12/manifest.json"))["round"] == 2
    loaded = late.load(step=12)
    assert loaded is not None and bool((big.t == 12).all())

    with pytest.raises(FencedError):  # an older round cannot even claim the directory
        _ck(s3, "job", tmp_path, round=1)
    # A new run of the job (its rounds start again at 0) takes the next epoch; from then
    # on every writer of the previous run is fenced.
    rerun = _ck(s3, "job", tmp_path, round=0, run="job-2")
    rerun.register("big", big)
    rerun.save(13, blocking=True)
    with pytest.raises(CheckpointError, match="epoch 1"):
        new.save(14, blocking=True)


def test_conditional_writes_are_enforced_by_the_server(s3: S3) -> None:
    store, root = open_object_store(s3.url("cas"), s3.options)
    assert isinstance(store, S3ObjectStore) and store.conditional
    key = f"{root}/k"
    first = store.put(key, b"1", if_absent=True)
    with pytest.raises(PreconditionFailed):
        store.put(key, b"2", if_absent=True)
    second = store.put(key, b"3", if_match=first)
    with pytest.raises(PreconditionFailed):
        store.put(key, b"4", if_match=first)  # stale etag
    assert store.get(key) == (b"3", second)
    assert not store.delete_if_match(key, first) and store.delete_if_match(key, second)
    assert store.get(key) is None


def test_a_failed_multipart_upload_is_aborted_and_the_save_leaves_nothing(
    s3: S3, tmp_path: Path
) -> None:
    class FailingStore(S3ObjectStore):
        armed = False

        def upload(self, path: str, writer: Any) -> tuple[int, str]:
            if not self.armed:
                return super().upload(path, writer)

            def failing(f: Any) -> None:
                f.write(b"x" * (2 * PART_BYTES + 1000))  # two parts are uploaded
                raise OSError(errno.EIO, "connection reset by the store")

            return super().upload(path, failing)

    fs_store, root = open_object_store(s3.url("job"), s3.options)
    store = FailingStore(fs_store.fs)  # type: ignore[attr-defined]
    big = Big(1000)
    c = Checkpointer(root, ctx=_ctx(tmp_path), storage=store)
    c.register("big", big)
    big.set(1)
    c.save(1, blocking=True)
    store.armed = True
    big.set(2)
    c.save(2, blocking=True)  # an I/O failure of the store: counted, training goes on
    assert c.failed_saves == 1 and c.steps() == [1]
    assert s3.uploads() == []  # the multipart upload was aborted
    assert [k for k in s3.keys("job/") if k.startswith("job/step_2")] == []
    failed = [e for e in read_events(tmp_path / "run") if e["event"] == "checkpoint_save_failed"]
    assert failed and failed[0]["reason"] == "EIO" and not failed[0]["fatal"]
    store.armed = False
    big.set(0)
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and bool((big.t == 1).all())


_KILLED_UPLOAD = textwrap.dedent(
    """
    import os, signal, sys
    from flexrun.train.objstore import open_object_store
    store, root = open_object_store(sys.argv[1], {"endpoint_url": sys.argv[2],
        "client_kwargs": {"region_name": "us-east-1"}, "default_block_size": 5 << 20})
    def die(f):
        f.write(b"x" * (11 << 20))  # two parts uploaded, the upload open
        os.kill(os.getpid(), signal.SIGKILL)
    store.upload(root + "/step_7/r0-00000000aaaa/big.pt", die)
    """
)


def test_a_multipart_upload_killed_by_sigkill_is_aborted_by_the_next_writer(
    s3: S3, tmp_path: Path
) -> None:
    r = subprocess.run(
        [sys.executable, "-c", _KILLED_UPLOAD, s3.url("job"), s3.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ),
    )
    assert r.returncode == -9, r.stderr[-2000:]
    assert [u["Key"] for u in s3.uploads("job/")] == ["job/step_7/r0-00000000aaaa/big.pt"]
    _ck(s3, "job", tmp_path)  # claiming the directory cleans up
    assert s3.uploads("job/") == [] and s3.keys("job/step_7/") == []


def test_sharded_checkpoint_on_s3_commits_manifest_last_and_loads(s3: S3, tmp_path: Path) -> None:
    m = torch.nn.Linear(6, 3)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    c = ShardedCheckpointer(s3.url("dcp"), storage_options=s3.options, ctx=_ctx(tmp_path))
    c.register("model", m)
    c.save(3, extra={"k": 1})
    manifest = json.loads(s3.read("dcp/step_3/manifest.json"))
    assert manifest["meta"]["kind"] == "dcp" and ".metadata" in manifest["files"]
    assert not [k for k in s3.keys("dcp/") if k.endswith(".tmp")]
    want = m.weight.detach().clone()
    with torch.no_grad():
        m.weight.zero_()
    loaded = c.load()
    assert loaded is not None and loaded.step == 3 and loaded.extra == {"k": 1}
    assert torch.equal(m.weight, want)


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_sharded_metadata_naming_an_object_outside_the_checkpoint_is_refused_and_never_read(
    s3: S3, tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    import s3fs

    def linear(fill: float) -> torch.nn.Linear:
        m = torch.nn.Linear(3, 2)
        with torch.no_grad():
            m.weight.fill_(fill)
        return m

    other = ShardedCheckpointer(s3.url("outside"), storage_options=s3.options, ctx=_ctx(tmp_path))
    other.register("model", linear(7.0))
    other.save(5)
    outside = [k for k in s3.keys("outside/step_5/") if k.endswith(".distcp")][0]
    m = linear(1.0)
    c = ShardedCheckpointer(s3.url("dcp"), storage_options=s3.options, ctx=_ctx(tmp_path))
    c.register("model", m)
    c.save(1)
    with torch.no_grad():
        m.weight.fill_(2.0)
    c.save(2)
    manifest = json.loads(s3.read("dcp/step_2/manifest.json"))
    meta_key = f"dcp/step_2/{manifest['data_dir']}/.metadata"
    meta = pickle.loads(s3.read(meta_key))  # the test's own checkpoint
    target = f"/{s3.bucket}/{outside}" if how == "absolute" else f"../../../{outside}"
    for info in meta.storage_data.values():
        info.relative_path = target
    evil = pickle.dumps(meta)
    s3.write(meta_key, evil)
    import hashlib

    manifest["files"][".metadata"] = {"size": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    s3.write("dcp/step_2/manifest.json", json.dumps(manifest).encode())
    opened: list[str] = []
    real_open = s3fs.S3FileSystem._open

    def spy(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(path))
        return real_open(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_open", spy)
    with torch.no_grad():
        m.weight.zero_()
    loaded = c.load()
    assert loaded is not None and loaded.step == 1 and loaded.skipped == (2,)
    assert bool((m.weight == 1.0).all())
    assert not [p for p in opened if "outside" in p], opened
    falls = [
        e
        for e in read_events(tmp_path / "run" / "events.jsonl")
        if e["event"] == "checkpoint_fallback"
    ]
    assert [e["step"] for e in falls] == [2] and "outside the checkpoint" in falls[0]["reason"]
