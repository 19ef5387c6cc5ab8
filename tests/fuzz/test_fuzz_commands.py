"""Fuzz: every subcommand and every file a subcommand reads (issue 33).

Each case is one ``flexrun`` command line, run in-process through
:func:`flexrun.cli.main` (argparse's ``SystemExit`` caught), with bad input: a huge
number, ``nan``, a duration of ``1e300``, an id with a path in it, a binary or
hand-edited file. Property: a non-zero exit, one ``error`` line on stderr, no traceback
and no exception out of ``main``. The file readers (pipeline state and spec, k8s job spec
and manifests, a model registry's ``current``, event logs) also get hypothesis-mangled
contents: any exit code ``main`` chooses, never a traceback. Nothing here starts a job.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from fuzz_support import FEW, hostile_bytes
from hypothesis import given
from hypothesis import strategies as st

from flexrun.cli import main
from flexrun.testing.ports import free_port

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
HUGE = 10**400


def cli(argv: list[str]) -> tuple[int, str]:
    """``flexrun <argv>`` in this process: (exit code, stderr). An exception out of
    ``main`` (a traceback at the console) fails the test."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv, raise_on_failure=False)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return int(code), err.getvalue()


def assert_clean_refusal(argv: list[str], *, want: str | None = None) -> str:
    code, err = cli(argv)
    assert code != 0, (argv, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("usage:")]
    assert lines and "error" in lines[-1], err
    if want is not None:
        assert want in lines[-1], err
    return lines[-1]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("fuzz-commands")
    (d / "t.py").write_text("raise SystemExit('a bad-input case must never start a worker')\n")
    (d / "afile").write_text("x")
    binary = d / "binary"
    binary.write_bytes(b"\xff\xfe\x00\x81junk")
    os.chmod(binary, 0o600)
    old = os.getcwd()
    os.chdir(d)
    try:
        yield d
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def tcp_store() -> Iterator[int]:
    from flexrun.store.tcp import TcpStoreServer

    port = free_port()
    server = TcpStoreServer("127.0.0.1", port)
    try:
        yield port
    finally:
        server.close()


