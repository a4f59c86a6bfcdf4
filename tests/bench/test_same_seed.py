"""bench/same_seed.py, the same-seed repeat's comparison: the two committed 7B runs of one seed
(bench/results/determinism/) agree in every metric of the steps both ran, and a single changed
metric is found, named and counted (exit 1)."""

import json
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import same_seed  # noqa: E402

RUNS = REPO / "bench" / "results" / "determinism"


def test_the_committed_7b_repeat_agrees_in_every_metric(tmp_path, capsys):
    out = tmp_path / "same.json"
    assert same_seed.main([str(RUNS / "lora7b_run1.metrics.jsonl"), str(RUNS / "lora7b_run2.metrics.jsonl"),
                           "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == [0, 1, 2, 3] and result["compared"] == result["equal"] > 90
    assert result == json.loads((RUNS / "lora7b_same_seed.json").read_text())
    assert "99 of 99 metrics equal" in capsys.readouterr().out


def test_one_changed_metric_is_named_with_its_step_and_size(tmp_path, capsys):
    rows = [json.loads(line) for line in (RUNS / "lora7b_run2.metrics.jsonl").read_text().splitlines()]
    first = [json.loads(line) for line in (RUNS / "lora7b_run1.metrics.jsonl").read_text().splitlines()]
    for r in first:
        r["timing_s/step"] = float(r["step"])
    (tmp_path / "first.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    rows[2]["kl_divergence"] += 1e-9
    for r in rows:  # the machine's figures are not compared
        r["timing_s/step"] = r["step"] + 5.0
    changed = tmp_path / "metrics.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert same_seed.main([str(tmp_path / "first.jsonl"), str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "98 of 99 metrics equal" in out and "kl_divergence: differs at steps [2], by up to 1e-09" in out
    assert "timing_s" not in out


def test_a_run_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    import pytest
    with pytest.raises(SystemExit) as stopped:
        same_seed.main([str(tmp_path), str(RUNS / "lora7b_run1.metrics.jsonl")])
    assert stopped.value.code == 2
    assert f"{tmp_path}: neither a run dir holding metrics.jsonl nor a metrics.jsonl file" in capsys.readouterr().err
