"""Node resources: psutil sampling, NVML optional, events and their summary."""

from __future__ import annotations

import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flexrun.observe import resources
from flexrun.observe.resources import (
    ResourceCollector,
    ResourceSampler,
    sample_resources,
    summarize_resources,
)


@pytest.mark.timeout(30)
def test_a_sample_has_sane_cpu_memory_disk_and_network_figures(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = sample_resources(str(tmp_path))
    assert 0.0 <= s.cpu_ratio <= 1.0 and s.cpu_count >= 1
    assert 0 < s.memory_used_bytes <= s.memory_total_bytes
    assert 0 < s.disk_used_bytes <= s.disk_total_bytes and s.disk_path == str(tmp_path)
    assert s.net_received_bytes >= 0 and s.net_sent_bytes >= 0
    ev = s.as_event()
    assert ev["mem_total_bytes"] == s.memory_total_bytes and ("gpus" in ev) == bool(s.gpus)


@pytest.mark.timeout(30)
def test_without_nvml_gpus_are_skipped_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if not installed
    monkeypatch.setattr(resources, "_NVML", None)
    assert sample_resources().gpus == ()
    reg = CollectorRegistry()
    reg.register(ResourceCollector())
    text = generate_latest(reg).decode()
    assert "flexrun_node_memory_used_bytes" in text and "flexrun_gpu_" not in text
    assert "flexrun_node_network_received_bytes_total" in text


@pytest.mark.timeout(30)
def test_the_sampler_emits_resources_events_and_stops() -> None:
    got: list[tuple[str, dict]] = []
    sampler = ResourceSampler(lambda event, **f: got.append((event, f)), interval_s=0.05)
    sampler.sample_once()
    sampler.start()
    import time

    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.close()
    n = len(got)
    time.sleep(0.15)
    assert n >= 3 and len(got) == n and {e for e, _ in got} == {"resources"}


@pytest.mark.timeout(30)
def test_summary_gives_per_node_cpu_memory_network_and_gpu_figures() -> None:
    def r(node: str, cpu: float, mem: int, rx: int, gpu_util: float) -> dict:
        return {
            "event": "resources",
            "node": node,
            "cpu_ratio": cpu,
            "mem_used_bytes": mem,
            "mem_total_bytes": 100,
            "net_rx_bytes": rx,
            "net_tx_bytes": rx // 2,
            "gpus": [
                {"index": 0, "util_ratio": gpu_util, "mem_used_bytes": 5, "temp_c": 60 + gpu_util}
            ],
        }

    s = summarize_resources(
        [r("a", 0.2, 10, 1000, 0.5), r("a", 0.6, 30, 3000, 0.9), {"event": "x"}]
    )
    a = s["a"]
    assert (
        a["samples"] == 2
        and a["cpu_mean_ratio"] == pytest.approx(0.4)
        and a["cpu_max_ratio"] == 0.6
    )
    assert a["mem_max_bytes"] == 30 and a["net_rx_bytes"] == 2000 and a["net_tx_bytes"] == 1000
    assert a["gpus"][0]["util_mean_ratio"] == pytest.approx(0.7) and a["gpus"][0][
        "temp_max_c"
    ] == pytest.approx(60.9)