# -- command lines ---------------------------------------------------------------------------
def _files(d: Path) -> None:
    run = d / "events-huge"
    run.mkdir(exist_ok=True)
    (run / "events.jsonl").write_text(
        json.dumps({"ts": HUGE, "event": "node_joined"})
        + "\n"
        + json.dumps({"ts": 5.0, "event": "progress", "steps_per_s": HUGE, "step": HUGE})
        + "\n"
        + json.dumps({"ts": 6.0, "event": "resources", "mem_used_bytes": HUGE})
        + "\n"
    )
    for name, state in (
        ("state-duration", {"version": 1, "stages": {"a": {"duration_s": HUGE}}}),
        ("state-huge", {"version": 1, "stages": {"a": {"status": HUGE, "attempts": HUGE}}}),
    ):
        (d / name).mkdir(exist_ok=True)
        (d / name / "pipeline-state.json").write_text(json.dumps(state))
    reg = d / "registry"
    for v in ("v1", "v2"):
        (reg / v).mkdir(parents=True, exist_ok=True)
    (reg / "current").write_bytes(b"\xff\xfe\x00v2")
    (d / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n")


BAD: dict[str, list[str]] = {
    # run: every duration bounded, ids checked, paths and credential files checked
    "run --monitor-interval 1e300": ["run", "--standalone", "--monitor-interval", "1e300", "t.py"],
    "run --resource-interval 1e300": [
        "run",
        "--standalone",
        "--resource-interval",
        "1e300",
        "t.py",
    ],
    "run heartbeat_interval=1e300": [
        "run",
        "--standalone",
        "--rdzv-conf",
        "heartbeat_interval=1e300",
        "t.py",
    ],
    "run join_timeout=nan": ["run", "--standalone", "--rdzv-conf", "join_timeout=nan", "t.py"],
    "run --hang-timeout 1e300": ["run", "--standalone", "--hang-timeout", "1e300", "t.py"],
    "run --run-dir /proc/1/nope": ["run", "--standalone", "--run-dir", "/proc/1/nope", "t.py"],
    "run --run-dir FILE": ["run", "--standalone", "--run-dir", "afile", "t.py"],
    "run Secret=": ["run", "--standalone", "--rdzv-conf", "Secret=abc", "t.py"],
    "run PASSWORD=": ["run", "--standalone", "--rdzv-conf", "PASSWORD=abc", "t.py"],
    "run secret=": ["run", "--standalone", "--rdzv-conf", "secret=abc", "t.py"],
    "run binary password file": [
        "run",
        "--nnodes",
        "1",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--rdzv-conf",
        "password_file=binary",
        "t.py",
    ],
    "run --rdzv-id ..": [
        "run",
        "--nnodes",
        "1",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "..",
        "t.py",
    ],
    "run --rdzv-id a/b": [
        "run",
        "--nnodes",
        "1",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "a/b",
        "t.py",
    ],
    "run --node-id ../../x": ["run", "--standalone", "--node-id", "../../x", "t.py"],
    "run --node-id empty": ["run", "--standalone", "--node-id", "", "t.py"],
    "run --node-id newline": ["run", "--standalone", "--node-id", "a\nb", "t.py"],
    "run --node-id ..": ["run", "--standalone", "--node-id", "..", "t.py"],
    "run --role empty": ["run", "--standalone", "--role", "", "t.py"],
    "run --role a/b": ["run", "--standalone", "--role", "a/b", "t.py"],
    "run --max-restarts huge": ["run", "--standalone", "--max-restarts", str(HUGE), "t.py"],
    "run --crash-loop-restarts huge": [
        "run",
        "--standalone",
        "--crash-loop-restarts",
        "9" * 30,
        "t.py",
    ],
    "run --nproc-per-node huge": ["run", "--standalone", "--nproc-per-node", "1" * 50, "t.py"],
    # store, spares
    "store --port 70000": ["store", "--port", "70000"],
    "store --port huge": ["store", "--port", str(HUGE)],
    "store --host bad": ["store", "--host", "999.1.1.1", "--port", "0"],
    "spares --dir FILE": ["spares", "--dir", "afile", "--status"],
    "spares --refill-delay 1e300": ["spares", "--dir", "sp", "--refill-delay", "1e300"],
    "spares --count huge": ["spares", "--dir", "sp", "--count", str(HUGE)],
    # status, doctor
    "status --observe 1e300": [
        "status",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--observe",
        "1e300",
    ],
    "status --watch nan": [
        "status",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--watch",
        "nan",
    ],
    "status --connect-timeout 1e300": [
        "status",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--connect-timeout",
        "1e300",
    ],
    "doctor --join-timeout 1e300": [
        "doctor",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--join-timeout",
        "1e300",
    ],
    "doctor --inject-delay nan": [
        "doctor",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--inject-delay",
        "nan",
    ],
    "doctor --node-id a/b": [
        "doctor",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--node-id",
        "a/b",
    ],
    "doctor --session newline": [
        "doctor",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--session",
        "a\nb",
    ],
    "doctor --size-mb 1e300": [
        "doctor",
        "--rdzv-endpoint",
        "127.0.0.1:1",
        "--rdzv-id",
        "j",
        "--size-mb",
        "1e300",
    ],
    # report, pipeline, k8s, chaos
    "report no such dir": ["report", "no-such-run"],
    "pipeline status no state": ["pipeline", "status", "afile"],
    "pipeline rollback binary current": ["pipeline", "rollback", "registry"],
    "pipeline rollback --to ..": ["pipeline", "rollback", "registry", "--to", ".."],
    "pipeline render binary": ["pipeline", "render", "binary"],
    "pipeline run binary": ["pipeline", "run", "binary"],
    "k8s render binary": ["k8s", "render", "binary"],
    "k8s validate binary": ["k8s", "validate", "binary"],
    "k8s validate --kubernetes-version abc": [
        "k8s",
        "validate",
        "cm.yaml",
        "--kubernetes-version",
        "abc",
    ],
    "k8s validate --kubernetes-version 99.99": [
        "k8s",
        "validate",
        "cm.yaml",
        "--kubernetes-version",
        "99.99",
    ],
    "chaos schedule --duration nan": ["chaos", "schedule", "--duration", "nan"],
    "chaos schedule --duration 1e300": ["chaos", "schedule", "--duration", "1e300"],
    "chaos schedule --interval 0": ["chaos", "schedule", "--interval", "0"],
    "chaos run --root FILE": ["chaos", "run", "--root", "afile"],
    "chaos run --steps 0": ["chaos", "run", "--root", "chaos-root", "--steps", "0"],
    "chaos run --durable-every -1": [
        "chaos",
        "run",
        "--root",
        "chaos-root",
        "--durable-every",
        "-1",
    ],
    "chaos run live --durable-every": [
        "chaos",
        "run",
        "--root",
        "chaos-root",
        "--launcher",
        "live",
        "--durable-every",
        "5",
    ],  # fmt: skip
}
"""Command lines that must end in one clear error (what the issue found, and their kin)."""

HANDLED: dict[str, list[str]] = {
    "report huge integers": ["report", "events-huge", "-o", "report-out"],
    "pipeline status huge state": ["pipeline", "status", "state-huge"],
    "pipeline status huge duration": ["pipeline", "status", "state-duration", "--json"],
}
"""Command lines whose bad records are skipped or shown as unknown: exit 0, no traceback."""


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_is_one_clear_line_and_a_non_zero_exit(work: Path, name: str) -> None:
    _files(work)
    runs = work / "flexrun-runs"
    before = set(runs.iterdir()) if runs.is_dir() else set()
    assert_clean_refusal(BAD[name])
    after = set(runs.iterdir()) if runs.is_dir() else set()
    assert after == before, after - before  # no refused command line started a job


@pytest.mark.parametrize("name", sorted(HANDLED))
def test_bad_records_are_skipped_without_a_traceback(work: Path, name: str) -> None:
    _files(work)
    code, err = cli(HANDLED[name])
    assert code == 0 and "Traceback" not in err, err


def test_every_subcommand_has_a_bad_input_case() -> None:
    from flexrun.cli import build_parser

    parser = build_parser({})
    (sub,) = [a for a in parser._actions if a.dest == "command" or a.choices]  # noqa: SLF001
    covered = {argv[0] for argv in BAD.values()}
    assert set(sub.choices) <= covered, set(sub.choices) - covered


def test_status_with_a_junk_round_or_node_record(work: Path, tcp_store: int) -> None:
    from flexrun.rendezvous.keys import Keys
    from flexrun.store.tcp import TcpStore

    keys = Keys("fz")
    client = TcpStore("127.0.0.1", tcp_store)
    argv = ["status", "--rdzv-endpoint", f"127.0.0.1:{tcp_store}", "--rdzv-id", "fz"]
    argv += ["--observe", "0", "--json"]
    for junk in (b"garbage", b"\xff\xfe", json.dumps({"v": 1, "number": HUGE}).encode()):
        client.put(keys.node("n1"), junk)
        code, err = cli(argv)
        assert code == 0 and "Traceback" not in err, err  # a bad node record: skipped, counted
    for junk in (b"garbage", b"\xff\xfe", b"[]", json.dumps({"v": 2, "number": HUGE}).encode()):
        client.put(keys.round, junk)
        assert "round record" in assert_clean_refusal(argv)


# -- files, mangled ----------------------------------------------------------------------------
def _file_case(
    work: Path, data: st.DataObject, valid: bytes, name: str, argv: Callable[[Path], list[str]]
) -> None:
    d = work / f"case-{name}"
    d.mkdir(exist_ok=True)
    target = d / name
    blob = hostile_bytes(data, valid)
    target.write_bytes(blob)
    code, err = cli(argv(d))
    assert "Traceback" not in err, err
    if code != 0:
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("usage:")]
        assert lines and "error" in lines[-1] or code == 1, err


