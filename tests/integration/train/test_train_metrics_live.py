"""Training metrics in live mode: reduced on the loop's current group; a peer that dies while
the others are inside the metrics all-reduce is recovered from like any failed collective
(the survivors re-form, redo the step, and only the dying worker is lost)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from support import Procs, read_events

HB = "heartbeat_interval=0.5,heartbeat_timeout=3,last_call_timeout=0.5,join_timeout=60"
STEPS, EVERY, DIE_AT = 60, 5, 10

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from torch.utils.data import TensorDataset
    from flexrun.train import MetricsLogger
    from flexrun.train.live import LiveLoop

    steps, every, die_at, die_file = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(240, 8, generator=g), torch.randn(240, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loop = LiveLoop(model, opt, data, global_batch=24, steps=steps, seed=1)
    metrics = MetricsLogger(loop=loop, every_steps=every, tensorboard=False)
    for step in loop:
        for xb, yb in step.batches():
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            step.backward(loss)
        time.sleep(0.05)
        if step.rank == 2 and step.number + 1 == die_at:
            try:  # one process only, ever: the others are in the metrics all-reduce now
                os.close(os.open(die_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            except FileExistsError:
                pass  # a survivor that took rank 2 after the kill: train on
        metrics.log(loss=loss.item(), rank_seen=step.rank, world_seen=step.world_size,
                    samples=len(step.indices))
    metrics.close(flush=False)
    loop.close()
    """
)


@pytest.mark.timeout(300)
def test_live_metrics_survive_a_peer_killed_inside_the_metrics_all_reduce(
    procs: Procs, tmp_path: Path
) -> None:
    script = tmp_path / "live_metrics.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    agent = procs.start(
        ["run", "--standalone", "--nproc-per-node", "4", "--mode", "live", "--warm-spares", "0",
         "--max-restarts", "10", "--rdzv-conf", HB, "--run-dir", str(run), str(script),
         str(STEPS), str(EVERY), str(DIE_AT), str(tmp_path / "died")],
        env={"OMP_NUM_THREADS": "1"},
        name="agent",
    )  # fmt: skip
    assert agent.wait(timeout=240) == 0, procs.stderr("agent")[-3000:]
    assert (tmp_path / "died").exists(), "no worker died inside the metrics all-reduce"

    events = read_events(run)
    died = next(e for e in events if e["event"] == "failure")
    rejoined = [e for e in events if e["event"] == "live_joined" and e["ts"] > died["ts"]]
    assert rejoined and rejoined[0]["epoch"] > 1, "the survivors never re-formed"
    ev = [e for e in events if e["event"] == "train_metrics"]
    assert {e["step"] for e in ev} == set(range(EVERY, STEPS + 1, EVERY))
    # A window within one epoch: the mean of the ranks that contributed is (world - 1) / 2.
    steady = [e for e in ev if e["world_seen"] == e["world_size"]]
    assert len(steady) >= len(ev) - 2
    for e in steady:
        assert e["rank_seen"] == pytest.approx((e["world_size"] - 1) / 2)
    # The step in whose metrics all-reduce the peer died was redone and logged again on
    # the new group: its window was dropped (not a hang, not a crash of the survivors).
    assert [e for e in ev if e["step"] == DIE_AT and e["ts"] > died["ts"]]
    logs = "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    assert "metrics window dropped" in logs + procs.stderr("agent")
    assert sum(e["event"] == "failure" for e in events) == 1
