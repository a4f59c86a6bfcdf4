"""A phase that runs out of GPU memory: one line naming the phase, what torch held, the plan's figure
and the binding to change; exit 5; the manager does not retry it."""

import pytest
import torch

from experiments.errors import DETERMINISTIC_FAILURES
from experiments.execute import describe_failure
from rlhf.allocator import OutOfMemory, oom_line
from rlhf.errors import EXIT_OUT_OF_MEMORY
from rlhf.memory.plan import relief
from rlhf.trainer import PhaseTimer
from tests.rlhf.test_memory_plan import instruct


def test_the_binding_to_change_is_the_one_that_shrinks_the_phase():
    packed = instruct("ppo.max_tokens_per_micro_batch = 8192", "ppo.forward_max_tokens_per_micro_batch = 32768")
    assert relief(packed, "update_actor") == "ppo.max_tokens_per_micro_batch = 4096"
    assert relief(packed, "update_critic") == "ppo.max_tokens_per_micro_batch = 4096"
    assert relief(packed, "old_logprobs") == "ppo.forward_max_tokens_per_micro_batch = 16384"
    # at the smallest budget that holds a sequence (1024 + 512): checkpointing, then the engine asleep
    tight = instruct("ppo.max_tokens_per_micro_batch = 2048", "ppo.forward_max_tokens_per_micro_batch = 2048",
                     "ppo.gradient_checkpointing = False")
    assert relief(tight, "update_actor") == "ppo.gradient_checkpointing = True"
    assert relief(tight, "reference") == "ppo.vllm_sleep = True"
    assert relief(tight, "generate") == "ppo.vllm_sleep = True"
    padded = instruct("ppo.max_tokens_per_micro_batch = 0", "ppo.forward_max_tokens_per_micro_batch = 0",
                      "ppo.gradient_checkpointing = True",
                      "ppo.micro_batch_size = 4", "ppo.forward_micro_batch_size = 8")
    assert relief(padded, "update_actor") == "ppo.micro_batch_size = 2"
    assert relief(padded, "values") == "ppo.forward_micro_batch_size = 4"
    hf = instruct("ppo.rollout_backend = 'hf'", "ppo.rollout_micro_batch_size = 16")
    assert relief(hf, "generate").startswith("ppo.rollout_micro_batch_size = 8 (and ppo.num_rollout_batches = 16")


def test_the_line_says_phase_measurement_plan_and_fix():
    line = oom_line("update_critic", 124.1, 138.7, 139.8, 109.8, "ppo.max_tokens_per_micro_batch = 4096")
    assert line.startswith("out of GPU memory in update_critic: torch held 124.1 GiB allocated and 138.7 GiB "
                           "reserved of 139.8 GiB; the memory plan predicted 109.8 GiB for this phase; "
                           "set ppo.max_tokens_per_micro_batch = 4096")
    assert "--resume continues" in line and "\n" not in line
    assert "had no figure" in oom_line("advantages", 1.0, 1.0, 80.0, None, "ppo.vllm_sleep = True")


def test_a_phase_that_runs_out_raises_the_line_and_still_records_its_time():
    seen = []

    def line(phase, allocated, reserved):
        seen.append((phase, allocated, reserved))
        return f"out of GPU memory in {phase}"

    timer = PhaseTimer(None, out_of_memory=line)
    with pytest.raises(OutOfMemory, match="out of GPU memory in update_actor") as info:
        with timer("update_actor"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert seen == [("update_actor", None, None)]  # no CUDA device in this process: nothing measured here
    assert "update_actor" in timer.times
    with pytest.raises(ValueError):  # any other error passes through as it is
        with timer("values"):
            raise ValueError("not memory")


def test_the_manager_records_it_and_does_not_retry_it():
    assert EXIT_OUT_OF_MEMORY == 5 and EXIT_OUT_OF_MEMORY in DETERMINISTIC_FAILURES
    text = describe_failure(5, "error: out of GPU memory in update_actor: torch held ...")
    assert text.startswith("out of GPU memory (exit 5): ") and "in update_actor" in text