def _yaml_bytes(path: Path) -> bytes:
    return json.dumps(yaml.safe_load(path.read_text())).encode()


@FEW
@given(data=st.data())
def test_pipeline_state_files_mangled(work: Path, data: st.DataObject) -> None:
    valid = json.dumps(
        {
            "version": 1,
            "pipeline": "p",
            "run_status": "succeeded",
            "order": ["a"],
            "stages": {"a": {"status": "succeeded", "duration_s": 1.5, "attempts": 1}},
        }
    ).encode()
    _file_case(work, data, valid, "pipeline-state.json", lambda d: ["pipeline", "status", str(d)])


@FEW
@given(data=st.data())
def test_pipeline_specs_mangled_render(work: Path, data: st.DataObject) -> None:
    valid = _yaml_bytes(REPO / "examples" / "pipeline" / "pipeline.yaml")
    _file_case(
        work,
        data,
        valid,
        "pipeline.yaml",
        lambda d: ["pipeline", "render", str(d / "pipeline.yaml"), "-o", str(d / "wf.yaml")],
    )


@FEW
@given(data=st.data())
def test_k8s_job_specs_mangled_render(work: Path, data: st.DataObject) -> None:
    valid = _yaml_bytes(REPO / "examples" / "k8s" / "job.yaml")
    _file_case(
        work,
        data,
        valid,
        "job.yaml",
        lambda d: ["k8s", "render", str(d / "job.yaml"), "-o", str(d / "out.yaml")],
    )


@FEW
@given(data=st.data())
def test_k8s_manifests_mangled_validate(work: Path, data: st.DataObject) -> None:
    valid = json.dumps(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"a": "b"}}
    ).encode()
    _file_case(
        work,
        data,
        valid,
        "m.yaml",
        lambda d: ["k8s", "validate", "--structural-only", "-q", str(d / "m.yaml")],
    )


@FEW
@given(
    blob=st.binary(max_size=24) | st.sampled_from([b"v1", b"v9", b"..", b"/etc", b"v" + b"9" * 400])
)
def test_model_registry_current_mangled_rollback(work: Path, blob: bytes) -> None:
    reg = work / "registry-fuzz"
    for v in ("v1", "v2"):
        (reg / v).mkdir(parents=True, exist_ok=True)
    (reg / "current").write_bytes(blob)
    code, err = cli(["pipeline", "rollback", str(reg)])
    assert "Traceback" not in err, err
    assert code in (0, 2), err
