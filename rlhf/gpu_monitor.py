"""What the GPU did over each PPO step: its utilisation, sampled from NVML in a background thread,
and the memory torch held in each phase (`PhaseMemory`), in whichever process the phase ran.

`perf/gpu_utilization` (a fraction, 0-1) is the mean of NVML's "percent of time a kernel was
running" readings taken every `interval_s` during the step: the signal the tuning guide reads
to raise `rollout_micro_batch_size` when the GPU idles. torch.cuda.utilization() maps the
torch device through CUDA_VISIBLE_DEVICES to NVML's index and needs `nvidia-ml-py` (installed
with vLLM); without it, or without a GPU, the monitor is off and the metric is not logged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, List, Optional

import torch

from rlhf.memory.formulas import GIB
from rlhf.metrics import HOST_BUSY_KEY, PHASE_KEYS, RANK_TIME_KEY


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


class PhaseMemory:
    """The most memory torch held on `device` during each phase, allocated
    (`torch.cuda.max_memory_allocated`) and reserved by its caching allocator (`max_memory_reserved`),
    both reset as each phase starts: what the memory plan's phases predict (rlhf/memory/plan.py), kept
    by phase name in `allocated` and `reserved` (GiB), less what a sleeping vLLM engine's pool keeps
    counted though its memory is released (`off_device()`, bytes). Each phase gives its cached blocks
    back as it ends (`torch.cuda.empty_cache`), so the next phase's reserve is its own and the awake
    vLLM engine finds the memory it was promised. The process that holds the roles measures: the
    controller's `PhaseTimer` in the local placement, each rank's host on Ray. Off a GPU it does nothing."""

    def __init__(self, device: torch.device | None, off_device: Callable[[], int] | None = None):
        self.device = device if device is not None and device.type == "cuda" else None
        self.off_device = off_device or (lambda: 0)
        self.allocated: Dict[str, float] = {}
        self.reserved: Dict[str, float] = {}

    @contextlib.contextmanager
    def measure(self, name: Optional[str]):
        """Measures the code inside as the phase `name` (None: the peaks reset and the cache emptied,
        nothing kept). Yields the function `peaks()` giving (allocated, reserved) GiB so far, for a
        phase that fails (None, None off a GPU)."""
        if self.device is None:
            yield lambda: (None, None)
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        off = self.off_device()  # a sleeping engine's pool: counted by torch, not held
        try:
            yield lambda: self._peaks(off)
        finally:
            # An engine asleep through the phase: its pool was off the device all along. One that
            # woke (or went to sleep) in it held its memory at some point: nothing to take off.
            allocated, reserved = self._peaks(min(off, self.off_device()) if off else 0)
            if name is not None:
                self.allocated[name] = max(self.allocated.get(name, 0.0), allocated)
                self.reserved[name] = max(self.reserved.get(name, 0.0), reserved)
            torch.cuda.empty_cache()

    def _peaks(self, off: int) -> tuple[float, float]:
        """This phase's peak (allocated, reserved) GiB on the device, less `off` bytes counted but not held."""
        return ((torch.cuda.max_memory_allocated(self.device) - off) / GIB,
                (torch.cuda.max_memory_reserved(self.device) - off) / GIB)

    def take(self) -> Dict[str, float]:
        """The phases measured since the last call, as step-record keys (`PHASE_KEYS`), and forgets them."""
        out = {f"{PHASE_KEYS[0]}{k}": v for k, v in self.allocated.items()}
        out.update({f"{PHASE_KEYS[1]}{k}": v for k, v in self.reserved.items()})
        self.allocated, self.reserved = {}, {}
        return out


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
    """Over several processes: the largest peak memory, overall and of each phase a process measured
    (`PhaseMemory.take`), the longest time a phase ran in one and the busiest host
    (rlhf/profiling.py `PhaseClock.take`), and the mean utilisation."""
    out = {}
    for report in reports:
        for key, value in report.items():
            if key.startswith((*PHASE_KEYS, RANK_TIME_KEY, HOST_BUSY_KEY)) or key == "perf/max_memory_allocated_gb":
                out[key] = max(out.get(key, value), value)
    util = [r["perf/gpu_utilization"] for r in reports if "perf/gpu_utilization" in r]
    if util:
        out["perf/gpu_utilization"] = sum(util) / len(util)
    return out
