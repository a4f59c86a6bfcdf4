"""The W&B Report of a tuning decision, checked offline: the Report object wandb-workspaces builds
(blocks, panels, run filters), its saved definition, and the CLI without a server."""

import json
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr

from experiments.cli import main
from experiments.plan import expand
from experiments.report import write_report
from rlhf.atomic import write_json
from experiments.study import load_study
from experiments.wandb_report import DEFINITION, SIGNALS, build_report, load_definition, save_definition
from tests.experiments.test_report import ACCURACY, STUDY, fake_run


@pytest.fixture
def finished(write_study, tmp_path):
    path = write_study(STUDY)
    study = load_study(path)
    specs = expand(study, tmp_path / "results")
    for spec in specs:
        if spec.variant == "broken":
            fake_run(spec, 0.0, diverged=True)
        else:  # as in test_report: 'hot' is better but breaks the KL guardrail at seed 2
            fake_run(spec, ACCURACY[spec.variant][spec.seed], kl=0.9 if spec.variant == "hot" and spec.seed == 2 else 0.05)
        (Path(spec.run_dir) / "config.gin").write_text(spec.operative_config)
    out = tmp_path / "results" / "synthetic"
    write_json(out / "plan.json", {"study": study.name, "runs": [s.to_json() for s in specs]})
    return path, study, out, write_report(study, out, specs)


def test_report_blocks_panels_and_run_filters(finished):
    _, study, out, agg = finished
    report = build_report(agg, out, project="synthetic")
    kinds = [type(b).__name__ for b in report.blocks]
    assert kinds == ["H1", "MarkdownBlock", "H2", "MarkdownBlock", "H2", "MarkdownBlock", "H2", "PanelGrid", "H2",
                     "MarkdownBlock"]
    assert report.project == "synthetic" and "good" in report.blocks[0].text
    table = report.blocks[3].text
    assert "| good | `ppo.kl_coef = 0.1` | 4/4 |" in table and "better" in table and "⚠ guardrail" in table
    per_seed = report.blocks[5].text
    assert "| broken | 0 | failed |" in per_seed and "| good | 3 | completed | 0.71 |" in per_seed
    grid = report.blocks[7]
    assert [p.title.split(" ")[0] for p in grid.panels] == list(SIGNALS)
    assert all(p.groupby_aggfunc == "mean" and p.groupby_rangefunc == "stddev" for p in grid.panels)
    runset = grid.runsets[0]
    assert runset.groupby == ["config.variant"]
    assert runset.filters == ("Config(\"study\") == 'synthetic' and Config(\"variant\") in "
                              "['baseline', 'good', 'same', 'hot', 'broken']")
    advisor = report.blocks[9].text
    assert "The advisor on this round's choice** `good`" in advisor and "| rule | change | evidence | why |" in advisor


def test_definition_round_trips_without_a_server(finished, tmp_path):
    _, study, out, agg = finished
    report = build_report(agg, out, project="synthetic")
    path = save_definition(report, tmp_path / DEFINITION)
    spec = json.loads(path.read_text())
    assert spec["displayName"] == "synthetic: tuning decision"
    back = load_definition(path, entity="team", project="synthetic")
    assert [type(b).__name__ for b in back.blocks] == [type(b).__name__ for b in report.blocks]
    grid = next(b for b in back.blocks if isinstance(b, wr.PanelGrid))
    assert grid.runsets[0].entity == "team" and "Config(\"study\") == 'synthetic'" in grid.runsets[0].filters
    assert [p.title for p in grid.panels] == [p.title for p in report.blocks[7].panels]


def test_report_cli_offline_saves_the_definition_and_publish_needs_a_login(finished, capsys, monkeypatch, tmp_path):
    path, study, out, _ = finished
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["report", str(path), "--results", str(out.parent), "--wandb"]) == 0
    printed = capsys.readouterr().out
    assert "saved the W&B Report's definition" in printed and (out / DEFINITION).is_file()
    assert main(["report", str(path), "--results", str(out.parent), "--wandb", "--publish"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: W&B: not logged in") and "\n" not in err
