"""The typed study aggregate: one to_json/from_json, leave-one-seed-out fragility on crafted values,
undecidable verdicts and no decision without completed runs."""

import json

import pytest

from experiments.aggregate import aggregate, leave_one_seed_out
from experiments.results import BETTER, NO_DIFFERENCE, UNDECIDABLE, RunOutcome, StudyAggregate
from experiments.study import load_study

STUDY = """
study.name = 'crafted'
study.baseline_recipe = 'tiny.gin'
study.variants = {'robust': 'ppo.kl_coef = 0.1', 'one_seed': 'ppo.clip_range = 0.1'}
study.seeds = 4
study.guardrails = {'kl_divergence': {'max': 0.5}}
"""

VALUES = {
    "baseline": [0.50, 0.51, 0.49, 0.50],
    "robust": [0.70, 0.71, 0.69, 0.70],     # better with any seed left out
    "one_seed": [0.50, 0.51, 0.49, 0.90],   # its gain is seed 3 alone
}


def results(values, status="completed", guard=0.1):
    return [RunOutcome(variant=v, seed=s, run_dir=f"/r/crafted/runs/{v}/seed{s}", status=status,
                       value=x, guardrails={"kl_divergence": guard}, steps=5)
            for v, xs in values.items() for s, x in enumerate(xs)]


@pytest.fixture
def study(write_study):
    return load_study(write_study(STUDY))


def test_leave_one_seed_out_on_crafted_values():
    by_seed = {v: dict(enumerate(xs)) for v, xs in VALUES.items()}
    robust = leave_one_seed_out(by_seed, higher=True, alpha=0.05)
    assert not robust["robust"].fragile and set(robust["robust"].leave_one_out.values()) == {BETTER}
    # Full data: no detectable difference (seed 3 is an outlier); without seed 3 it is a tie, with
    # any other seed left out still no difference: the verdict holds.
    assert robust["one_seed"].leave_one_out["3"] == NO_DIFFERENCE
    # A better verdict that hangs on one seed: 3 seeds of a clear gain, the fourth a loss.
    fragile = leave_one_seed_out({"baseline": {0: 0.50, 1: 0.51, 2: 0.49},
                                  "v": {0: 0.60, 1: 0.61, 2: 0.59}}, True, 0.05)
    assert not fragile["v"].fragile
    hangs = leave_one_seed_out({"baseline": {0: 0.50, 1: 0.52, 2: 0.48, 3: 0.50},
                                "v": {0: 0.60, 1: 0.56, 2: 0.58, 3: 0.51}}, True, 0.05)
    # Better over 4 seeds, not with seed 0, 1 or 2 left out: the verdict hangs on each of them.
    assert hangs["v"].leave_one_out == {"0": NO_DIFFERENCE, "1": NO_DIFFERENCE, "2": NO_DIFFERENCE, "3": BETTER}
    assert hangs["v"].fragile and hangs["v"].fragile_seeds == (0, 1, 2)


def test_aggregate_round_trips_through_its_json(study, tmp_path):
    agg = aggregate(study, results(VALUES))
    assert agg.variants["robust"].verdict == BETTER and not agg.variants["robust"].fragile
    assert agg.decision.chosen == "robust"
    path = tmp_path / "aggregate.json"
    agg.save(path)
    data = json.loads(path.read_text())
    assert data["variants"]["robust"]["robustness"]["fragile"] is False
    assert data["variants"]["robust"]["summary"]["ci95"][0] is not None
    again = StudyAggregate.load(path)
    assert again == agg
    with pytest.raises(ValueError, match="not a study aggregate"):
        path.write_text(json.dumps({"study": "x"}))
        StudyAggregate.load(path)


def test_fragile_verdict_is_marked_in_the_decision_and_report(study):
    from experiments.report import render
    values = {"baseline": [0.50, 0.52, 0.48, 0.50], "robust": [0.60, 0.61, 0.59, 0.45],
              "one_seed": [0.50, 0.51, 0.49, 0.50]}
    agg = aggregate(study, results(values))
    v = agg.variants["robust"]
    # No detectable difference over 4 seeds, but "better" once seed 3 is left out.
    assert v.verdict == NO_DIFFERENCE and v.fragile and v.robustness.fragile_seeds == (3,)
    assert agg.fragile_variants == ["robust"]
    text = render(agg)
    assert "**Fragile verdicts:** robust" in text and "without seed 3: better" in text
    assert "no detectable difference (underpowered) (fragile)" in text or "no detectable difference (fragile)" in text


def test_a_metric_no_run_logged_is_undecidable_and_decides_nothing(study):
    agg = aggregate(study, results({v: [None] * 4 for v in VALUES}))
    assert {v.verdict for n, v in agg.variants.items() if n != "baseline"} == {UNDECIDABLE}
    assert "no run logged final eval/accuracy" in agg.variants["robust"].explanation
    assert agg.decision.chosen is None and "no decision" in agg.decision.reason


def test_no_decision_when_no_run_completed(study):
    agg = aggregate(study, results({v: [None] * 4 for v in VALUES}, status="failed"))
    assert agg.decision.chosen is None and agg.decision.reason == "no decision: no run completed"
