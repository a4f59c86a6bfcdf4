"""The forward-only passes' own token budget (`ppo.forward_max_tokens_per_micro_batch`): what it
accepts and what the memory plan makes of it."""

import pytest

from rlhf import memory
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from tests.rlhf.test_memory_plan import H200, SHAPES, run_config


def test_the_forward_budget_defaults_to_the_updates_and_needs_packed_micro_batches():
    assert PPOConfig(max_tokens_per_micro_batch=4096).forward_max_tokens == 4096
    assert PPOConfig(max_tokens_per_micro_batch=4096,
                     forward_max_tokens_per_micro_batch=16384).forward_max_tokens == 16384
    assert PPOConfig().forward_max_tokens == 0  # padded micro-batches
    with pytest.raises(ConfigError, match=r"ppo.forward_max_tokens_per_micro_batch .*needs packed micro-batches"):
        PPOConfig(forward_max_tokens_per_micro_batch=16384)
    with pytest.raises(ConfigError, match=r"at least ppo.max_tokens_per_micro_batch = 8192"):
        PPOConfig(max_tokens_per_micro_batch=8192, forward_max_tokens_per_micro_batch=4096)
    with pytest.raises(ConfigError, match=r"ppo.forward_max_tokens_per_micro_batch"):
        PPOConfig(max_tokens_per_micro_batch=8192, forward_max_tokens_per_micro_batch=-1)


def test_the_plan_sizes_the_forward_passes_by_their_budget_and_the_update_by_its_own():
    same = memory.predict(run_config(max_tokens_per_micro_batch=8192), SHAPES["qwen2.5-7b"], available=H200)
    larger = memory.predict(run_config(max_tokens_per_micro_batch=8192, forward_max_tokens_per_micro_batch=32768),
                            SHAPES["qwen2.5-7b"], available=H200)
    by_name = lambda plan: {p.name: p.transient for p in plan.phases}  # noqa: E731
    a, b = by_name(same), by_name(larger)
    assert a["update_actor"] == b["update_actor"] and a["update_critic"] == b["update_critic"]
    for phase in ("reference", "old_logprobs", "values"):
        assert b[phase] > a[phase], phase  # four times the tokens (the LM head's chunk is the same)
    assert larger.settings["forward_tokens_per_micro_batch"] == 32768
    assert larger.settings["tokens_per_micro_batch"] == 8192

