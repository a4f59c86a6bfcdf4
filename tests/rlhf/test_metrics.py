"""The step record (rlhf/metrics.py `step_record`): a pure function of what the phases returned."""

import torch

from rlhf.batch import Batch
from rlhf.metrics import is_known_metric, is_machine_metric, step_record


def rollout():
    return Batch({"scores": torch.tensor([1.0, 0.0, 1.0, 0.0]), "correct": torch.tensor([True, False, True, False]),
                  "finished": torch.tensor([True, True, False, True]),
                  "well_formed": torch.tensor([True, False, True, True]),
                  "prompt_mask": torch.ones(4, 3, dtype=torch.long),
                  "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])})


def record(**overrides):
    args = dict(advantages={"kl_divergence": 0.5, "kl_coef": 0.1}, critic={"critic/value_loss": 2.0},
                actor={"actor/pg_loss": 0.25, "actor/clip_fraction": 0.125}, entropy_old=torch.full((4, 3), 2.0),
                logprob_gap=None, prompt_truncated_fraction=None, phase_times={"generate": 2.0, "update_actor": 1.0},
                phase_memory_gb={}, step_s=4.0, generate_ahead_s=0.0, max_rss_gb=1.5, device_report={})
    args.update(overrides)
    return step_record(rollout(), **args)


def test_step_record_from_the_phases_in_metrics_order():
    out = record()
    assert list(out)[:4] == ["kl_divergence", "kl_coef", "critic/value_loss", "actor/pg_loss"]
    assert out["reward_mean"] == 0.5 and out["accuracy"] == 0.5 and out["clip_fraction"] == 0.125
    assert out["clip_fraction_lower"] is None  # the actor did not report it
    assert out["response_length_mean"] == 2.0 and out["response_clip_ratio"] == 0.25
    assert out["rollout_success_rate"] == 0.5 and out["actor/entropy_old"] == 2.0
    assert out["perf/tokens_per_s"] == (12 + 8) / 4.0 and out["perf/generated_tokens_per_s"] == 8 / 2.0
    assert out["timing_s/generate"] == 2.0 and "timing_s/generate_ahead" not in out
    assert "rollout/logprob_gap" not in out and "rollout/prompt_truncated_fraction" not in out
    assert "perf/max_memory_allocated_gb" not in out
    assert all(is_known_metric(k) for k in out)
    computed = [k for k in out if not is_machine_metric(k)]
    assert computed[-1] == "actor/entropy_old"  # the machine's measurements come last


def test_step_record_optional_names():
    out = record(logprob_gap=0.01, prompt_truncated_fraction=0.25, generate_ahead_s=1.0,
                 phase_memory_gb={"generate": 3.0, "update_actor": 5.0}, device_report={"perf/gpu_utilization": 0.9})
    assert list(out).index("rollout/logprob_gap") == 2  # after the advantage phase's names
    assert out["rollout/prompt_truncated_fraction"] == 0.25
    assert out["timing_s/generate_ahead"] == 1.0 and out["perf/generated_tokens_per_s"] == 8 / 3.0
    assert out["perf/memory_gb/update_actor"] == 5.0 and out["perf/max_memory_allocated_gb"] == 5.0
    assert out["perf/gpu_utilization"] == 0.9
    assert not any(k.startswith("perf/host_busy/") for k in out)


def test_host_busy_is_the_phase_threads_cpu_over_its_wall_time():
    out = record(phase_host_cpu_s={"generate": 1.5, "update_actor": 0.25, "never_timed": 1.0})
    assert out["perf/host_busy/generate"] == 0.75 and out["perf/host_busy/update_actor"] == 0.25
    assert "perf/host_busy/never_timed" not in out  # no wall time to divide by
    assert record(phase_host_cpu_s={"generate": 2.5})["perf/host_busy/generate"] == 1.0  # clock granularity
    assert all(is_machine_metric(k) and is_known_metric(k) for k in out if k.startswith("perf/host_busy/"))
    assert record()["reward_std"] == float(rollout()["scores"].std())


def test_the_phase_timer_takes_the_threads_cpu_time_of_each_phase():
    import time

    from rlhf.trainer import PhaseTimer

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    timer = PhaseTimer(None)
    with timer("generate"):
        spin(0.2)
    with timer("generate"):  # a phase run twice in a step adds up, as its wall time does
        spin(0.1)
    with timer("update_actor"):
        time.sleep(0.2)
    # The spinning phase's CPU time is its own whatever else the machine runs; the sleeping one's is ~0.
    assert 0.3 <= timer.host_cpu["generate"] <= timer.times["generate"] + 0.01
    assert timer.host_cpu["update_actor"] < 0.05 and timer.times["update_actor"] >= 0.2
    out = record(phase_times=timer.times, phase_host_cpu_s=timer.host_cpu)
    assert out["perf/host_busy/generate"] == min(1.0, timer.host_cpu["generate"] / timer.times["generate"])
    assert out["perf/host_busy/update_actor"] < 0.25


def test_a_ranks_clock_reports_each_phase_s_time_and_busy_host_once():
    """On Ray each rank's host times the calls it runs under a phase's name (rlhf/placement/host.py):
    calls outside any phase are not timed, a phase's calls add up, and each report holds what ran
    since the last one."""
    import time

    from rlhf.metrics import HOST_BUSY_KEY, RANK_TIME_KEY
    from rlhf.profiling import PhaseClock

    clock = PhaseClock()
    with clock.measure(None):
        time.sleep(0.05)
    assert clock.take() == {}
    for _ in range(2):
        with clock.measure("update_actor"):
            end = time.thread_time() + 0.1
            while time.thread_time() < end:
                pass
    with clock.measure("values"):
        time.sleep(0.1)
    report = clock.take()
    assert set(report) == {f"{RANK_TIME_KEY}update_actor", f"{RANK_TIME_KEY}values",
                           f"{HOST_BUSY_KEY}update_actor", f"{HOST_BUSY_KEY}values"}
    assert report[f"{RANK_TIME_KEY}update_actor"] >= 0.2 and report[f"{RANK_TIME_KEY}values"] >= 0.1
    assert report[f"{HOST_BUSY_KEY}values"] < 0.25 < report[f"{HOST_BUSY_KEY}update_actor"] <= 1.0
    assert all(is_machine_metric(k) and is_known_metric(k) for k in report)
    assert clock.take() == {}
