"""The one spec reader (``flexrun._spec``) both spec formats go through (issue 15)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flexrun._spec import SpecReader, load_yaml, load_yaml_documents
from flexrun.errors import SpecError
from flexrun.k8s import spec as k8s_spec
from flexrun.pipeline import spec as pipeline_spec

pytestmark = pytest.mark.timeout(30)


def test_both_spec_formats_use_the_shared_reader_and_no_copy_of_it() -> None:
    for module in (k8s_spec, pipeline_spec):
        text = Path(module.__file__ or "").read_text()
        assert "class _Reader" not in text and "SpecReader" in text


def test_getters_name_the_field_and_reject_wrong_types() -> None:
    r = SpecReader({"a": 1, "b": "x", "c": [1, "y"], "d": {"k": True}, "e": True}, "spec")
    assert r.int_("a") == 1 and r.str_("b") == "x" and r.scalar("a") == "1"
    assert r.str_list("c") == ("1", "y")
    with pytest.raises(SpecError, match=r"^spec\.b: must be an integer"):
        r.int_("b")
    with pytest.raises(SpecError, match=r"^spec\.a: must be a non-empty string"):
        r.str_("a")
    with pytest.raises(SpecError, match=r"^spec\.d\.k: must be a string"):
        r.str_map("d")
    with pytest.raises(SpecError, match=r"^spec\.e: must be an integer"):
        r.int_("e")
    assert r.bool_("e", False) is True
    with pytest.raises(SpecError, match=r"^spec\.x: unknown field"):
        SpecReader({"x": 1}, "spec").done()
    with pytest.raises(SpecError, match=r"^pipeline: must be a mapping \(got list\)"):
        SpecReader([1], "", name="pipeline")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_seconds_are_refused(value: float) -> None:
    with pytest.raises(SpecError, match=r"^s\.timeout: must be a finite number"):
        SpecReader({"timeout": value}, "s").num("timeout", 1.0)
    # ... and so a pipeline stage's timeout (an infinite timeout once crashed the Argo render)
    with pytest.raises(SpecError, match=r"stages\.a\.timeout: must be a finite number"):
        pipeline_spec.parse_pipeline(
            {"name": "p", "stages": [{"name": "a", "command": "x", "timeout": value}]},
            base_dir=Path("/tmp"),
        )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x01\x02\x03", "a binary file"),
        (b"name: \xff\xfe\xfd", "not UTF-8 text"),
        (b"a: [unclosed", "not valid YAML"),
        (b"a: 2020-13-45", "not valid YAML (month must be in 1..12)"),
        (b"a: " + b"9" * 5000, "not valid YAML"),
        (b"[" * 20000, "not valid YAML"),
    ],
)
def test_files_that_are_not_yaml_text_are_one_clear_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    f = tmp_path / "f.yaml"
    f.write_bytes(content)
    for load in (load_yaml, load_yaml_documents):
        with pytest.raises(SpecError) as info:
            load(f, "job spec")
        assert str(info.value).startswith(str(f)) and message in str(info.value)
        assert "\n" not in str(info.value)


def test_a_directory_or_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read job spec"):
        load_yaml(tmp_path, "job spec")
    with pytest.raises(SpecError, match="cannot read job spec"):
        load_yaml(tmp_path / "none.yaml", "job spec")
