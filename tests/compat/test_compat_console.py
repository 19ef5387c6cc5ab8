"""Console and log files: prefixes, redirects, tee, filters, stdin, a ``\\r`` progress bar.

Ports torch's tee/redirect and ``--local-ranks-filter`` behaviour and issue 21's console
items (stdin inherited, a TTY stays a TTY, prefixes only where torchrun adds them).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from allowed import allow
from compat_checks import (
    flexrun_logs,
    same_bare_lines,
    same_console_lines,
    succeeded,
    torchrun_logs,
)
from compat_support import Case, Runner

TWO = ("--standalone", "--nproc-per-node", "2")
LINES = ("--lines", "3")

PLAIN = Case("console_plain", TWO, script_args=LINES)
TEE = Case("console_tee_3", (*TWO, "-t", "3"), script_args=LINES)
TEE_MAP = Case("console_tee_per_rank", (*TWO, "-t", "0:3,1:1"), script_args=LINES)
REDIRECT_OUT = Case("console_redirect_stdout", (*TWO, "-r", "1"), script_args=LINES)
REDIRECT_MAP = Case("console_redirect_rank0_stdout", (*TWO, "-r", "0:1"), script_args=LINES)
FILTER = Case("console_local_ranks_filter", (*TWO, "--local-ranks-filter", "1"), script_args=LINES)
TEMPLATE = Case(
    "console_prefix_template",
    (*TWO, "-t", "3"),
    script_args=LINES,
    env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}|${rank}|${local_rank}>"},
)

BARE = [PLAIN, TEE, TEE_MAP, REDIRECT_OUT]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("case", BARE, ids=[c.name for c in BARE])
def test_the_same_worker_lines_reach_the_console(runner: Runner, case: Case, stream: str) -> None:
    runs = runner(case)
    succeeded(runs)
    same_bare_lines(runs, stream)


EXACT = [
    pytest.param(PLAIN),
    pytest.param(TEE),
    pytest.param(TEMPLATE),
    pytest.param(REDIRECT_MAP),
    pytest.param(FILTER),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", EXACT, ids=["plain", "tee", "template", "redirect_map", "filter"])
def test_console_lines_match_prefixes_included(runner: Runner, case: Case) -> None:
    runs = runner(case)
    succeeded(runs)
    same_console_lines(runs, "stdout")
    same_console_lines(runs, "stderr")


LOGGED = Case(
    "log_dir_redirect_all", (*TWO, "-r", "3", "--log-dir", "{workdir}/logs"), script_args=LINES
)


@pytest.mark.timeout(300)
def test_redirected_streams_stay_off_the_console_and_land_in_log_dir(runner: Runner) -> None:
    runs = runner(LOGGED)
    succeeded(runs)
    for run in runs.values():
        assert run.worker_lines("stdout") == run.worker_lines("stderr") == [], run.launcher
    theirs = torchrun_logs(runs["torchrun"], "logs")
    ours = flexrun_logs(runs["flexrun"], "logs")
    allow("log-dir-layout")
    assert set(theirs) == {(r, s) for r in (0, 1) for s in ("stdout", "stderr")}
    for key, text in theirs.items():
        assert ours[key] == text, key


@pytest.mark.timeout(300)
def test_logs_are_kept_even_when_nothing_is_redirected(runner: Runner) -> None:
    runs = runner(PLAIN)
    assert list((runs["torchrun"].workdir).rglob("stdout.log")) == []
    allow("log-files-always")
    # (one per rank; the warm spares' own logs are under logs/spares/)
    ranks = runs["flexrun"].workdir.rglob("round_1/rank_*/stdout.log")
    assert sorted(p.parent.name for p in ranks) == ["rank_0", "rank_1"]


DUPLICATE = Case(
    "duplicate_filters",
    (*TWO, "-t", "3", "--log-dir", "{workdir}/logs", "--duplicate-stdout-filters", "apple",
     "--duplicate-stderr-filters", "orange"),
    script_args=LINES,
)  # fmt: skip


def _filtered(run_dir: Path, stream: str) -> list[str]:
    found = sorted(run_dir.rglob(f"filtered_{stream}.log"))
    return sorted(ln for p in found for ln in p.read_text().splitlines() if ln.strip())


@pytest.mark.timeout(300)
def test_duplicate_filters_copy_matching_lines(runner: Runner) -> None:
    runs = runner(DUPLICATE)
    succeeded(runs)
    theirs = _filtered(runs["torchrun"].workdir / "logs", "stdout")
    assert theirs and all("apple" in ln for ln in theirs)
    assert _filtered(runs["flexrun"].workdir / "logs", "stdout") == theirs


STDIN = Case("stdin_is_inherited", ("--standalone",), script_args=("--stdin",), stdin="hello\n")


@pytest.mark.timeout(300)
def test_a_worker_reads_the_launchers_stdin(runner: Runner) -> None:
    runs = runner(STDIN)
    succeeded(runs)
    assert runs["torchrun"].bare_worker_lines() == ["stdin said 'hello'"]
    same_bare_lines(runs, "stdout")


PROGRESS = Case("progress_bar_on_a_tty", ("--standalone",), script_args=("--progress",), pty=True)


@pytest.mark.timeout(300)
def test_a_tty_progress_bar_runs_to_its_end(runner: Runner) -> None:
    runs = runner(PROGRESS)
    succeeded(runs)
    for run in runs.values():
        assert "step 3/3 rank0" in run.stdout, run.launcher


@pytest.mark.timeout(300)
def test_a_tty_progress_bar_updates_in_place(runner: Runner) -> None:
    runs = runner(PROGRESS)
    for run in runs.values():
        assert "handshake ok" in run.stdout, (run.launcher, run.stdout[-500:])
        assert run.probes[0]["stdout_tty"] and run.probes[0]["stdin_tty"], run.launcher


EVENTS = Case("event_log_handler_console", ("--standalone", "--event-log-handler", "console"))


def _json_lines(text: str) -> list[dict]:
    out = []
    for ln in text.splitlines():
        start = ln.find("{")
        if start < 0:
            continue
        try:
            out.append(json.loads(ln[start:]))
        except ValueError:
            continue
    return out


@pytest.mark.timeout(300)
def test_event_log_handler_console_writes_events_to_stderr(runner: Runner) -> None:
    runs = runner(EVENTS)
    succeeded(runs)
    assert any("SUCCEEDED" in str(e.get("name")) for e in _json_lines(runs["torchrun"].stderr))
    assert any("event" in e for e in _json_lines(runs["flexrun"].stderr))


def _logs_specs_plugin(root: Path) -> None:
    info = root / "compatspecs-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: compatspecs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nflat = compatspecs:Flat\n")
    (root / "compatspecs.py").write_text(
        textwrap.dedent(
            """
            import os
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
            class Flat(DefaultLogsSpecs):
                # every rank's stdout in <log_dir>/flat_<local_rank>.out
                def reify(self, envs):
                    dest = super().reify(envs)
                    for lr in envs:
                        dest.stdouts[lr] = os.path.join(self.root_log_dir, f"flat_{lr}.out")
                    return dest
            """
        )
    )


SPECS = Case(
    "logs_specs_plugin",
    (*TWO, "--logs-specs", "flat", "--log-dir", "{workdir}/logs", "-r", "1"),
    script_args=LINES,
)


@pytest.mark.timeout(300)
def test_a_logs_specs_plugin_decides_the_files(runner: Runner, tmp_path: Path) -> None:
    site = Path(__file__).parent / "scripts"
    _logs_specs_plugin(tmp_path / "site")
    case = Case(SPECS.name, SPECS.args, script_args=SPECS.script_args,
                env={"PYTHONPATH": f"{tmp_path / 'site'}:{site}:{Path(__file__).parents[2] / 'src'}"})  # fmt: skip
    runs = runner(case)
    succeeded(runs)
    for run in runs.values():
        outs = sorted((run.workdir / "logs").rglob("flat_*.out"))
        assert len(outs) == 2, run.launcher
