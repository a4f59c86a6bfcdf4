"""GPU utilisation over each PPO step, sampled from NVML in a background thread.

`perf/gpu_utilization` (a fraction, 0-1) is the mean of NVML's "percent of time a kernel was
running" readings taken every `interval_s` during the step: the signal the tuning guide reads
to raise `rollout_micro_batch_size` when the GPU idles. torch.cuda.utilization() maps the
torch device through CUDA_VISIBLE_DEVICES to NVML's index and needs `nvidia-ml-py` (installed
with vLLM); without it, or without a GPU, the monitor is off and the metric is not logged.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

import torch


def nvml_reader(device: torch.device) -> Optional[Callable[[], float]]:
    """A function returning the device's utilisation in [0, 1], or None when NVML is unavailable."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.utilization(device)
    except Exception:  # pynvml missing, NVML not loadable, or a device NVML cannot see
        return None
    return lambda: torch.cuda.utilization(device) / 100.0


class UtilizationMonitor:
    """Samples `read()` every `interval_s` in a daemon thread; `take()` returns the mean since the
    previous `take()` (reading once itself if the window is empty; None when off or when every
    reading failed) and starts a new window."""

    def __init__(self, read: Optional[Callable[[], float]], interval_s: float = 0.2):
        self._read = read
        self._interval = interval_s
        self._samples: List[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def enabled(self) -> bool:
        return self._read is not None

    def start(self) -> "UtilizationMonitor":
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gpu-utilization", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> None:
        """Takes one reading into the current window (the thread calls this every `interval_s`)."""
        if self._read is None:  # off: nothing to read
            return
        try:
            value = float(self._read())
        except Exception:  # a failing reading must never stop training
            return
        with self._lock:
            self._samples.append(value)

    def take(self) -> Optional[float]:
        if self.enabled and not self._samples:
            self.sample()  # a step shorter than the interval: NVML's own reading covers its last moments
        with self._lock:
            samples, self._samples = self._samples, []
        return sum(samples) / len(samples) if samples else None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._interval + 1)
            self._thread = None


class DeviceMonitor:
    """What the advisor's GPU rules read, for one process's device: peak memory allocated since
    the last `take()` and the mean utilisation over that window. On CPU `take()` returns {}."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.utilization = UtilizationMonitor(nvml_reader(self.device))

    def start(self) -> "DeviceMonitor":
        self.utilization.start()
        return self

    def take(self) -> dict:
        if self.device.type != "cuda":
            return {}
        out = {"perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated(self.device) / 2**30}
        utilization = self.utilization.take()
        if utilization is not None:
            out["perf/gpu_utilization"] = utilization
        return out

    def close(self) -> None:
        self.utilization.close()


def merge_device_reports(reports: list) -> dict:
    """Over several processes: the largest peak memory and the mean utilisation."""
    out = {}
    memory = [r["perf/max_memory_allocated_gb"] for r in reports if "perf/max_memory_allocated_gb" in r]
    if memory:
        out["perf/max_memory_allocated_gb"] = max(memory)
    util = [r["perf/gpu_utilization"] for r in reports if "perf/gpu_utilization" in r]
    if util:
        out["perf/gpu_utilization"] = sum(util) / len(util)
    return out
