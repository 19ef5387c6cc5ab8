"""Comparisons of a torchrun run and a flexrun run of the same case.

Each check compares one aspect and names the documented difference (``allowed.allow``)
wherever it tolerates one.
"""

from __future__ import annotations

import json
from pathlib import Path

from allowed import allow
from compat_support import Run

# Compared by value on every rank.
SAME_VALUE = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "COMPAT_SENTINEL",
    "COMPAT_PYTHON_EXEC",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)
# Present in both (values are free ports, random ids, temporary paths).
SAME_PRESENCE = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")


def pair(runs: dict[str, Run]) -> tuple[Run, Run]:
    return runs["torchrun"], runs["flexrun"]


def same_ranks(runs: dict[str, Run], count: int) -> tuple[dict[int, dict], dict[int, dict]]:
    t, f = pair(runs)
    tp, fp = t.probes, f.probes
    assert sorted(tp) == list(range(count)), (t.rc, t.stderr[-2000:])
    assert sorted(fp) == sorted(tp), (f.rc, f.stderr[-2000:])
    return tp, fp


def same_env(
    runs: dict[str, Run],
    count: int,
    *,
    run_id: str | None = None,
    given_port: bool = False,
) -> None:
    """Every rank sees the same launcher variables (values where they are not random)."""
    tp, fp = same_ranks(runs, count)
    for rank in tp:
        te, fe = tp[rank]["env"], fp[rank]["env"]
        for key in SAME_VALUE:
            assert fe.get(key) == te.get(key), (rank, key, te.get(key), fe.get(key))
        for key in SAME_PRESENCE:
            assert (key in fe) == (key in te), (rank, key)
        theirs = {k for k in te if k.startswith("TORCHELASTIC_")}
        ours = {k for k in fe if k.startswith("TORCHELASTIC_")}
        assert ours == theirs, (rank, sorted(theirs ^ ours))
        if run_id is not None:
            assert te["TORCHELASTIC_RUN_ID"] == fe["TORCHELASTIC_RUN_ID"] == run_id
        else:
            allow("random-run-id")
        if given_port:  # a static job: MASTER_PORT is the --master-port each launcher was given
            t, f = pair(runs)
            assert (te["MASTER_PORT"], fe["MASTER_PORT"]) == (t.port, f.port), rank
        if te.get("TORCHELASTIC_ERROR_FILE") != fe.get("TORCHELASTIC_ERROR_FILE"):
            allow("error-file-path")


def same_script_view(runs: dict[str, Run], count: int) -> None:
    """argv, ``__file__``, ``__name__``, cwd-relative facts and is_torchelastic_launched."""
    tp, fp = same_ranks(runs, count)
    t, f = pair(runs)
    for rank in tp:
        a, b = tp[rank], fp[rank]
        assert b["argv"][1:] == a["argv"][1:], rank
        assert Path(b["argv"][0]).name == Path(a["argv"][0]).name, rank
        for key in ("name", "elastic_launched", "executable"):
            if key in a:
                assert b[key] == a[key], (rank, key)
        if "file" in a:
            assert Path(b["file"]).is_absolute() == Path(a["file"]).is_absolute()
            assert Path(b["file"]).name == Path(a["file"]).name
            assert Path(a["cwd"]).name == t.launcher and Path(b["cwd"]).name == f.launcher


def succeeded(runs: dict[str, Run]) -> None:
    for run in runs.values():
        assert all(rc == 0 for rc in run.rc), (run.launcher, run.rc, run.stderr[-3000:])


def failed_alike(runs: dict[str, Run], *, worker_code: int | None = None) -> None:
    """Both fail; flexrun with the worker's own code where torchrun says 1."""
    t, f = pair(runs)
    assert all(rc != 0 for rc in t.rc), t.rc
    assert all(rc != 0 for rc in f.rc), f.rc
    if worker_code is not None:
        assert set(t.rc) == {1}
        assert set(f.rc) == {worker_code}, f.stderr[-2000:]
        if worker_code != 1:
            allow("exit-code")


def bad_input_alike(runs: dict[str, Run], *, argparse_error: bool = False) -> None:
    """torchrun: argparse's exit 2, or a traceback and exit 1; flexrun: one line and exit 2."""
    t, f = pair(runs)
    assert t.rc == [2] if argparse_error else t.rc == [1], (t.rc, t.stderr[-2000:])
    assert f.rc == [2], f.stderr
    errors = [ln for ln in f.stderr.splitlines() if ln.startswith("flexrun")]
    assert len(errors) >= 1 and "Traceback" not in f.stderr, f.stderr
    if not argparse_error:
        allow("bad-input-exit")
    assert not list(f.probe_dir.glob("*.json")) and not list(t.probe_dir.glob("*.json"))


def same_bare_lines(runs: dict[str, Run], stream: str) -> None:
    """The same worker lines reach the console (order between workers and prefixes aside)."""
    t, f = pair(runs)
    allow("launcher-log-lines")
    assert f.bare_worker_lines(stream) == t.bare_worker_lines(stream), (
        t.worker_lines(stream),
        f.worker_lines(stream),
    )


def same_console_lines(runs: dict[str, Run], stream: str) -> None:
    """Exactly the same worker lines, prefixes included."""
    t, f = pair(runs)
    assert sorted(f.worker_lines(stream)) == sorted(t.worker_lines(stream))


def torchrun_logs(run: Run, log_dir: str) -> dict[tuple[int, str], str]:
    """(local rank, stream) -> text of torchrun's <log_dir>/<id>_<rand>/attempt_0/<lr>/."""
    out = {}
    for p in (run.workdir / log_dir).glob("*/attempt_0/*/*.log"):
        out[(int(p.parent.name), p.stem)] = p.read_text()
    return out


def flexrun_logs(run: Run, log_dir: str) -> dict[tuple[int, str], str]:
    """(rank, stream) -> text of flexrun's <log_dir>/round_1/rank_<r>/."""
    out = {}
    for p in (run.workdir / log_dir).glob("round_1/rank_*/*.log"):
        out[(int(p.parent.name.split("_")[1]), p.stem)] = p.read_text()
    return out


def error_message(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    return data["message"] if isinstance(data.get("message"), dict) else data
