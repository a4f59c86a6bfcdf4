"""Each of the guide's rules fires on a synthetic trace built to trigger it and stays silent on a
healthy one (KL oscillating in 0.03-0.08, reward rising, ~30% of ratios clipped, memory at 88%);
so do the rules on drift (entropy collapse and blow-up, over-optimisation of the reward model)."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import stats
from experiments.advisor import AdviceError, Window, advise, build_rules
from experiments.advisor.advise import parse_threshold
from experiments.advisor.drift import EntropyBlowUp, EntropyCollapse, OverOptimisation
from experiments.advisor.rules import (
    RULES,
    ClipTooFew,
    ClipTooMany,
    FlatReward,
    GpuMemory,
    GpuUtilisation,
    KLTooHigh,
    KLTooLow,
    ResponseLength,
    RewardSawtooth,
    RewardVariance,
    RolloutSuccess,
)

STEPS, SEEDS = 50, 3
CONFIG = {"ppo.kl_coef": 0.1, "ppo.clip_range": 0.1, "ppo.actor_learning_rate": 2e-6,
          "ppo.critic_learning_rate": 5e-6, "ppo.max_response_length": 512, "ppo.rollout_micro_batch_size": 16,
          "ppo.num_rollout_batches": 8, "ppo.samples_per_prompt": 1, "ppo.mini_batch_size": 32,
          "ppo.entropy_coef": 0.0}


def window_from_arrays(traces, config=None, variant="baseline", device_memory_gb=None, evals=None) -> Window:
    """A window from synthetic traces: each a 1-D curve (one seed) or 2-D (seeds x steps); `evals`
    the same for held-out evaluations over the run (seeds x evaluations)."""
    values = {name: np.atleast_2d(np.asarray(trace, float)) for name, trace in traces.items()}
    length = max((a.shape[1] for a in values.values()), default=0)
    values = {k: np.pad(a, ((0, 0), (0, length - a.shape[1])), constant_values=np.nan) for k, a in values.items()}
    n_seeds = max((a.shape[0] for a in values.values()), default=0)
    evals = {name: np.atleast_2d(np.asarray(e, float)) for name, e in (evals or {}).items()}
    n_evals = max((a.shape[1] for a in evals.values()), default=0)
    return Window(variant=variant, steps=np.arange(length), values=values, config=dict(config or {}),
                  device_memory_gb=device_memory_gb, seeds=tuple(range(n_seeds)),
                  eval_steps=np.arange(n_evals) * 10, evals=evals)


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
        "actor/entropy_old": _seeds(lambda r: 0.5 + r.normal(0, 0.01, STEPS)),
    }
    traces.update(replace)
    return traces


def healthy_evals() -> dict:
    """Held-out evaluations at the run's start and three later points: gold and the RM score both rise."""
    return {"eval/accuracy": np.array([[0.30, 0.32, 0.33, 0.35], [0.28, 0.30, 0.33, 0.34], [0.31, 0.31, 0.34, 0.36]]),
            "eval/rm_score": np.array([[0.5, 0.8, 1.0, 1.1], [0.4, 0.7, 0.9, 1.0], [0.6, 0.8, 1.1, 1.2]])}


def window(config=None, evals=None, **replace) -> Window:
    return window_from_arrays(healthy(**replace), {**CONFIG, **(config or {})}, device_memory_gb=141,
                              evals=healthy_evals() if evals is None else evals)


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


# ------------------------------------------------------------------------------------ drift
def ramp(start, end, noise=0.01):
    """Each seed's curve going linearly from `start` to `end` over the window, with noise."""
    return _seeds(lambda r: np.linspace(start, end, STEPS) + r.normal(0, noise, STEPS))


def hacked_evals():
    """Gold falls from 0.30 to about 0.20 while the reward model's score rises from 0.5 to 2.0."""
    return {"eval/accuracy": np.array([[0.30, 0.27, 0.24, 0.21], [0.29, 0.27, 0.22, 0.19], [0.31, 0.26, 0.25, 0.22]]),
            "eval/rm_score": np.array([[0.5, 1.0, 1.5, 2.0], [0.4, 1.1, 1.6, 1.9], [0.6, 1.0, 1.4, 2.1]])}


