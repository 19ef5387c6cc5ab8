"""Training metrics with real ranks: cross-rank means in the event log, read by the agent's
metrics endpoint and the report; the recommended example under `flexrun run`."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import Procs, free_port, read_events, scrape_metrics, wait_for
from train_support import EXAMPLE, Launcher

from flexrun.observe.analysis import analyze, load_events
from flexrun.observe.metrics import serve_run_metrics
from flexrun.observe.report import REPORT_FILE

WORKER = textwrap.dedent(
    """
    import sys, time
    import flexrun.train as ft

    steps, every = int(sys.argv[1]), int(sys.argv[2])
    ctx = ft.init()
    m = ft.MetricsLogger(every_steps=every, tensorboard=False)
    for step in range(1, steps + 1):
        time.sleep(0.01)
        # rank r logs step + 10 r; samples r + 1
        m.log(step, loss=step + 10.0 * ctx.rank, samples=ctx.rank + 1)
    m.close()
    ft.shutdown()
    """
)


@pytest.mark.timeout(180)
def test_two_ranks_write_cross_rank_means_that_the_metrics_endpoint_and_report_read(
    launcher: Launcher, tmp_path: Path
) -> None:
    script = tmp_path / "metrics_worker.py"
    script.write_text(WORKER)
    run_dir = tmp_path / "run"
    env = {"FLEXRUN_RUN_DIR": str(run_dir), "FLEXRUN_RUN_ID": "m1", "FLEXRUN_NODE": "n0"}
    g = launcher.start(2, ["20", "5"], script=script, env={**env, "FLEXRUN_ROUND": "2"})
    assert g.wait(120) == [0, 0], g.output()

    ev = [e for e in read_events(run_dir) if e["event"] == "train_metrics"]
    assert [e["step"] for e in ev] == [5, 10, 15, 20]  # rank 0 alone writes, once a window
    for e in ev:
        window = range(e["step"] - 4, e["step"] + 1)
        expected = sum(s + 10.0 * r for s in window for r in (0, 1)) / 10
        assert e["loss"] == pytest.approx(expected)
        assert (e["rank"], e["world_size"], e["window_steps"], e["round"]) == (0, 2, 5, 2)
        assert (e["run_id"], e["node"]) == ("m1", "n0")
        assert e["steps_per_s"] > 0
        # 3 samples a step over both ranks: samples/s is 3 x steps/s
        assert e["samples_per_s"] == pytest.approx(3 * e["steps_per_s"], rel=1e-3)

    # The agent's endpoint (what `flexrun run --metrics-port` serves) picks them up.
    metrics, follower = serve_run_metrics(run_dir, free_port(), resources=False)
    try:
        scraped = scrape_metrics(metrics.port)
    finally:
        follower.close()
        metrics.close()
    assert scraped["flexrun_train_steps_per_second"] == pytest.approx(ev[-1]["steps_per_s"])
    assert scraped["flexrun_train_samples_per_second"] == pytest.approx(ev[-1]["samples_per_s"])
    # And so does the report's throughput timeline.
    analysis = analyze(load_events([run_dir]))
    assert [v for _, v in analysis.throughput] == [e["steps_per_s"] for e in ev]


@pytest.mark.timeout(300)
def test_the_example_under_flexrun_run_serves_and_writes_its_training_metrics(
    procs: Procs, tmp_path: Path
) -> None:
    run_dir, port = tmp_path / "run", free_port()
    agent = procs.start(
        ["run", "--standalone", "--nproc-per-node", "2", "--run-dir", str(run_dir),
         "--metrics-port", str(port), str(EXAMPLE), "--steps", "300", "--ckpt-every", "100",
         "--ckpt-dir", str(tmp_path / "ck"), "--metrics-every", "10", "--step-sleep", "0.03"],
        env={"OMP_NUM_THREADS": "1"},
        name="agent",
    )  # fmt: skip

    def steps_served() -> float:
        if agent.poll() is not None:
            raise AssertionError(
                f"agent exited {agent.returncode}: {procs.stderr('agent')[-3000:]}"
            )
        try:
            return scrape_metrics(port).get("flexrun_train_steps_per_second", 0.0)
        except OSError:
            return 0.0

    wait_for(steps_served, 150, "steps/s on the agent's metrics endpoint")
    assert agent.wait(timeout=200) == 0, procs.stderr("agent")[-3000:]
    out = (tmp_path / "agent.out").read_text()
    assert "rank0: done at step 300" in out, out[-2000:]

    ev = [e for e in read_events(run_dir) if e["event"] == "train_metrics"]
    assert [e["step"] for e in ev] == list(range(10, 301, 10))
    assert all(e["world_size"] == 2 and e["rank"] == 0 for e in ev)
    assert all(math.isfinite(e["loss"]) and e["samples_per_s"] > 0 for e in ev)
    assert ev[-1]["loss"] < ev[0]["loss"]  # it learns

    res = subprocess.run(
        [sys.executable, "-m", "flexrun", "report", str(run_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (run_dir / REPORT_FILE).exists()
    analysis = analyze(load_events([run_dir]))
    assert analysis.productive_basis == "train_metrics"
    assert len(analysis.throughput) == len(ev)
