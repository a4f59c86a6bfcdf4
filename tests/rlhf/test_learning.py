"""PPO measurably learns: from the SFT warm start, the tiny default's held-out accuracy rises by
a clear margin within a few minutes on 2 cores (recipes/tiny.gin as shipped: 250 steps, ~80 s
on one quiet core). Measured: seed 0 eval/accuracy 0.234 -> 0.453 (+21.9 points), greedy
0.391 -> 0.492; seed 1 0.266 -> 0.508 (+24.2), greedy 0.391 -> 0.625."""

import json

import pytest

from rlhf.metrics import read_metrics
from tests.conftest import run_train


@pytest.mark.slow
def test_ppo_raises_held_out_accuracy(tmp_path):
    run_train(["recipes/tiny.gin", "--quiet", "--out", tmp_path])
    summary = json.loads((tmp_path / "summary.json").read_text())
    initial, final = summary["initial"], summary["final"]
    # The warm start is imperfect but non-trivial.
    assert 0.1 < initial["eval/accuracy"] < 0.6
    gain = final["eval/accuracy"] - initial["eval/accuracy"]
    assert gain >= 0.15, f"held-out accuracy {initial['eval/accuracy']:.3f} -> {final['eval/accuracy']:.3f}"
    assert final["eval/greedy_accuracy"] > initial["eval/greedy_accuracy"]
    records = read_metrics(tmp_path / "metrics.jsonl")
    early = sum(r["reward_mean"] for r in records[1:21]) / 20
    late = sum(r["reward_mean"] for r in records[-20:]) / 20
    assert late > early + 0.05
