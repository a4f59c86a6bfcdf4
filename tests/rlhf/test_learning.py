"""PPO measurably learns: from the SFT warm start, the tiny default's held-out accuracy rises by
a clear margin within a few minutes on 2 cores (recipes/tiny.gin as shipped: 250 steps).

One run's gain is not the measure: another numeric path (another torch release, the native
kernels, another seed) sends a run down another trajectory, and one seed's gain was seen to range
from +14 to +27 points. So the test runs three seeds and evaluates each on the whole held-out split
(169 prompts) with 4 samples per prompt (676 samples: the sampling noise of one gain is ~2.6
points), and asks for a mean gain far above that noise plus a gain from every seed.
Measured with the default portable CPU numerics (rlhf/numerics.py), which give the same bits on
AMD and Intel CPUs (bench/cpu_numerics.py), eval/accuracy initial -> final: seed 0 0.250 -> 0.414
(+16.4 points), seed 1 0.246 -> 0.435 (+18.9), seed 2 0.268 -> 0.419 (+15.1); mean +16.8, greedy
0.308 -> 0.52-0.56. Other numeric paths measured before: +20.0 / +26.6 / +19.7 and, with each
machine's own kernels (RLHF_NUMERICS=native), +17.8 / +18.2 / +17.5. The thresholds (mean >= 10,
each seed >= 5) sit 3 standard deviations of the seed-to-seed spread (~3 points) below the lowest.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf.metrics import read_metrics
from tests.conftest import run_train

SEEDS = (0, 1, 2)
HELD_OUT = ["-b", "task.eval_size = 1000", "-b", "ppo.eval_samples_per_prompt = 4", "-b", "ppo.eval_every = 250"]
MEAN_GAIN = 0.10  # held-out accuracy gain (fraction), mean over the seeds
SEED_GAIN = 0.05  # and of every seed


def held_out_gains(tmp_path, seeds, bindings=()):
    """Runs recipes/tiny.gin (250 steps) for each seed in parallel; returns {seed: gain} and a report,
    after checking what every run must show: an imperfect warm start, a greedy gain, a reward rise."""
    def run(seed):
        out = tmp_path / f"seed{seed}"
        run_train(["recipes/tiny.gin", "--quiet", "-b", f"ppo.seed = {seed}", *HELD_OUT, *bindings, "--out", out])
        return seed, out

    with ThreadPoolExecutor(max_workers=len(seeds)) as pool:  # one thread each (ppo.torch_threads = 1)
        outs = dict(pool.map(run, seeds))
    gains, lines = {}, []
    for seed, out in outs.items():
        summary = json.loads((out / "summary.json").read_text())
        initial, final = summary["initial"], summary["final"]
        # The warm start is imperfect but non-trivial.
        assert 0.1 < initial["eval/accuracy"] < 0.6, (seed, initial)
        gains[seed] = final["eval/accuracy"] - initial["eval/accuracy"]
        assert final["eval/greedy_accuracy"] > initial["eval/greedy_accuracy"], (seed, initial, final)
        lines.append(f"seed {seed}: {initial['eval/accuracy']:.3f} -> {final['eval/accuracy']:.3f} "
                     f"({100 * gains[seed]:+.1f}), greedy {initial['eval/greedy_accuracy']:.3f} -> "
                     f"{final['eval/greedy_accuracy']:.3f}")
        records = read_metrics(out / "metrics.jsonl")
        early = sum(r["reward_mean"] for r in records[1:21]) / 20
        late = sum(r["reward_mean"] for r in records[-20:]) / 20
        assert late > early + 0.05, (seed, early, late)
    report = "; ".join(lines)
    print(report)
    return gains, report


@pytest.mark.slow
def test_ppo_raises_held_out_accuracy(tmp_path):
    gains, report = held_out_gains(tmp_path, SEEDS)
    mean_gain = sum(gains.values()) / len(gains)
    assert mean_gain >= MEAN_GAIN, f"mean held-out gain {100 * mean_gain:+.1f} points < {100 * MEAN_GAIN:.0f}: {report}"
    assert min(gains.values()) >= SEED_GAIN, f"a seed gained < {100 * SEED_GAIN:.0f} points: {report}"


LORA = ["-b", "ppo.lora_rank = 8", "-b", "ppo.actor_learning_rate = 1e-3", "-b", "ppo.critic_learning_rate = 3e-3"]
LORA_SEEDS = (0, 1)
LORA_SEED_GAIN = 0.08


@pytest.mark.slow
def test_lora_raises_held_out_accuracy(tmp_path):
    """LoRA rank 8 on actor and critic (frozen base), the whole tiny recipe. Measured under the portable
    CPU numerics (the same bits on AMD and Intel): seed 0 0.250 -> 0.380 (+13.0 points), seed 1
    0.246 -> 0.388 (+14.2); learning rate 2e-3 gave +13.2 at seed 0. Thresholds: mean >= 10 points
    (the issue's bar), each seed >= 8."""
    gains, report = held_out_gains(tmp_path, LORA_SEEDS, LORA)
    mean_gain = sum(gains.values()) / len(gains)
    assert mean_gain >= MEAN_GAIN, f"LoRA: mean held-out gain {100 * mean_gain:+.1f} points: {report}"
    assert min(gains.values()) >= LORA_SEED_GAIN, f"LoRA: a seed gained < {100 * LORA_SEED_GAIN:.0f} points: {report}"
