"""bench/host_probe.py tells a call that works from one that waits, and counts the collector's pauses
inside it (and only inside it)."""

import gc
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from host_probe import CallProbe, GCTimer, summarize  # noqa: E402


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append(a)  # garbage only the collector frees


def test_a_working_call_is_busy_and_a_waiting_one_is_not():
    with CallProbe() as working:
        spin(0.3)
    with CallProbe() as waiting:
        time.sleep(0.3)
    # The spinning call's CPU time is its own however busy the machine is; the sleeping call's is ~0.
    assert 0.3 <= working.record["thread_cpu_s"] <= working.record["wall_s"] + 0.01
    assert working.record["thread_busy"] == working.record["thread_cpu_s"] / working.record["wall_s"]
    assert waiting.record["thread_cpu_s"] < 0.05 and waiting.record["wall_s"] >= 0.29
    assert waiting.record["thread_busy"] < working.record["thread_busy"]
    assert working.record["device"] == {} and working.record["gc_pause_s"] == 0


def test_another_threads_work_counts_in_the_process_not_in_the_calling_thread():
    other = threading.Thread(target=spin, args=(0.3,))
    other.start()  # alive when the call starts
    with CallProbe() as probe:
        other.join()
    assert probe.record["process_cpu_s"] >= 0.25 and probe.record["thread_cpu_s"] < 0.1
    assert probe.record["threads"] >= 2


def test_the_collectors_passes_are_timed_by_generation_inside_the_call_only():
    with GCTimer() as timer:
        gc.collect()  # before the call: not the call's
        with CallProbe(timer) as probe:
            cycles(20_000)
            gc.collect()
        timer.tag = "later"
        gc.collect(0)
    assert probe.record["gc"]["gen2"]["count"] >= 1 and probe.record["gc_pause_s"] > 0
    assert probe.record["gc"]["gen2"]["longest_ms"] <= 1e3 * probe.record["wall_s"]
    assert sum(g["count"] for g in probe.record["gc"].values()) < len(timer.pauses)
    assert timer.pauses[-1][0] == 0 and timer.pauses[-1][2] == "later"
    assert GCTimer._callback.__get__(timer) not in gc.callbacks  # removed on exit


def test_device_samples_are_summarized_per_reading():
    readings = iter([{"sm_clock_mhz": 1980, "power_w": 300.0}, {"sm_clock_mhz": 1500, "power_w": 500.0},
                     {"sm_clock_mhz": 1755}])
    probe = CallProbe(read=lambda: next(readings, {"sm_clock_mhz": 1755}), interval_s=0.01)
    with probe:
        time.sleep(0.1)
    device = probe.record["device"]
    assert device["sm_clock_mhz"]["min"] == 1500 and device["sm_clock_mhz"]["max"] == 1980
    assert device["power_w"] == {"median": 400.0, "min": 300.0, "max": 500.0}
    assert summarize([]) == {}


@pytest.mark.parametrize("broken", [RuntimeError("NVML refused"), None])
def test_a_reading_that_fails_is_left_out(broken):
    def read():
        if broken is not None:
            raise broken
        return {"utilization": 50}
    with CallProbe(read=read, interval_s=0.01) as probe:
        time.sleep(0.05)
    assert probe.record["device"] == ({} if broken else {"utilization": {"median": 50, "min": 50, "max": 50}})


def test_no_device_reader_without_a_gpu():
    from host_probe import device_reader
    assert device_reader("cpu") is None


class Loop:
    def step(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_method_timer_times_each_call_and_puts_the_methods_back():
    from host_probe import MethodTimer
    loop = Loop()
    hook = lambda: "own"  # noqa: E731  # an instance attribute, as vLLM's step_fn is
    loop.hook = hook
    with MethodTimer({"step": (loop, "step"), "hook": (loop, "hook")}) as timer:
        results = [loop.step(0.01) for _ in range(9)] + [loop.step(0.2)]
        assert loop.hook() == "own"
        with pytest.raises(TypeError):
            loop.step()  # a failing call is timed too
    assert results[-1] == 0.2 and "step" not in vars(loop) and loop.hook is hook
    steps = timer.summary()["step"]
    assert steps["count"] == 11 and timer.summary()["hook"]["count"] == 1
    assert steps["total_s"] >= 0.29 and steps["cpu_s"] < steps["total_s"]
    assert 10 <= steps["median_ms"] < 60 and steps["max_ms"] >= 200
    # The one long call stalls beyond the median; the others do not.
    assert 0.14 <= steps["stall_s"] <= steps["max_ms"] / 1e3
    assert MethodTimer({"x": (loop, "step")}).summary() == {"x": {"count": 0}}


def test_the_engine_steps_are_split_into_host_parts_and_the_wait_for_the_gpu():
    """bench/gpu_rollout.py's hooks on an in-process vLLM engine's loop (its objects' layout: LLMEngine ->
    InprocClient -> EngineCore -> scheduler, executor), here on stand-ins that sleep for each part."""
    from types import SimpleNamespace

    from gpu_rollout import engine_step_targets, step_split
    from host_probe import MethodTimer

    class Part:
        def __init__(self, seconds):
            self.seconds = seconds

        def __call__(self, *args):
            time.sleep(self.seconds)

    scheduler = SimpleNamespace(schedule=Part(0.01), update_from_output=Part(0.01))
    executor = SimpleNamespace(execute_model=Part(0.02))  # no sample_tokens: left out
    core = SimpleNamespace(scheduler=scheduler, model_executor=executor)
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=core), output_processor=None)

    def step():
        scheduler.schedule()
        executor.execute_model()
        time.sleep(0.05)  # the GPU's tokens
        scheduler.update_from_output()
    engine.step = step
    targets = engine_step_targets(SimpleNamespace(llm_engine=engine))
    assert sorted(targets) == ["execute_model", "schedule", "step", "update_from_output"]
    with MethodTimer(targets) as timer:
        for _ in range(3):
            engine.step()
    split = step_split(timer.summary())
    assert set(split) == {"schedule_s", "update_from_output_s", "execute_model_s", "gpu_wait_s"}
    assert split["execute_model_s"] >= 0.06 and split["gpu_wait_s"] >= 0.14
    assert split["gpu_wait_s"] < timer.summary()["step"]["total_s"]
    assert engine.step is step and scheduler.schedule.seconds == 0.01  # put back


@pytest.mark.parametrize("setting", ["default", "not_sampled", "collector_off", "one_thread", "frozen"])
def test_each_host_setting_of_a_variance_call_is_put_back_but_the_freeze(setting):
    import torch
    from gpu_rollout import host_setting
    threads, frozen = torch.get_num_threads(), gc.get_freeze_count()
    with host_setting(setting):
        assert gc.isenabled() == (setting != "collector_off")
        assert (gc.get_freeze_count() > frozen) == (setting == "frozen")
        assert (torch.get_num_threads() == 1) == (setting == "one_thread" or threads == 1)
    assert gc.isenabled() and torch.get_num_threads() == threads
    assert (gc.get_freeze_count() > frozen) == (setting == "frozen")  # vLLM's own freeze is not undone
    gc.unfreeze()
    with pytest.raises(ValueError, match="one of default"):
        with host_setting("fast"):
            pass
