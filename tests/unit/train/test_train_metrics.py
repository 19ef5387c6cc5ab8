"""MetricsLogger: window means, rate limits, cross-rank reduction (real gloo, two threads)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from flexrun.errors import ConfigError
from flexrun.events import read_events
from flexrun.testing import FakeClock
from flexrun.train.context import single_process_context
from flexrun.train.metrics import MetricsLogger, Window, _summary_writer_class


def _logger(tmp_path: Path, clock: FakeClock, **kw: Any) -> MetricsLogger:
    ctx = single_process_context(run_dir=str(tmp_path), round=4)
    return MetricsLogger(ctx=ctx, clock=clock, tensorboard=False, **kw)


def _written(tmp_path: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path) if e["event"] == "train_metrics"]


def test_every_n_steps_writes_the_window_mean_with_steps_and_samples_per_second(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    m = _logger(tmp_path, clock, every_steps=3)
    returned = []
    for step in range(1, 7):
        clock.advance(0.5)
        returned.append(m.log(step, loss=float(step), samples=8))
    assert [r is not None for r in returned] == [False, False, True, False, False, True]
    ev = _written(tmp_path)
    assert [e["step"] for e in ev] == [3, 6]
    assert ev[0]["loss"] == pytest.approx(2.0) and ev[1]["loss"] == pytest.approx(5.0)
    assert ev[1]["steps_per_s"] == pytest.approx(2.0)  # 3 steps in 1.5 s
    assert ev[1]["samples_per_s"] == pytest.approx(16.0)
    assert (ev[1]["world_size"], ev[1]["window_steps"], ev[1]["round"], ev[1]["rank"]) == (
        1,
        3,
        4,
        0,
    )
    assert returned[5] == {k: v for k, v in ev[1].items() if k in returned[5]}


def test_min_interval_merges_reduced_windows_until_it_passed(tmp_path: Path) -> None:
    clock = FakeClock()
    m = _logger(tmp_path, clock, every_steps=2, min_interval_s=3.0)
    for step in range(1, 13):
        clock.advance(0.5)
        m.log(step, loss=float(step))
    ev = _written(tmp_path)
    # writes at the first reduction (step 6, 8 ...) at least 3 s after the previous one
    assert [e["step"] for e in ev] == [6, 12]
    assert ev[0]["loss"] == pytest.approx(3.5)  # mean of 1..6, merged over 3 windows
    assert ev[1]["loss"] == pytest.approx(9.5) and ev[1]["window_steps"] == 6
    assert ev[1]["steps_per_s"] == pytest.approx(2.0)
    assert "samples_per_s" not in ev[1]


def test_weight_by_samples_gives_the_per_sample_mean(tmp_path: Path) -> None:
    m = _logger(tmp_path, FakeClock(), every_steps=2, weight_by_samples=True)
    m.log(1, loss=1.0, samples=1)
    rec = m.log(2, loss=4.0, samples=3)
    assert rec is not None and rec["loss"] == pytest.approx((1.0 + 12.0) / 4)
    with pytest.raises(ConfigError, match="samples="):
        m.log(3, loss=1.0)


def test_a_step_done_again_discards_the_window_it_belonged_to(tmp_path: Path) -> None:
    m = _logger(tmp_path, FakeClock(), every_steps=3)
    m.log(1, loss=100.0)
    m.log(2, loss=100.0)
    m.log(2, loss=2.0)  # a live recovery redoes step 2: step 1's sample is gone too
    rec = m.log(3, loss=3.0)
    assert rec is not None and rec["loss"] == pytest.approx(2.5)


def test_flush_writes_what_is_pending_and_close_is_idempotent(tmp_path: Path) -> None:
    m = _logger(tmp_path, FakeClock(), every_steps=10)
    for step in range(1, 5):
        m.log(step, acc=0.5)
    assert _written(tmp_path) == []
    m.close()
    m.close()
    (ev,) = _written(tmp_path)
    assert ev["step"] == 4 and ev["acc"] == 0.5
    with pytest.raises(ConfigError):
        m.log(5, acc=1.0)


def test_without_a_step_the_logger_counts_calls(tmp_path: Path) -> None:
    m = _logger(tmp_path, FakeClock(), every_steps=2)
    assert m.log(loss=1.0) is None
    rec = m.log(loss=3.0)
    assert rec is not None and rec["step"] == 2 and rec["loss"] == 2.0


def test_bad_names_values_and_rates_are_rejected(tmp_path: Path) -> None:
    m = _logger(tmp_path, FakeClock())
    for bad in ({"world_size": 1.0}, {"round": 1.0}, {"steps_per_s": 1.0}):
        with pytest.raises(ConfigError, match="reserved"):
            m.log(1, **bad)
    with pytest.raises(ConfigError, match="not a number"):
        m.log(1, loss="high")
    with pytest.raises(ConfigError, match="samples"):
        m.log(1, loss=1.0, samples=-1)
    with pytest.raises(ConfigError, match="every_steps"):
        _logger(tmp_path, FakeClock(), every_steps=0)
    with pytest.raises(ConfigError, match="min_interval_s"):
        _logger(tmp_path, FakeClock(), min_interval_s=-1)


def test_without_a_run_dir_values_are_returned_and_nothing_is_written(tmp_path: Path) -> None:
    ctx = single_process_context(run_dir=None)
    m = MetricsLogger(ctx=ctx, every_steps=1, clock=FakeClock())
    rec = m.log(1, loss=2.0)
    assert rec is not None and rec["loss"] == 2.0
    assert list(tmp_path.iterdir()) == []


def test_window_pack_unpack_round_trip_and_name_checksum() -> None:
    w = Window()
    w.add({"a": 2.0, "b": 4.0}, 1.0, 8.0)
    out, ranks = Window.unpack(["a", "b"], w.pack(["a", "b"]))
    assert ranks == 1 and out.means() == {"a": 2.0, "b": 4.0} and out.samples == 8.0
    with pytest.raises(ConfigError, match="different metric names"):
        Window.unpack(["a", "c"], w.pack(["a", "b"]))


def _two_ranks(body: Any) -> list[Any]:
    """Run ``body(rank, group)`` on two threads, each with its own real gloo group."""
    store = dist.HashStore()
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
            results[rank] = body(rank, pg)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return results


@pytest.mark.timeout(90)
def test_two_ranks_reduce_to_the_cross_rank_mean_and_only_rank_0_writes(tmp_path: Path) -> None:
    def body(rank: int, pg: Any) -> list[dict[str, Any] | None]:
        ctx = single_process_context(run_dir=str(tmp_path / f"r{rank}"))
        m = MetricsLogger(ctx=ctx, group=pg, every_steps=2, tensorboard=False)
        out = []
        for step in (1, 2, 3, 4):
            out.append(m.log(step, loss=10.0 * rank + step, samples=rank + 1))
        m.close()
        return out

    r0, r1 = _two_ranks(body)
    assert r0[1] is not None and r1[1] is not None
    # ranks 0 and 1 log step+0 and step+10: mean over 2 steps x 2 ranks
    assert r0[1]["loss"] == r1[1]["loss"] == pytest.approx((1 + 2 + 11 + 12) / 4)
    assert r0[3]["loss"] == pytest.approx((3 + 4 + 13 + 14) / 4)
    assert r0[1]["world_size"] == 2
    ev = [e for e in read_events(tmp_path / "r0") if e["event"] == "train_metrics"]
    assert [e["step"] for e in ev] == [2, 4]
    assert not (tmp_path / "r1" / "events.jsonl").exists()


@pytest.mark.timeout(90)
def test_two_ranks_weighted_by_samples(tmp_path: Path) -> None:
    def body(rank: int, pg: Any) -> dict[str, Any] | None:
        ctx = single_process_context(run_dir=None)
        m = MetricsLogger(ctx=ctx, group=pg, every_steps=1, weight_by_samples=True)
        return m.log(1, loss=1.0 if rank == 0 else 5.0, samples=1 if rank == 0 else 3)

    r0, r1 = _two_ranks(body)
    assert r0["loss"] == r1["loss"] == pytest.approx((1.0 + 15.0) / 4)


@pytest.mark.timeout(90)
def test_ranks_that_log_different_names_fail_loudly() -> None:
    def body(rank: int, pg: Any) -> Any:
        m = MetricsLogger(ctx=single_process_context(), group=pg, every_steps=1)
        return m.log(1, **({"loss": 1.0} if rank == 0 else {"lr": 1.0}))

    with pytest.raises(ConfigError, match="different metric names"):
        _two_ranks(body)


def test_tensorboard_scalars_land_in_the_run_dir_when_installed(tmp_path: Path) -> None:
    if _summary_writer_class() is None:
        with pytest.raises(ConfigError, match="tensorboard package"):
            _logger_tb(tmp_path, True)
        m = _logger_tb(tmp_path, None)
        m.log(1, loss=1.0)
        m.close()
        assert not (tmp_path / "tensorboard").exists()
        pytest.skip("tensorboard is not installed: only the guard was checked")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = _logger_tb(tmp_path, None)
    for step in range(1, 5):
        m.log(step, loss=float(step), samples=4)
    m.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [(s.step, s.value) for s in loss] == [(2, 1.5), (4, 3.5)]
    assert {"throughput/steps_per_s", "throughput/samples_per_s"} <= set(acc.Tags()["scalars"])


def _logger_tb(tmp_path: Path, tensorboard: bool | None) -> MetricsLogger:
    ctx = single_process_context(run_dir=str(tmp_path))
    return MetricsLogger(ctx=ctx, every_steps=2, tensorboard=tensorboard, clock=FakeClock())
