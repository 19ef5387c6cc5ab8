"""Paths a pipeline writes stay strictly below the run directory (issue 18, point 3).

Refused at validation time (parse: absolute, ``.``, ``..``; before a run: symlinks out of
the tree), and the one removal the runner does re-checks at the moment it removes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from flexrun.errors import SpecError
from flexrun.pipeline.paths import check_relative, remove_below, resolve_below
from flexrun.pipeline.runner import check_paths
from flexrun.pipeline.spec import parse_pipeline
from flexrun.pipeline.state import StateFile

pytestmark = pytest.mark.timeout(30)


def _pipeline(train: dict[str, Any] | None = None, **stage: Any) -> Any:
    st: dict[str, Any] = {"name": "t", **stage}
    if train is not None:
        st["train"] = {"script": "t.py", **train}
    else:
        st.setdefault("command", "echo hi")
    return parse_pipeline({"name": "p", "stages": [st]}, base_dir=Path("/tmp"))


@pytest.mark.parametrize(
    "value",
    ["/", "/etc", "/tmp/ckpt", ".", "./", "./.", "..", "../x", "a/../../b", "a/.."],
)
def test_checkpoint_dir_escaping_or_naming_the_run_dir_is_refused_with_the_field(
    value: str,
) -> None:
    with pytest.raises(SpecError) as info:
        _pipeline(train={"checkpointDir": value})
    msg = str(info.value)
    assert msg.startswith("stages.t.train.checkpointDir: "), msg
    assert repr(value) in msg and "\n" not in msg


@pytest.mark.parametrize("value", ["/abs/out", ".", "..", "x/../../y"])
def test_outputs_escaping_or_naming_the_run_dir_are_refused(value: str) -> None:
    with pytest.raises(SpecError, match=r"^stages\.t\.outputs\[0\]: "):
        _pipeline(outputs=[value])


def test_relative_inputs_must_stay_inside_but_absolute_ones_are_read_only_data() -> None:
    with pytest.raises(SpecError, match=r"^stages\.t\.inputs\[0\]: '\.\./data'"):
        _pipeline(inputs=["../data"])
    p = _pipeline(inputs=["/datasets/imagenet", "{pipeline_dir}/prep.py", "data/x"])
    assert p.stages[0].inputs == ("/datasets/imagenet", "{pipeline_dir}/prep.py", "data/x")


def test_normal_paths_are_accepted_and_normalized() -> None:
    assert check_relative("ckpt", "w") == "ckpt"
    assert check_relative("./runs/ckpt/", "w") == "runs/ckpt"
    p = _pipeline(train={"checkpointDir": "state/ckpt"}, outputs=["model"])
    assert p.stages[0].train is not None and p.stages[0].train.checkpoint_dir == "state/ckpt"


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    return {"run": run, "outside": outside}


def test_a_symlink_out_of_the_run_dir_is_refused_before_a_run(tree: dict[str, Path]) -> None:
    (tree["run"] / "ckpt").symlink_to(tree["outside"])
    with pytest.raises(SpecError, match=r"stages\.t\.train\.checkpointDir: 'ckpt' resolves to"):
        check_paths(_pipeline(train={"checkpointDir": "ckpt"}), tree["run"], {})
    (tree["run"] / "parent").symlink_to(tree["outside"])
    with pytest.raises(SpecError, match=r"stages\.t\.outputs\[0\]: 'parent/model'"):
        check_paths(_pipeline(outputs=["parent/model"]), tree["run"], {})
    with pytest.raises(SpecError, match=r"stages\.t\.inputs\[0\]: 'parent/in'"):
        check_paths(_pipeline(inputs=["parent/in"]), tree["run"], {})
    assert (tree["outside"] / "precious.txt").read_text() == "keep me"


def test_a_run_dir_that_is_itself_a_symlink_is_fine(tree: dict[str, Path], tmp_path: Path) -> None:
    link = tmp_path / "link-to-run"
    link.symlink_to(tree["run"])
    check_paths(_pipeline(train={"checkpointDir": "ckpt"}, outputs=["m"]), link, {})
    assert resolve_below(link, "ckpt", "w") == tree["run"].resolve() / "ckpt"


def test_remove_below_removes_inside_and_nothing_else(tree: dict[str, Path]) -> None:
    ckpt = tree["run"] / "ckpt" / "step_1"
    ckpt.mkdir(parents=True)
    (ckpt / "w.pt").write_bytes(b"x")
    assert remove_below(tree["run"], "ckpt", "w") is True
    assert not (tree["run"] / "ckpt").exists() and tree["run"].is_dir()
    assert remove_below(tree["run"], "ckpt", "w") is False  # nothing there any more


@pytest.mark.parametrize("path", [".", "", "..", "/", "../outside"])
def test_remove_below_never_removes_the_run_dir_or_above(tree: dict[str, Path], path: str) -> None:
    with pytest.raises(SpecError):
        remove_below(tree["run"], path, "w")
    assert tree["run"].is_dir() and (tree["outside"] / "precious.txt").exists()


def test_remove_below_refuses_a_symlink_planted_out_of_the_tree(tree: dict[str, Path]) -> None:
    (tree["run"] / "ckpt").symlink_to(tree["outside"])
    with pytest.raises(SpecError, match="not inside the run directory"):
        remove_below(tree["run"], "ckpt", "stages.t.train.checkpointDir")
    assert (tree["outside"] / "precious.txt").read_text() == "keep me"
    inner = tree["run"] / "real"
    inner.mkdir()
    (inner / "f").write_text("x")
    os.remove(tree["run"] / "ckpt")
    (tree["run"] / "ckpt").symlink_to(inner)  # a link inside the tree: only the link goes
    assert remove_below(tree["run"], "ckpt", "w") is True
    assert not (tree["run"] / "ckpt").exists() and (inner / "f").exists()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x00\x01\x02binary", "a binary file"),
        (b'{"stages": {"a": "\xff\xfe"}}', "not UTF-8 text"),
        (b"[1, 2, 3]", "a JSON list, not an object"),
        (b'"just a string"', "a JSON str, not an object"),
        (b'{"version": 1, "stages": []}', "'stages' must map"),
        (b'{"version": 1, "stages": {"a": 5}}', "'stages' must map"),
        (b'{"version": 1, "stages": {}, "order": "abc"}', "'order' must be a list"),
        (b"[" * 100000, "not a pipeline state file"),
        (b'{"version": 1, "stages": {}, "n": ' + b"9" * 5000 + b"}", "not a pipeline state file"),
    ],
)
def test_a_bad_state_file_is_one_clear_error(tmp_path: Path, content: bytes, why: str) -> None:
    from flexrun.errors import ConfigError

    (tmp_path / "pipeline-state.json").write_bytes(content)
    with pytest.raises(ConfigError) as info:
        StateFile.load(tmp_path)
    msg = str(info.value)
    assert why in msg and "delete it to start over" in msg and "\n" not in msg, msg
