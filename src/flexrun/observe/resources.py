"""Node resources: CPU, memory, disk, network (psutil) and GPUs (NVML, when available).

Owns sampling the node and the three ways a sample is used: Prometheus gauges computed at
scrape time (:class:`ResourceCollector`), periodic ``resources`` events in the run's
event log (:class:`ResourceSampler`, so the report can summarise a finished run), and the
summary itself (:func:`summarize_resources`). It does not decide when an agent samples
(the agent starts and closes a sampler).

NVML comes from ``nvidia-ml-py`` (optional): without it, or without a driver, GPU fields
are simply absent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("flexrun.observe")


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    name: str
    utilization_ratio: float
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_celsius: float


@dataclass(frozen=True, slots=True)
class ResourceSample:
    """One look at the node."""

    cpu_ratio: float
    """CPU busy fraction over all cores since the previous sample (0..1)."""
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int
    disk_used_bytes: int
    disk_total_bytes: int
    disk_path: str
    net_received_bytes: int
    """Cumulative since boot (a counter)."""
    net_sent_bytes: int
    load1: float
    gpus: tuple[GpuSample, ...] = field(default_factory=tuple)

    def as_event(self) -> dict[str, Any]:
        """Fields of a ``resources`` event (flat, JSON-friendly)."""
        out: dict[str, Any] = {
            "cpu_ratio": round(self.cpu_ratio, 4),
            "cpu_count": self.cpu_count,
            "mem_used_bytes": self.memory_used_bytes,
            "mem_total_bytes": self.memory_total_bytes,
            "disk_used_bytes": self.disk_used_bytes,
            "disk_total_bytes": self.disk_total_bytes,
            "net_rx_bytes": self.net_received_bytes,
            "net_tx_bytes": self.net_sent_bytes,
            "load1": round(self.load1, 3),
        }
        if self.gpus:
            out["gpus"] = [
                {
                    "index": g.index,
                    "name": g.name,
                    "util_ratio": round(g.utilization_ratio, 4),
                    "mem_used_bytes": g.memory_used_bytes,
                    "mem_total_bytes": g.memory_total_bytes,
                    "temp_c": g.temperature_celsius,
                }
                for g in self.gpus
            ]
        return out


class _Nvml:
    """NVML, initialised once; ``available`` is False without the package or a driver."""

    def __init__(self) -> None:
        self.available = False
        self._lib: Any = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - ImportError or any NVMLError: no GPUs here
            log.debug("NVML unavailable: %s", exc)
            return
        self._lib = pynvml
        self.available = True

    def sample(self) -> tuple[GpuSample, ...]:
        if not self.available:
            return ()
        nv = self._lib
        out = []
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util = nv.nvmlDeviceGetUtilizationRates(h)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                temp = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
                name = nv.nvmlDeviceGetName(h)
                out.append(
                    GpuSample(
                        index=i,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        utilization_ratio=float(util.gpu) / 100.0,
                        memory_used_bytes=int(mem.used),
                        memory_total_bytes=int(mem.total),
                        temperature_celsius=float(temp),
                    )
                )
        except Exception as exc:  # noqa: BLE001 - a GPU fell off the bus: report what we have
            log.warning("NVML sampling failed: %s", exc)
        return tuple(out)


_NVML: _Nvml | None = None
_NVML_LOCK = threading.Lock()


def _nvml() -> _Nvml:
    global _NVML
    with _NVML_LOCK:
        if _NVML is None:
            _NVML = _Nvml()
        return _NVML


def sample_resources(disk_path: str = "/", *, gpus: bool = True) -> ResourceSample:
    """Sample the node now. CPU is measured since the previous call in this process."""
    vm = psutil.virtual_memory()
    try:
        du = psutil.disk_usage(disk_path)
        used, total = int(du.used), int(du.total)
    except OSError:
        used = total = 0
    net = psutil.net_io_counters()
    try:
        load1 = float(psutil.getloadavg()[0])
    except (AttributeError, OSError):
        load1 = 0.0
    return ResourceSample(
        cpu_ratio=float(psutil.cpu_percent(interval=None)) / 100.0,
        cpu_count=int(psutil.cpu_count() or 1),
        memory_used_bytes=int(vm.total - vm.available),
        memory_total_bytes=int(vm.total),
        disk_used_bytes=used,
        disk_total_bytes=total,
        disk_path=disk_path,
        net_received_bytes=int(net.bytes_recv) if net else 0,
        net_sent_bytes=int(net.bytes_sent) if net else 0,
        load1=load1,
        gpus=_nvml().sample() if gpus else (),
    )


class ResourceCollector(Collector):
    """Prometheus collector sampling the node at each scrape (no thread of its own)."""

    def __init__(self, disk_path: str = "/", *, gpus: bool = True) -> None:
        self.disk_path = disk_path
        self.gpus = gpus

    def describe(self) -> Iterable[Metric]:
        return []  # metrics are only known at collect time (GPUs may be absent)

    def collect(self) -> Iterator[Metric]:
        s = sample_resources(self.disk_path, gpus=self.gpus)
        yield _gauge(
            "flexrun_node_cpu_utilization_ratio", "CPU busy fraction, all cores", s.cpu_ratio
        )
        yield _gauge("flexrun_node_cpus", "Logical CPUs", s.cpu_count)
        yield _gauge("flexrun_node_load1", "One-minute load average", s.load1)
        yield _gauge("flexrun_node_memory_used_bytes", "Memory in use", s.memory_used_bytes)
        yield _gauge("flexrun_node_memory_total_bytes", "Physical memory", s.memory_total_bytes)
        disk_used = GaugeMetricFamily(
            "flexrun_node_disk_used_bytes",
            "Disk used on the run directory's filesystem",
            labels=["path"],
        )
        disk_used.add_metric([s.disk_path], s.disk_used_bytes)
        yield disk_used
        disk_total = GaugeMetricFamily(
            "flexrun_node_disk_total_bytes",
            "Size of the run directory's filesystem",
            labels=["path"],
        )
        disk_total.add_metric([s.disk_path], s.disk_total_bytes)
        yield disk_total
        yield CounterMetricFamily(
            "flexrun_node_network_received_bytes",
            "Bytes received, all interfaces",
            value=s.net_received_bytes,
        )
        yield CounterMetricFamily(
            "flexrun_node_network_transmitted_bytes",
            "Bytes sent, all interfaces",
            value=s.net_sent_bytes,
        )
        if s.gpus:
            util = GaugeMetricFamily(
                "flexrun_gpu_utilization_ratio", "GPU busy fraction", labels=["gpu", "name"]
            )
            used = GaugeMetricFamily(
                "flexrun_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu", "name"]
            )
            total = GaugeMetricFamily(
                "flexrun_gpu_memory_total_bytes", "GPU memory", labels=["gpu", "name"]
            )
            temp = GaugeMetricFamily(
                "flexrun_gpu_temperature_celsius", "GPU temperature", labels=["gpu", "name"]
            )
            for g in s.gpus:
                lab = [str(g.index), g.name]
                util.add_metric(lab, g.utilization_ratio)
                used.add_metric(lab, g.memory_used_bytes)
                total.add_metric(lab, g.memory_total_bytes)
                temp.add_metric(lab, g.temperature_celsius)
            yield from (util, used, total, temp)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ResourceSampler:
    """Emits a ``resources`` event every ``interval_s`` through ``emit(event, **fields)``.

    ``emit`` is typically ``EventLog.emit``; sampling errors are logged, never raised into
    the agent.
    """

    def __init__(
        self, emit: Any, *, interval_s: float = 10.0, disk_path: str = "/", gpus: bool = True
    ) -> None:
        self._emit = emit
        self.interval_s = interval_s
        self.disk_path = disk_path
        self.gpus = gpus
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> ResourceSample:
        s = sample_resources(self.disk_path, gpus=self.gpus)
        self._emit("resources", **s.as_event())
        return s

    def start(self) -> None:
        if self._thread is None:
            psutil.cpu_percent(interval=None)  # prime: the first real sample covers one interval
            self._thread = threading.Thread(target=self._run, name="flexrun-resources", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 - observability must not stop training
                log.exception("resource sampling failed")

    def close(self) -> None:
        """Stop sampling. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def summarize_resources(events: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per node: samples, mean/max CPU, max memory, network bytes moved, per-GPU mean/max.

    Returns ``{node: {...}}`` for nodes with at least one ``resources`` event.
    """
    per: dict[str, list[Mapping[str, Any]]] = {}
    for e in events:
        if e.get("event") == "resources":
            per.setdefault(str(e.get("node", "?")), []).append(e)
    out: dict[str, dict[str, Any]] = {}
    for node, samples in sorted(per.items()):
        cpu = [float(s.get("cpu_ratio", 0.0)) for s in samples]
        mem = [int(s.get("mem_used_bytes", 0)) for s in samples]
        rx = [int(s.get("net_rx_bytes", 0)) for s in samples]
        tx = [int(s.get("net_tx_bytes", 0)) for s in samples]
        summary: dict[str, Any] = {
            "samples": len(samples),
            "cpu_mean_ratio": sum(cpu) / len(cpu),
            "cpu_max_ratio": max(cpu),
            "mem_max_bytes": max(mem),
            "mem_total_bytes": int(samples[-1].get("mem_total_bytes", 0)),
            "net_rx_bytes": max(rx) - min(rx),
            "net_tx_bytes": max(tx) - min(tx),
        }
        gpus: dict[int, list[Mapping[str, Any]]] = {}
        for s in samples:
            for g in s.get("gpus") or []:
                gpus.setdefault(int(g.get("index", 0)), []).append(g)
        if gpus:
            summary["gpus"] = {
                i: {
                    "util_mean_ratio": sum(float(g.get("util_ratio", 0)) for g in gs) / len(gs),
                    "util_max_ratio": max(float(g.get("util_ratio", 0)) for g in gs),
                    "mem_max_bytes": max(int(g.get("mem_used_bytes", 0)) for g in gs),
                    "temp_max_c": max(float(g.get("temp_c", 0)) for g in gs),
                }
                for i, gs in sorted(gpus.items())
            }
        out[node] = summary
    return out
