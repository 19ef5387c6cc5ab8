"""Property tests over the parsers of outside input in k8s/ and pipeline/ (issue 18).

Each starts from a valid document and replaces one part of it (any field, at any depth)
with arbitrary JSON-like data. Property: a clear :class:`SpecError` (exit 2 at the CLI)
or a valid result; never another exception. ``validate`` never raises for a bad manifest
at all (a bad manifest is a reported problem). Bounded and derandomized, so CI is stable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from fuzz_support import paths_of, replace_at
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k8s_paths import GOLDEN, TRAINJOB_EXAMPLE

from flexrun.errors import SpecError
from flexrun.k8s.render import render
from flexrun.k8s.spec import load_job_spec, parse_job_spec
from flexrun.k8s.validate import validate_documents
from flexrun.pipeline.spec import parse_pipeline

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
FUZZ = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


def _mutated(data: st.DataObject, doc: Any) -> Any:
    paths = paths_of(doc)
    path = data.draw(st.sampled_from(paths), label="path")
    return replace_at(doc, path, data.draw(values, label="value"))


JOB_SPECS = [
    yaml.safe_load((GOLDEN / f"{n}.job.yaml").read_text())
    for n in ("tcp", "etcd", "trainjob", "trainjob-etcd")
]


@FUZZ
@given(data=st.data(), which=st.integers(0, len(JOB_SPECS) - 1))
def test_a_mangled_job_spec_is_a_spec_error_or_renders(data: st.DataObject, which: int) -> None:
    doc = _mutated(data, JOB_SPECS[which])
    try:
        spec = parse_job_spec(doc)
    except SpecError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    docs = render(spec)  # a spec that parses always renders, and what it renders is valid
    assert validate_documents(docs, use_core_schemas=False).ok


RENDERED = [
    render(load_job_spec(GOLDEN / "tcp.job.yaml")),
    render(load_job_spec(GOLDEN / "etcd.job.yaml")),
    render(load_job_spec(TRAINJOB_EXAMPLE)),
    render(load_job_spec(GOLDEN / "trainjob-etcd.job.yaml")),
]


@FUZZ
@given(data=st.data(), which=st.integers(0, len(RENDERED) - 1))
def test_validate_reports_a_mangled_manifest_and_never_raises(
    data: st.DataObject, which: int
) -> None:
    docs = _mutated(data, RENDERED[which])
    docs = docs if isinstance(docs, list) else [docs]
    report = validate_documents(docs, use_core_schemas=False)
    for p in report.problems:
        assert isinstance(p.path, str) and p.message


PIPELINE = yaml.safe_load((REPO / "examples" / "pipeline" / "pipeline.yaml").read_text())


@FUZZ
@given(data=st.data())
def test_a_mangled_pipeline_spec_is_a_spec_error_or_a_pipeline(data: st.DataObject) -> None:
    doc = _mutated(data, PIPELINE)
    try:
        pipeline = parse_pipeline(doc, base_dir=Path("/tmp"))
    except SpecError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    for stage in pipeline.stages:
        for out in stage.outputs:
            assert not out.startswith("/") and ".." not in Path(out).parts
