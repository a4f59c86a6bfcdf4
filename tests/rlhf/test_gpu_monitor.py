"""The GPU utilisation monitor's windows (NVML itself is read only on a GPU machine)."""

import time

import torch

from rlhf.gpu_monitor import UtilizationMonitor, nvml_reader


class Scripted:
    """Readings from a list, one per call; None stands for a failing NVML call."""

    def __init__(self, values):
        self.values, self.calls = list(values), 0

    def __call__(self):
        self.calls += 1
        value = self.values.pop(0) if self.values else 0.5
        if value is None:
            raise RuntimeError("NVML hiccup")
        return value


def test_take_is_the_mean_since_the_previous_take_and_a_failing_read_is_skipped():
    monitor = UtilizationMonitor(Scripted([0.5, 1.0, None, 0.0, 0.25, 0.75, 0.3, None]))
    for _ in range(3):
        monitor.sample()
    assert monitor.take() == 0.75  # (0.5 + 1.0) / 2: the failing reading left out
    for _ in range(3):
        monitor.sample()
    assert monitor.take() == (0.0 + 0.25 + 0.75) / 3
    assert monitor.take() == 0.3  # an empty window (a short step) reads once itself
    assert monitor.take() is None  # ... and gives nothing when that reading fails


def test_the_thread_samples_until_closed():
    read = Scripted([])
    monitor = UtilizationMonitor(read, interval_s=0.01).start()
    deadline = time.monotonic() + 10
    while read.calls < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    monitor.close()
    calls = read.calls
    time.sleep(0.1)
    assert read.calls == calls  # no readings after close
    assert monitor.take() == 0.5


def test_without_nvml_or_gpu_the_monitor_is_off():
    assert nvml_reader(torch.device("cpu")) is None
    monitor = UtilizationMonitor(None).start()
    assert not monitor.enabled and monitor.take() is None
    monitor.close()