@pytest.mark.parametrize("rule, traces, config, parameter, proposed", [
    (EntropyCollapse(), {"actor/entropy_old": ramp(0.5, 0.1)}, {}, "ppo.entropy_coef", 0.001),
    (EntropyCollapse(), {"actor/entropy_old": ramp(0.5, 0.1)}, {"ppo.entropy_coef": 0.01}, "ppo.entropy_coef", 0.02),
    (EntropyCollapse(), {"actor/entropy_old": flat(0.01, 0.001)}, {}, "ppo.entropy_coef", 0.001),  # already ~0
    (EntropyBlowUp(), {"actor/entropy_old": ramp(0.5, 1.2)}, {}, "ppo.actor_learning_rate", 1.5e-6),
    (ResponseLength(), {"response_clip_ratio": flat(0.2, 0.01), "response_length_mean": flat(500.0, 5)}, {},
     "ppo.max_response_length", 768),
])
def test_drift_rule_fires_with_one_change(rule, traces, config, parameter, proposed):
    s = rule.check(window(config, **traces))
    assert s is not None and s.parameter == parameter and s.proposed == pytest.approx(proposed)
    assert s.bracket == () and s.severity > 0 and s.evidence and s.rationale
    assert rule.check(window(config)) is None  # silent on the healthy window


def test_entropy_rules_stay_silent_on_small_drifts_and_without_the_metric():
    mild_fall, mild_rise = (window(**{"actor/entropy_old": ramp(0.5, 0.4)}),
                            window(**{"actor/entropy_old": ramp(0.5, 0.6)}))
    assert EntropyCollapse().check(mild_fall) is None and EntropyBlowUp().check(mild_rise) is None
    assert EntropyBlowUp().check(window(**{"actor/entropy_old": ramp(0.5, 0.1)})) is None  # a fall is no blow-up
    missing = window_from_arrays({k: v for k, v in healthy().items() if k != "actor/entropy_old"}, CONFIG)
    traces = healthy(**{"actor/entropy_old": ramp(0.5, 0.1)})
    assert EntropyCollapse().check(window_from_arrays(traces, CONFIG)) is not None
    assert EntropyCollapse().check(missing) is None and EntropyBlowUp().check(missing) is None
    # Half the seeds must show it: one collapsing seed of three is not a collapse.
    one = np.concatenate([ramp(0.5, 0.1)[:1], flat(0.5, 0.01)[1:]])
    assert EntropyCollapse().check(window(**{"actor/entropy_old": one})) is None


def test_an_entropy_bonus_is_named_as_the_other_suspect_of_a_blow_up():
    s = EntropyBlowUp().check(window({"ppo.entropy_coef": 0.01}, **{"actor/entropy_old": ramp(0.5, 1.2)}))
    assert s.parameter == "ppo.actor_learning_rate" and "ppo.entropy_coef = 0.01" in s.rationale


def test_response_clip_ratio_raises_the_max_only_past_its_threshold():
    between = window(response_clip_ratio=flat(0.03, 0.001), response_length_mean=flat(500.0, 5))
    assert ResponseLength().check(between) is None  # too many cut to lower it, too few to raise it
    s = ResponseLength().check(window(response_clip_ratio=flat(0.2, 0.01), response_length_mean=flat(200.0, 5)))
    assert s.proposed == 768 and s.variant_name == "max_response_length_up"  # cut answers win over a short mean
    assert s.evidence["response_clip_ratio"] == pytest.approx(0.2, abs=0.01)


