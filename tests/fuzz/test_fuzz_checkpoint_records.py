"""Fuzz: the records of a checkpoint directory and the pipeline's state file, which a user
may copy between clusters or download: ``manifest.json``, ``fence.json``, ``latest``, DCP's
``.metadata``, ``pipeline-state.json``, the failure cause in a round record, the storage
options a launcher passes in the environment.

Property: :class:`CheckpointError` / :class:`ConfigError` (a clear line at the CLI) or a
value of the right types; never another exception, and no name in a manifest that leaves
its checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzz_support import DEEP, FEW, FUZZ, hostile_bytes, mangled, values
from hypothesis import given
from hypothesis import strategies as st

from flexrun.cause import FailureCause
from flexrun.errors import CheckpointError, ConfigError
from flexrun.pipeline.state import StateFile
from flexrun.train import STORAGE_OPTIONS_ENV, storage_options_from_env
from flexrun.train.layout import FenceRecord, Manifest, parse_fence, parse_latest
from flexrun.train.sharded import read_safe_metadata

pytestmark = pytest.mark.timeout(120)

MANIFEST = Manifest(
    step=7,
    round=2,
    world_size=4,
    created=1.5e9,
    files={"state.pt": {"size": 10, "sha256": "ab" * 32}},
    meta={"k": 1},
    data_dir="w-1",
    generation=(1 << 32) | 2,
).to_json()
FENCE = FenceRecord(generation=(3 << 32) | 1, run="r").to_json()


@FUZZ
@given(data=st.data())
def test_a_hostile_manifest_is_a_checkpoint_error_or_a_safe_manifest(data: st.DataObject) -> None:
    try:
        m = Manifest.from_json(hostile_bytes(data, MANIFEST))
    except CheckpointError as exc:
        assert str(exc)
        return
    for name in [*m.files, m.data_dir]:
        assert "/" not in name and name not in (".", "..")
    assert isinstance(m.step, int) and isinstance(m.fence_generation, int)
    assert all(isinstance(f["size"], int) for f in m.files.values())


@FUZZ
@given(data=st.data())
def test_a_hostile_fence_is_a_checkpoint_error_or_a_generation(data: st.DataObject) -> None:
    try:
        f = parse_fence(hostile_bytes(data, FENCE), "/ckpt")
    except CheckpointError as exc:
        assert "/ckpt" in str(exc)
        return
    assert isinstance(f.generation, int) and (f.run is None or isinstance(f.run, str))


@FUZZ
@given(raw=st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
def test_latest_is_a_hint_that_never_raises(raw: bytes) -> None:
    got = parse_latest(raw)
    assert got is None or (isinstance(got, int) and got >= 0)


@FEW
@given(raw=st.binary(max_size=200))
def test_dcp_metadata_of_random_bytes_is_a_checkpoint_error(raw: bytes) -> None:
    with pytest.raises(CheckpointError):
        read_safe_metadata(b"\x80\x04" + raw)


STATE = json.dumps(
    {"version": 1, "order": ["a"], "stages": {"a": {"key": "k", "status": "done"}}}
).encode()


@FUZZ
@given(data=st.data())
def test_a_hostile_pipeline_state_is_a_config_error_or_a_state(
    data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = tmp_path_factory.getbasetemp() / "pipeline-run"
    run.mkdir(exist_ok=True)
    (run / "pipeline-state.json").write_bytes(hostile_bytes(data, STATE))
    try:
        state = StateFile.load(Path(run))
    except ConfigError as exc:
        assert str(run) in str(exc) and "\n" not in str(exc)
        return
    assert isinstance(state.data["stages"], dict)


@FUZZ
@given(data=st.data())
def test_a_hostile_failure_cause_never_raises(data: st.DataObject) -> None:
    doc = FailureCause(rank=1, node="b", exit_code=3, signal="SIGKILL", message="x").to_dict()
    got = FailureCause.from_dict(mangled(data, doc))
    if got is not None:
        assert isinstance(got.exit_code, int) and isinstance(got.message, str)
        assert got.describe()


@FUZZ
@given(raw=st.text(max_size=60) | values.map(lambda v: json.dumps(v, allow_nan=True)))
def test_storage_options_from_the_environment_are_a_config_error_or_an_object(raw: str) -> None:
    try:
        got = storage_options_from_env({STORAGE_OPTIONS_ENV: raw})
    except ConfigError as exc:
        assert STORAGE_OPTIONS_ENV in str(exc)
        return
    assert isinstance(got, dict)


def test_storage_options_nested_too_deep_are_a_config_error() -> None:
    with pytest.raises(ConfigError):
        storage_options_from_env({STORAGE_OPTIONS_ENV: DEEP.decode()})
