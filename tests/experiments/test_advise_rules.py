"""Each of the guide's rules fires on a synthetic trace built to trigger it and stays silent on a
healthy one (KL oscillating in 0.03-0.08, reward rising, ~30% of ratios clipped, memory at 88%)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.advisor import AdviceError, Window, advise, build_rules
from experiments.advisor.advise import parse_threshold
from experiments.advisor.rules import (RULES, ClipTooFew, ClipTooMany, FlatReward, GpuMemory, GpuUtilisation,
                                       KLTooHigh, KLTooLow, ResponseLength, RewardSawtooth, RewardVariance,
                                       RolloutSuccess)

STEPS, SEEDS = 50, 3
CONFIG = {"ppo.kl_coef": 0.1, "ppo.clip_range": 0.1, "ppo.actor_learning_rate": 2e-6,
          "ppo.critic_learning_rate": 5e-6, "ppo.max_response_length": 512, "ppo.rollout_micro_batch_size": 16,
          "ppo.num_rollout_batches": 8, "ppo.samples_per_prompt": 1, "ppo.mini_batch_size": 32}


def window_from_arrays(traces, config=None, variant="baseline", device_memory_gb=None) -> Window:
    """A window from synthetic traces: each a 1-D curve (one seed) or 2-D (seeds x steps)."""
    values = {name: np.atleast_2d(np.asarray(trace, float)) for name, trace in traces.items()}
    length = max((a.shape[1] for a in values.values()), default=0)
    values = {k: np.pad(a, ((0, 0), (0, length - a.shape[1])), constant_values=np.nan) for k, a in values.items()}
    n_seeds = max((a.shape[0] for a in values.values()), default=0)
    return Window(variant=variant, steps=np.arange(length), values=values, config=dict(config or {}),
                  device_memory_gb=device_memory_gb, seeds=tuple(range(n_seeds)))


def _seeds(fn):
    return np.stack([fn(np.random.default_rng(seed)) for seed in range(SEEDS)])


def healthy(**replace) -> dict:
    t = np.arange(STEPS)
    traces = {
        "reward_mean": _seeds(lambda r: 1.2 + 0.6 * t / STEPS + r.normal(0, 0.03, STEPS)),
        "kl_divergence": _seeds(lambda r: 0.055 + 0.02 * np.sin(t / 3 + r.uniform(0, 6))),
        "clip_fraction": np.full((SEEDS, STEPS), 0.30), "clip_fraction_lower": np.full((SEEDS, STEPS), 0.20),
        "clip_fraction_upper": np.full((SEEDS, STEPS), 0.10),
        "response_length_mean": _seeds(lambda r: 420 + r.normal(0, 10, STEPS)),
        "response_clip_ratio": np.zeros((SEEDS, STEPS)),
        "rollout_success_rate": np.full((SEEDS, STEPS), 0.99),
        "perf/max_memory_allocated_gb": np.full((SEEDS, STEPS), 0.88 * 141),
        "perf/gpu_utilization": np.full((SEEDS, STEPS), 0.9),
        "critic/explained_variance": np.full((SEEDS, STEPS), 0.5),
    }
    traces.update(replace)
    return traces


def window(config=None, **replace) -> Window:
    return window_from_arrays(healthy(**replace), {**CONFIG, **(config or {})}, device_memory_gb=141)


def flat(value, noise=0.03):
    return _seeds(lambda r: value + r.normal(0, noise, STEPS))


def test_every_rule_is_silent_on_a_healthy_window():
    advice = advise(window())
    assert advice.changes == [] and advice.warnings == []
    assert sorted(advice.silent) == sorted(r.name for r in RULES)


@pytest.mark.parametrize("rule, traces, config, parameter, proposed", [
    (KLTooHigh(), {"kl_divergence": flat(0.2, 0.01)}, {}, "ppo.kl_coef", 0.12),
    (KLTooHigh(), {"kl_divergence": flat(0.1, 0.01), "reward_mean": flat(1.5, 0.2)}, {}, "ppo.kl_coef", 0.12),
    (KLTooLow(), {"kl_divergence": flat(0.005, 0.001), "reward_mean": flat(1.5)}, {}, "ppo.kl_coef", 0.08),
    (ClipTooMany(), {"clip_fraction": flat(0.5, 0.01)}, {}, "ppo.clip_range", 0.12),
    (ClipTooFew(), {"clip_fraction": flat(0.02, 0.005)}, {"ppo.clip_range": 0.2}, "ppo.clip_range", 0.16),
    (RewardVariance(), {"reward_mean": flat(1.5, 0.7)}, {}, "ppo.actor_learning_rate", 1.5e-6),
    (FlatReward(), {"reward_mean": flat(1.5)}, {}, "ppo.critic_learning_rate", 6e-6),  # capped at 3x actor
    (GpuMemory(), {"perf/max_memory_allocated_gb": flat(60.0, 0)}, {}, "ppo.rollout_micro_batch_size", 24),
    (GpuMemory(), {"perf/max_memory_allocated_gb": flat(135.0, 0)}, {}, "ppo.rollout_micro_batch_size", 12),
    (GpuUtilisation(), {"perf/gpu_utilization": flat(60.0, 0)}, {}, "ppo.rollout_micro_batch_size", 24),
])
def test_rule_fires_with_one_change_and_its_evidence(rule, traces, config, parameter, proposed):
    s = rule.check(window(config, **traces))
    assert s is not None and s.parameter == parameter and s.proposed == pytest.approx(proposed)
    assert s.current == {**CONFIG, **config}[parameter] and s.severity > 0 and s.evidence and s.rationale
    assert rule.check(window(config)) is None  # and silent on the healthy window


def test_sawtooth_rise_then_crash_lowers_the_actor_lr():
    t = np.arange(STEPS)
    saw = np.where(t < 30, 1.0 + t / 30, 2.0 - (t - 30) / 8).clip(1.2)
    s = RewardSawtooth().check(window(reward_mean=_seeds(lambda r: saw + r.normal(0, 0.02, STEPS))))
    assert s.parameter == "ppo.actor_learning_rate" and s.proposed == pytest.approx(1.5e-6)
    assert s.evidence["seeds_with_sawtooth"] == SEEDS and s.evidence["crash"] > 0.5 * s.evidence["rise"]


def test_critic_lr_already_at_three_times_the_actor_is_never_raised():
    assert FlatReward().check(window({"ppo.critic_learning_rate": 6e-6}, reward_mean=flat(1.5))) is None


def test_response_length_lowered_to_what_the_answers_need():
    s = ResponseLength().check(window(response_length_mean=flat(200.0, 5)))
    longest = s.evidence["longest_mean"]
    assert s.parameter == "ppo.max_response_length" and longest * 1.5 <= s.proposed < 512
    # Responses that already hit the max need it: no change.
    assert ResponseLength().check(window(response_length_mean=flat(200.0, 5),
                                         response_clip_ratio=flat(0.05, 0))) is None


def test_micro_batch_change_keeps_the_mini_batch_divisibility_rule():
    config = {"ppo.num_rollout_batches": 1, "ppo.mini_batch_size": 32, "ppo.rollout_micro_batch_size": 32}
    s = GpuMemory().check(window(config, **{"perf/max_memory_allocated_gb": flat(60.0, 0)}))
    assert s.proposed % 32 == 0 and s.proposed > 32


def test_low_rollout_success_is_a_flag_not_a_change():
    s = RolloutSuccess().check(window(rollout_success_rate=flat(0.9, 0.01)))
    assert s.is_warning and s.parameter is None and s.evidence["rollout_success_rate"] < 0.95
    advice = advise(window(rollout_success_rate=flat(0.9, 0.01)))
    assert [w.rule for w in advice.warnings] == ["rollout_success"] and advice.changes == []


def test_missing_metrics_keep_rules_silent():
    w = window_from_arrays({"reward_mean": flat(1.5)[:, :3]}, CONFIG)
    assert advise(w).changes == []


def test_one_change_per_parameter_the_stronger_kept():
    t = np.arange(STEPS)
    saw = np.where(t < 30, 1.0 + t / 30, 2.0 - (t - 30) / 8).clip(1.2)
    w = window(reward_mean=_seeds(lambda r: saw + r.normal(0, 0.02, STEPS)))
    advice = advise(w, build_rules({"reward_variance": {"max_variance": 0.01}}))
    actor = [s for s in advice.changes if s.parameter == "ppo.actor_learning_rate"]
    assert len(actor) == 1 and [s.parameter for s in advice.superseded] == ["ppo.actor_learning_rate"]
    assert {actor[0].rule, advice.superseded[0].rule} == {"reward_variance", "reward_sawtooth"}


def test_thresholds_are_parameters():
    w = window(kl_divergence=flat(0.2, 0.01))
    assert KLTooHigh().check(w) is not None
    rules = build_rules({"kl_high": {"kl_max": 0.3}})
    assert "kl_high" in advise(w, rules).silent
    assert parse_threshold("kl_high.kl_max=0.3") == ("kl_high", "kl_max", 0.3)
    with pytest.raises(AdviceError, match="allowed: .*kl_high"):
        build_rules({"kl_hi": {"kl_max": 0.3}})
    with pytest.raises(AdviceError, match="kl_max"):
        build_rules({"kl_high": {"kl_limit": 0.3}})
    assert {r.group for r in build_rules(groups=["throughput_and_quality"])} == {"throughput_and_quality"}