def test_over_optimisation_when_the_rm_score_rises_while_gold_falls():
    w = window(evals=hacked_evals())
    s = OverOptimisation().check(w)
    assert s is not None and s.parameter == "ppo.kl_coef" and s.rule == "over_optimisation"
    # KL is healthy (0.055): no KL to size from, so the bracket is the smallest step and `span` times it.
    assert s.values == (pytest.approx(0.2), pytest.approx(0.6)) and len(s.variants) == 2
    assert [name for name, _ in s.variants] == ["kl_coef_x2", "kl_coef_x6"]
    assert s.evidence["seeds_gold_down_rm_up"] == 3 and s.evidence["gold_end"] < s.evidence["gold_start"]
    finals = hacked_evals()["eval/accuracy"][:, -1]
    sd = np.std(finals, ddof=1)
    assert s.evidence["gold_mde"] == pytest.approx(stats.min_detectable_effect(sd, 3, 3), rel=1e-3)
    drop = hacked_evals()["eval/accuracy"][:, 0].mean() - finals.mean()
    assert s.evidence["seeds_to_detect_gold_drop"] == stats.seeds_needed(drop, sd)
    assert "3 seeds per variant detect a gold difference of" in s.rationale and "fell" in s.rationale


def test_over_optimisation_needs_both_metrics_and_the_signal():
    rule = OverOptimisation()
    assert rule.check(window()) is None  # gold and RM score both rising
    gold_only = {"eval/accuracy": hacked_evals()["eval/accuracy"]}
    rm_only = {"eval/rm_score": hacked_evals()["eval/rm_score"]}
    assert rule.check(window(evals=gold_only)) is None and rule.check(window(evals=rm_only)) is None
    assert rule.check(window(evals={})) is None
    flat_rm = {**hacked_evals(), "eval/rm_score": np.full((SEEDS, 4), 1.0)}
    assert rule.check(window(evals=flat_rm)) is None  # gold falls, but the reward model did not rise
    one_eval = {k: v[:, :1] for k, v in hacked_evals().items()}
    assert rule.check(window(evals=one_eval)) is None  # a single evaluation shows no change


def test_over_optimisation_when_kl_accelerates_and_sized_from_the_kl():
    t = np.linspace(0, 1, STEPS)
    accelerating = _seeds(lambda r: 0.3 + 0.5 * t ** 3 + r.normal(0, 0.01, STEPS))
    s = OverOptimisation().check(window(kl_divergence=accelerating))
    assert s is not None and s.evidence["kl_acceleration_p"] < 0.05 and s.evidence["seeds_kl_accelerating"] == 3
    kl = accelerating.mean()
    first = np.sqrt(kl / 0.08)  # KL ~ 1 / kl_coef^2: the step that brings KL to the healthy band's top
    assert s.proposed == pytest.approx(0.1 * first, rel=0.01) and s.bracket[0] == pytest.approx(0.3 * first, rel=0.01)
    assert "KL accelerates" in s.rationale and "one variant each" in s.rationale
    # Rising at a constant rate, or accelerating inside the healthy band, is not acceleration past it.
    assert OverOptimisation().check(window(kl_divergence=ramp(0.3, 0.8))) is None
    inside = _seeds(lambda r: 0.03 + 0.045 * t ** 3 + r.normal(0, 0.001, STEPS))
    assert OverOptimisation().check(window(kl_divergence=inside)) is None


def test_over_optimisation_outranks_the_guides_kl_step_on_the_same_parameter():
    w = window(evals=hacked_evals(), kl_divergence=flat(0.9, 0.01))
    assert KLTooHigh().check(w).severity > OverOptimisation().check(w).severity  # severity alone would keep kl_high
    advice = advise(w)
    kl = [s for s in advice.changes if s.parameter == "ppo.kl_coef"]
    assert [s.rule for s in kl] == ["over_optimisation"] and [s.rule for s in advice.superseded] == ["kl_high"]
    assert kl[0].proposed > 2 * advice.superseded[0].proposed  # well past the guide's +20%
    names = [name for _, name, _ in advice.variants()]
    assert names[:2] == ["kl_coef_x3.4", "kl_coef_x10"] and len(names) == len(set(names))
    assert advice.variants(1) == advice.variants()[:1]
