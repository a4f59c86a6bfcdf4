"""Each phase's peak memory is measured where the phase's roles are held: by the controller's
`PhaseTimer` in one process, by each rank's host on Ray (rlhf/gpu_monitor.py `PhaseMemory`), which
learns the phase from the name each call carries (rlhf/profiling.py `in_phase`), reports it with the
step's device report, and gives the cache back after each call as the local placement does."""

import types

import torch

from rlhf.gpu_monitor import PhaseMemory, merge_device_reports
from rlhf.placement.proxy import ray_proxy
from rlhf.profiling import open_phase
from rlhf.roles.dispatch import ALL, spread
from rlhf.roles.reference import Reference
from rlhf.trainer import PhaseTimer, PPOTrainer


def test_a_call_to_the_ranks_carries_the_phase_it_was_made_in():
    sent = []

    class Host:  # what a rank's host receives: its `call_in_phase` is the Ray method the proxy calls
        call_in_phase = types.SimpleNamespace(remote=lambda *args, **kwargs: sent.append(args[:3]))

    proxy = ray_proxy("reference", Reference, [Host(), Host()])
    timer = PhaseTimer(None)
    with timer("reference"):
        assert open_phase() == "reference"
        proxy.start("compute_logprobs", spread(ALL, 2, ("batch",), {}, "reference.compute_logprobs"))
    assert open_phase() is None
    proxy.start("generate", spread(ALL, 2, ("requests",), {}, "actor.generate"))  # a rollout run ahead
    assert sent == [("reference", "reference", "compute_logprobs")] * 2 + [(None, "reference", "generate")] * 2


def test_the_ranks_reports_merge_to_each_phase_s_largest():
    """Memory, the time a phase ran on a rank and how busy its host was: the slowest, fullest rank's."""
    merged = merge_device_reports([
        {"perf/memory_gb/update_actor": 30.0, "perf/memory_reserved_gb/update_actor": 31.0,
         "perf/max_memory_allocated_gb": 30.0, "perf/gpu_utilization": 0.8,
         "perf/rank_s/update_actor": 2.0, "perf/host_busy/update_actor": 0.4},
        {"perf/memory_gb/update_actor": 32.0, "perf/memory_reserved_gb/update_actor": 30.5,
         "perf/memory_gb/values": 12.0, "perf/max_memory_allocated_gb": 32.0, "perf/gpu_utilization": 0.6,
         "perf/rank_s/update_actor": 2.5, "perf/host_busy/update_actor": 0.3},
    ])
    assert merged == {"perf/memory_gb/update_actor": 32.0, "perf/memory_reserved_gb/update_actor": 31.0,
                      "perf/memory_gb/values": 12.0, "perf/max_memory_allocated_gb": 32.0,
                      "perf/gpu_utilization": 0.7, "perf/rank_s/update_actor": 2.5,
                      "perf/host_busy/update_actor": 0.4}


def test_off_a_gpu_nothing_is_measured_and_the_call_runs():
    phases = PhaseMemory(torch.device("cpu"))
    with phases.measure("update_actor") as peaks:
        assert peaks() == (None, None)
    assert phases.take() == {} and phases.allocated == {}


def test_a_phase_out_of_memory_on_ray_is_told_with_the_ranks_figures():
    """The controller holds no GPU on Ray: the line takes the phase's figures from the ranks' report
    and the device's size from what they reported when placed."""
    from rlhf.memory.plan import relief
    from tests.rlhf.test_memory_plan import instruct

    cfg = instruct()
    fake = types.SimpleNamespace(
        memory_plan=None, device=torch.device("cpu"), cfg=cfg, longest_prompt=None,
        placement={"roles": {"actor": [{"device_total_gb": 79.2}, {"device_total_gb": 79.6}]}},
        roles=types.SimpleNamespace(device_report=lambda: {"perf/memory_gb/update_critic": 71.5,
                                                           "perf/memory_reserved_gb/update_critic": 77.0}))
    line = PPOTrainer.out_of_memory_line(fake, "update_critic", None, None)  # pyright: ignore[reportArgumentType]
    assert line.startswith("out of GPU memory in update_critic: torch held 71.5 GiB allocated and 77.0 GiB "
                           "reserved of 79.2 GiB; the memory plan had no figure for this phase; "
                           f"set {relief(cfg, 'update_critic', None)}")
