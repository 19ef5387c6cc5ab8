"""`flexrun report` as a browser sees it: headless Chromium (Debian's ``chromium``) loads the
page written from a recorded real run (examples/train_elastic.py under two agents: a kill -9,
a scale-up, a SIGTERM), renders the incident table, and paints the figures."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import HtmlTables

from flexrun.observe.report import write_report

RECORDED = Path(__file__).parent / "data" / "kill_scaleup_sigterm.events.jsonl"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
MATPLOTLIB_BLUE = (31, 119, 180)  # the world-size line: only the decoded timeline paints it


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        msg = "chromium is not installed (apt-get install -y chromium; .ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{msg}; CI must run the browser check")
        pytest.skip(msg)
    return path


def _browse(tmp: Path, *args: str, timeout: float = 90) -> str:
    """Run Chromium once in its own session with a fresh profile; kill its tree after."""
    profile = tmp / f"profile{len(list(tmp.glob('profile*')))}"
    proc = subprocess.Popen(
        [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium did not finish in {timeout}s: {args}")
    finally:
        # helpers (zygote, gpu) share its session; the group may have exited already
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}"
    return out


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Path]:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(RECORDED, run / "events.jsonl")
    yield write_report([run])


@pytest.mark.timeout(240)
def test_chromium_renders_the_incident_table_of_a_recorded_run(page: Path, tmp_path: Path) -> None:
    dom = _browse(tmp_path, "--dump-dom", page.as_uri())
    parsed = HtmlTables()
    parsed.feed(dom)
    rows = parsed.stripped_rows
    header = next(r for r in rows if r[:3] == ["#", "time", "cause"])
    assert "recovery" in header
    incidents = [r for r in rows if len(r) == len(header) and r[0].isdigit()]
    assert [r[2] for r in incidents] == ["worker_failure", "scale_up", "preempted"]
    assert "SIGKILL" in incidents[0][3] and "SIGTERM" in incidents[2][3]
    assert [r[5] for r in incidents] == ["2 -> 2", "2 -> 4", "4 -> 2"]
    assert len(parsed.images) == 2 and all(
        s.startswith("data:image/png;base64,") for s in parsed.images
    )


@pytest.mark.timeout(240)
def test_chromium_paints_the_page_with_its_figures(page: Path, tmp_path: Path) -> None:
    from PIL import Image  # matplotlib's own dependency (the report extra)

    shot = tmp_path / "shot.png"
    _browse(tmp_path, "--window-size=1200,1600", f"--screenshot={shot}", page.as_uri())
    with Image.open(shot) as img:
        rgb = img.convert("RGB")
        assert rgb.size == (1200, 1600)
        colors = rgb.getcolors(maxcolors=1_000_000) or []
    counts = {c: n for n, c in colors}
    assert len(counts) > 50, "the page looks blank"
    white = counts.get((255, 255, 255), 0)
    assert white < 0.97 * 1200 * 1600, "almost nothing was painted"
    # Only a decoded, painted timeline figure draws its blue world-size line.
    blue = sum(
        n
        for c, n in counts.items()
        if all(abs(a - b) <= 12 for a, b in zip(c, MATPLOTLIB_BLUE, strict=True))
    )
    assert blue > 500, f"the timeline figure was not painted ({blue} blue pixels)"
