"""Where a call's wall time goes on the host: the calling thread's CPU time, the whole process's, the
garbage collector's pauses, and the GPU's clock and power while it ran (for the benchmarks; not a test).

A decoding loop driven from the host (vLLM's engine in this process) is slow either because the host
works longer for each step (more CPU time in the calling thread), because the thread waits without
working (the GIL held by another thread, the OS scheduler, a GPU that runs slower), or because the
collector stops it. `CallProbe` tells these apart for one call:

    with GCTimer() as gc_timer:
        with CallProbe(gc_timer, device_reader(device)) as probe:
            llm.generate(...)
        probe.record  # {'wall_s', 'thread_cpu_s', 'process_cpu_s', 'gc', 'threads', 'device'}

`MethodTimer` times each call of chosen methods inside the block (a decoding loop's steps and their
parts): whether a slow call's steps are all slower or a few of them stall.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

Pause = Tuple[int, float, Optional[str]]  # (generation, seconds, the tag current when it ran)


class GCTimer:
    """Times every collection of this process by generation (`gc.callbacks`) while the block runs.
    `tag` labels the pauses that start while it is set (e.g. 'step' inside an iteration)."""

    def __init__(self) -> None:
        self.pauses: List[Pause] = []
        self.tag: Optional[str] = None
        self._started: Optional[float] = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((info["generation"], time.perf_counter() - self._started, self.tag))
            self._started = None

    def __enter__(self) -> "GCTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    @staticmethod
    def table(pauses: List[Pause]) -> Dict[str, dict]:
        """Per generation: how many passes, their total and their longest pause (ms)."""
        by_gen: Dict[int, List[float]] = {0: [], 1: [], 2: []}
        for generation, seconds, _ in pauses:
            by_gen[generation].append(seconds)
        return {f"gen{g}": {"count": len(p), "total_ms": 1e3 * sum(p), "longest_ms": 1e3 * max(p, default=0.0)}
                for g, p in by_gen.items()}


def device_reader(device) -> Optional[Callable[[], dict]]:
    """A function reading the GPU's SM clock (MHz), power (W) and utilisation (0-1) through torch's NVML
    helpers, or None where the engine's own utilisation reader finds no NVML (rlhf/gpu_monitor.py)."""
    import torch

    from rlhf.gpu_monitor import nvml_reader
    utilization = nvml_reader(torch.device(device))
    if utilization is None:
        return None
    return lambda: {"sm_clock_mhz": torch.cuda.clock_rate(device), "power_w": torch.cuda.power_draw(device) / 1e3,
                    "utilization": utilization()}


class CallProbe:
    """Measures the block: wall time, the CPU time of the thread that runs it and of the whole process,
    the collector's pauses inside it (from a running `GCTimer`), the threads alive at its start or end
    (the most of the two), and, with `read`,
    the device readings sampled every `interval_s` by a thread of its own (median and range)."""

    def __init__(self, gc_timer: Optional[GCTimer] = None, read: Optional[Callable[[], dict]] = None,
                 interval_s: float = 0.1):
        self.gc_timer, self.read, self.interval_s = gc_timer, read, interval_s
        self.samples: List[dict] = []
        self.record: dict = {}
        self._stop = threading.Event()
        self._sampler: Optional[threading.Thread] = None

    def _sample(self) -> None:
        assert self.read is not None
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except Exception:  # a reading NVML refuses once is left out
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "CallProbe":
        self._threads = threading.active_count()  # the probe's own sampler not counted
        if self.read is not None:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        self._gc_from = len(self.gc_timer.pauses) if self.gc_timer else 0
        self._t = (time.perf_counter(), time.thread_time(), time.process_time())
        return self

    def __exit__(self, *exc) -> None:
        wall, thread_cpu, process_cpu = (time.perf_counter() - self._t[0], time.thread_time() - self._t[1],
                                         time.process_time() - self._t[2])
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
        threads = max(self._threads, threading.active_count())
        pauses = self.gc_timer.pauses[self._gc_from:] if self.gc_timer else []
        self.record = {"wall_s": wall, "thread_cpu_s": thread_cpu, "process_cpu_s": process_cpu,
                       "thread_busy": thread_cpu / wall if wall > 0 else None,
                       "gc": GCTimer.table(pauses), "gc_pause_s": sum(p for _, p, _ in pauses),
                       "threads": threads,
                       "device": summarize(self.samples)}


def summarize(samples: List[dict]) -> dict:
    """Per reading: the median, lowest and highest of the samples."""
    keys = sorted({k for s in samples for k in s})
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for k in keys if (v := [s[k] for s in samples if k in s])}


class MethodTimer:
    """Times every call of the named methods while the block runs: `targets` maps a label to (object,
    method name); each call's wall time and its thread's CPU time are kept, and the methods are put
    back on exit. `summary()` gives, per label, the count, the totals and the spread of the calls, and
    `stall_s`: the wall time of the calls over 3x the median, beyond that median (a few long steps
    rather than all steps slower)."""

    def __init__(self, targets: Dict[str, Tuple[Any, str]]):
        self.targets = targets
        self.calls: Dict[str, List[Tuple[float, float]]] = {label: [] for label in targets}
        self._saved: List[Tuple[Any, str, Any, bool]] = []

    def _wrap(self, label: str, method: Callable) -> Callable:
        calls = self.calls[label]

        def timed(*args, **kwargs):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                calls.append((time.perf_counter() - t, time.thread_time() - c))
        return timed

    def __enter__(self) -> "MethodTimer":
        for label, (obj, name) in self.targets.items():
            own = name in getattr(obj, "__dict__", {})  # an instance attribute, not the class's method
            method = getattr(obj, name)
            self._saved.append((obj, name, method, own))
            setattr(obj, name, self._wrap(label, method))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, method, own in reversed(self._saved):
            if own:
                setattr(obj, name, method)
            else:
                delattr(obj, name)
        self._saved.clear()

    def summary(self) -> Dict[str, dict]:
        out = {}
        for label, calls in self.calls.items():
            walls = sorted(w for w, _ in calls)
            if not walls:
                out[label] = {"count": 0}
                continue
            median = statistics.median(walls)
            out[label] = {"count": len(walls), "total_s": sum(walls), "cpu_s": sum(c for _, c in calls),
                          "median_ms": 1e3 * median, "p90_ms": 1e3 * walls[int(0.9 * (len(walls) - 1))],
                          "max_ms": 1e3 * walls[-1],
                          "stall_s": sum(w - median for w in walls if w > 3 * median)}
        return out
