"""The typed study aggregate: one to_json/from_json (which reads files with keys it no longer holds),
undecidable verdicts and no decision without completed runs."""

import dataclasses
import json

import pytest

from experiments.aggregate import aggregate
from experiments.results import BETTER, UNDECIDABLE, RunOutcome, StudyAggregate
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


def test_aggregate_round_trips_through_its_json(study, tmp_path):
    agg = aggregate(study, results(VALUES))
    assert agg.variants["robust"].verdict == BETTER
    assert agg.decision.chosen == "robust"
    path = tmp_path / "aggregate.json"
    agg.save(path)
    data = json.loads(path.read_text())
    assert data["variants"]["robust"]["summary"]["ci95"][0] is not None
    again = StudyAggregate.load(path)
    assert again == agg
    with pytest.raises(ValueError, match="not a study aggregate"):
        path.write_text(json.dumps({"study": "x"}))
        StudyAggregate.load(path)


def test_an_aggregate_written_with_keys_it_no_longer_holds_still_loads(study, tmp_path):
    """A file written when each variant held a leave-one-seed-out `robustness` record: the key is
    ignored and everything else reads as before."""
    agg = aggregate(study, results(VALUES))
    data = agg.to_json()
    data["variants"]["baseline"]["robustness"] = None
    data["variants"]["robust"]["robustness"] = {
        "leave_one_out": {"0": 0.2, "1": 0.2, "2": 0.2, "3": 0.2}, "leave_one_out_t": {"0": 30.1, "1": 29.8},
        "threshold": 3.4, "fragile": False, "fragile_seeds": [], "settle_seeds": None}
    data["variants"]["one_seed"]["robustness"] = {
        "leave_one_out": {"3": 0.0}, "leave_one_out_t": {"3": 0.0}, "threshold": 3.4, "fragile": True,
        "fragile_seeds": [3], "settle_seeds": 12}
    path = tmp_path / "aggregate.json"
    path.write_text(json.dumps(data))
    again = StudyAggregate.load(path)
    assert again == agg
    assert not hasattr(again.variants["one_seed"], "robustness")
    assert "robustness" not in again.to_json()["variants"]["one_seed"]


def test_a_metric_no_run_logged_is_undecidable_and_decides_nothing(study):
    agg = aggregate(study, results({v: [None] * 4 for v in VALUES}))
    assert {v.verdict for n, v in agg.variants.items() if n != "baseline"} == {UNDECIDABLE}
    assert "no run logged final eval/accuracy" in agg.variants["robust"].explanation
    assert agg.decision.chosen is None and "no decision" in agg.decision.reason


def test_no_decision_when_no_run_completed(study):
    agg = aggregate(study, results({v: [None] * 4 for v in VALUES}, status="failed"))
    assert agg.decision.chosen is None and agg.decision.reason == "no decision: no run completed"


def test_a_better_variant_passed_over_is_named_with_why(study):
    """A `better` variant not chosen for a failed or unfinished run, or a broken guardrail, is named
    in the decision's reason with why: the reason never says that no variant was better."""
    def changed(runs, key, **fields):
        return [dataclasses.replace(r, **fields) if r.key == key else r for r in runs]

    failed = aggregate(study, changed(results(VALUES), "robust/seed1", status="failed", value=None))
    assert failed.variants["robust"].verdict == BETTER and failed.decision.chosen == "baseline"
    assert failed.decision.reason == ("no better variant can be chosen: robust is better than the baseline but 1 "
                                      "of its 4 runs failed; keep the baseline")
    pending = aggregate(study, changed(results(VALUES), "robust/seed3", status="pending", value=None))
    assert "robust is better than the baseline but 1 of its 4 runs did not complete" in pending.decision.reason
    broke = aggregate(study, changed(results(VALUES), "robust/seed2", guardrails={"kl_divergence": 0.9}))
    assert broke.decision.chosen == "baseline" and broke.decision.guardrail_violations == ("robust",)
    assert "robust is better than the baseline but broke its guardrail kl_divergence <= 0.5 (seed 2)" in (
        broke.decision.reason)
    assert "no variant is detectably better" not in failed.decision.reason + pending.decision.reason + (
        broke.decision.reason)
    # A better variant with a lower mean is chosen; the reason names the one ahead of it and why.
    both = {**VALUES, "one_seed": [0.60, 0.61, 0.59, 0.60]}
    runs = changed(changed(results(both), "robust/seed2", guardrails={"kl_divergence": 0.9}),
                   "robust/seed0", status="failed", value=None)
    agg = aggregate(study, runs)
    assert agg.decision.chosen == "one_seed"
    assert agg.decision.reason.startswith("one_seed is better than the baseline (Holm-corrected")
    assert agg.decision.reason.endswith("; robust has a higher mean but 1 of its 4 runs failed and it broke its "
                                        "guardrail kl_divergence <= 0.5 (seed 2)")
    # Nothing better: the reason says so.
    none = aggregate(study, results({v: VALUES["baseline"] for v in VALUES}))
    assert none.decision.reason == "no variant is detectably better with its guardrails holding; keep the baseline"
