"""Device utilisation and memory for /metrics: the CPU through psutil, NVIDIA GPUs through NVML."""

from __future__ import annotations

import logging

import psutil
import torch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


def _nvml_handles(device: torch.device) -> list:
    """NVML handles of the visible GPUs when the engine runs on CUDA and NVML loads; else []."""
    if device.type != "cuda":
        return []
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception as exc:  # no driver or library: GPU figures are simply absent
        log.warning("NVML unavailable, GPU metrics disabled: %s", exc)
        return []


class DeviceCollector(Collector):
    """shoal:device_utilization_perc (0-1) and shoal:device_memory_{used,total}_bytes per device
    ("cpu", "cuda:N"), plus the worker process's resident memory. CPU utilisation is system-wide,
    averaged since the previous scrape."""

    def __init__(self, device: torch.device):
        self.process = psutil.Process()
        psutil.cpu_percent()  # the first reading starts the averaging window
        self.gpus = _nvml_handles(device)

    def collect(self):
        utilization = GaugeMetricFamily(
            "shoal:device_utilization_perc", "Device busy fraction (0-1).", labels=["device"]
        )
        used = GaugeMetricFamily("shoal:device_memory_used_bytes", "Device memory in use.", labels=["device"])
        total = GaugeMetricFamily("shoal:device_memory_total_bytes", "Device memory size.", labels=["device"])
        memory = psutil.virtual_memory()
        utilization.add_metric(["cpu"], psutil.cpu_percent() / 100.0)
        used.add_metric(["cpu"], memory.total - memory.available)
        total.add_metric(["cpu"], memory.total)
        if self.gpus:
            import pynvml

            for index, handle in enumerate(self.gpus):
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                utilization.add_metric([f"cuda:{index}"], pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
                used.add_metric([f"cuda:{index}"], info.used)
                total.add_metric([f"cuda:{index}"], info.total)
        yield utilization
        yield used
        yield total
        yield GaugeMetricFamily(
            "shoal:process_resident_memory_bytes",
            "Resident memory of this worker process.",
            value=self.process.memory_info().rss,
        )
