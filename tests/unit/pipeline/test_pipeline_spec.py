"""Pipeline spec: parsing, DAG validation and the one-line errors that name the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flexrun.errors import SpecError
from flexrun.pipeline.spec import load_pipeline, parse_pipeline, substitute

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "pipeline" / "pipeline.yaml"

pytestmark = pytest.mark.timeout(30)


def _spec(*stages: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"name": "p", "stages": list(stages), **top}


def _parse(data: object) -> Any:
    return parse_pipeline(data, base_dir=Path("/tmp"))


def test_example_pipeline_loads_in_dependency_order() -> None:
    p = load_pipeline(EXAMPLE)
    assert [s.name for s in p.stages] == ["preprocess", "train", "evaluate", "export"]
    train = p.stage("train")
    assert train.train is not None and train.train.nproc_per_node == "2"
    assert train.train.checkpoint_dir == "ckpt"
    assert p.pipeline_dir == EXAMPLE.parent.resolve()
    assert p.downstream("preprocess") == ["train", "evaluate", "export"]
    assert p.downstream("evaluate") == ["export"]


def test_producers_of_inputs_become_dependencies_and_order_follows() -> None:
    p = _parse(
        _spec(
            {"name": "b", "command": "x", "inputs": ["out/a.txt"]},
            {"name": "a", "command": "y", "outputs": ["out"]},
        )
    )
    assert [s.name for s in p.stages] == ["a", "b"]
    assert p.stage("b").deps == ("a",)


def test_cycle_is_one_error_naming_the_loop() -> None:
    with pytest.raises(SpecError, match=r"dependency cycle: .*a.*b.*a|dependency cycle: .*b.*a.*b"):
        _parse(
            _spec(
                {"name": "a", "command": "x", "deps": ["b"]},
                {"name": "b", "command": "y", "deps": ["a"]},
            )
        )


def test_cycle_through_inputs_and_outputs_is_detected() -> None:
    with pytest.raises(SpecError, match="dependency cycle"):
        _parse(
            _spec(
                {"name": "a", "command": "x", "inputs": ["b.txt"], "outputs": ["a.txt"]},
                {"name": "b", "command": "y", "inputs": ["a.txt"], "outputs": ["b.txt"]},
            )
        )


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            [{"name": "a", "command": "x", "deps": ["nope"]}],
            r"stages\.a\.deps: unknown stage 'nope'",
        ),
        ([{"name": "a", "command": "x", "deps": ["a"]}], "cannot depend on itself"),
        ([{"name": "a"}], r"stages\.a: set exactly one of command and train"),
        (
            [{"name": "a", "command": "x", "train": {"script": "t.py"}}],
            "exactly one of command and train",
        ),
        ([{"name": "a", "command": "x", "retries": -1}], r"stages\.a\.retries"),
        ([{"name": "a", "command": "x", "timeout": 0}], r"stages\.a\.timeout"),
        ([{"name": "a", "command": "x", "colour": "red"}], r"stages\.a\.colour: unknown field"),
        ([{"name": "A_b", "command": "x"}], r"stages\[0\]\.name"),
        ([{"command": "x"}], r"stages\[0\]\.name: is required"),
        (
            [{"name": "a", "command": "x"}, {"name": "a", "command": "y"}],
            "duplicate stage name",
        ),
        (
            [
                {"name": "a", "command": "x", "outputs": ["o"]},
                {"name": "b", "command": "y", "outputs": ["o/"]},
            ],
            "also an output of stage 'a'",
        ),
        ([{"name": "a", "command": "x", "inputs": ["o"], "outputs": ["o"]}], "own output"),
        ([{"name": "a", "command": "x", "outputs": ["../escape"]}], "inside the run directory"),
        ([{"name": "a", "train": {"args": ["x"]}}], r"stages\.a\.train\.script: is required"),
        ([{"name": "a", "train": {"script": "t.py", "nnodes": "two"}}], "N or MIN:MAX"),
        ([{"name": "a", "command": "x", "env": {"1BAD": "v"}}], "environment variable name"),
        ([{"name": "a", "command": ["ok", {"no": 1}]}], r"stages\.a\.command\[1\]"),
        ([{"name": "a", "command": "{pyhton} x.py"}], r"stages\.a\.command: unknown placeholder"),
        (
            [{"name": "a", "train": {"script": "t.py", "args": ["{rundir}"]}}],
            r"stages\.a\.train\.args: unknown placeholder \{rundir\}",
        ),
    ],
)
def test_malformed_stage_is_one_error_naming_the_field(
    stages: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        _parse(_spec(*stages))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "must be a mapping"),
        ({"stages": [{"name": "a", "command": "x"}]}, "name: is required"),
        ({"name": "p", "stages": []}, "stages: must be a non-empty list"),
        ({"name": "p", "stages": [{"name": "a", "command": "x"}], "extra": 1}, "extra: unknown"),
        ({"name": "Bad_Name", "stages": [{"name": "a", "command": "x"}]}, "DNS-1035"),
    ],
)
def test_malformed_top_level_is_one_error(data: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        _parse(data)


def test_load_prefixes_errors_with_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("name: p\nstages: [{name: a, command: x, deps: [a2]}]\n")
    with pytest.raises(SpecError) as err:
        load_pipeline(bad)
    assert str(err.value).startswith(str(bad))
    assert "\n" not in str(err.value)
    (tmp_path / "y.yaml").write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_pipeline(tmp_path / "y.yaml")
    with pytest.raises(SpecError, match="cannot read"):
        load_pipeline(tmp_path / "missing.yaml")


def test_placeholders_are_substituted_and_unknown_ones_rejected() -> None:
    values = {"python": "py", "pipeline_dir": "/p", "run_dir": "/r"}
    assert substitute("{python} {pipeline_dir}/x.py {run_dir}", values, "w") == "py /p/x.py /r"
    with pytest.raises(SpecError, match=r"w: unknown placeholder \{nope\}"):
        substitute("{nope}", values, "w")
