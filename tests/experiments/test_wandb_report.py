"""The W&B Report of a tuning decision, checked offline: the Report object wandb-workspaces builds
(blocks, panels, run filters), its saved definition read back panel by panel, the private
wandb-workspaces calls it relies on, and the CLI without a server (the project it names)."""

import json
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr

from experiments.cli import main
from experiments.plan import expand
from experiments.report import write_report
from experiments.study import load_study
from experiments.wandb_report import (
    DEFINITION,
    SIGNALS,
    _viewspec_api,
    build_report,
    changed_bindings,
    load_definition,
    save_definition,
)
from experiments.wandb_sink import aggregate_sha256
from rlhf.atomic import write_json
from tests.conftest import REPO
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
            fake_run(spec, ACCURACY[spec.variant][spec.seed],
                     kl=0.9 if spec.variant == "hot" and spec.seed == 2 else 0.05)
        (Path(spec.run_dir) / "config.gin").write_text(spec.operative_config)
    out = tmp_path / "results" / "synthetic"
    write_json(out / "plan.json", {"study": study.name, "runs": [s.to_json() for s in specs]})
    return path, study, out, write_report(study, out, specs)


def _section(report, heading: str, kind=wr.PanelGrid):
    """The first block of `kind` after the H2 `heading`."""
    titles = [getattr(b, "text", None) for b in report.blocks]
    return next(b for b in report.blocks[titles.index(heading):] if isinstance(b, kind))


def test_report_blocks_panels_and_run_filters(finished):
    _, _, out, agg = finished
    report = build_report(agg, out, project="synthetic")
    kinds = [type(b).__name__ for b in report.blocks]
    assert kinds == ["H1", "MarkdownBlock", "H2", "MarkdownBlock", "PanelGrid", "H2", "PanelGrid", "H2",
                     "MarkdownBlock", "H2", "PanelGrid", "H2", "MarkdownBlock"]
    assert report.project == "synthetic" and "good" in report.blocks[0].text
    table = _section(report, "Decision table", wr.MarkdownBlock).text
    assert "| good | `ppo.kl_coef = 0.1` | 4/4 |" in table and "better" in table and "⚠ guardrail" in table
    per_seed = _section(report, "Per-seed values", wr.MarkdownBlock).text
    assert "| broken | 0 | failed |" in per_seed and "| good | 3 | completed | 0.71 |" in per_seed
    grid = _section(report, "Signals per variant")
    assert [p.title.split(" ")[0] for p in grid.panels] == list(SIGNALS)
    assert all(p.groupby_aggfunc == "mean" and p.groupby_rangefunc == "stddev" for p in grid.panels)
    runset = grid.runsets[0]
    assert runset.groupby == ["config.variant"]
    # The study's runs are its plan's configurations (run hashes), not every run of its variants.
    hashes = [run["run_hash"] for run in json.loads((out / "plan.json").read_text())["runs"]]
    assert len(set(hashes)) == 20
    study_runs = f"Config(\"study\") == 'synthetic' and Config(\"run_hash\") in {hashes!r}"
    assert runset.filters == study_runs
    decision = _section(report, "Decision metric per variant")
    assert [type(p).__name__ for p in decision.panels] == ["BarPlot", "ParallelCoordinatesPlot",
                                                           "ParameterImportancePlot", "RunComparer"]
    assert decision.runsets[0].filters == study_runs and decision.runsets[0].groupby == []
    aggregate = report.blocks[4]
    assert [type(p).__name__ for p in aggregate.panels] == ["WeavePanelSummaryTable"]
    assert aggregate.runsets[0].filters == ("Config(\"study\") == 'synthetic' and Metric(\"JobType\") == 'aggregate' "
                                            f"and Config(\"aggregate_sha256\") == '{aggregate_sha256(out)}'")
    advisor = report.blocks[-1].text
    assert "The advisor on this round's choice** `good`" in advisor and "| rule | change | evidence | why |" in advisor


def test_another_configuration_of_the_study_is_another_run_set(finished, tmp_path):
    """The study with another baseline value (what `dvc exp run -S '++round1.ppo.kl_coef=...'` does):
    same study and variant names, but its Report selects none of the first one's runs, except those
    of the one configuration both share ('good' sets ppo.kl_coef itself)."""
    path, _, out, agg = finished
    other = load_study(path, ["study.baseline_bindings = ['ppo.total_steps = 5', 'ppo.kl_coef = 0.07']"])
    other_out = tmp_path / "other" / "synthetic"
    other_out.mkdir(parents=True)
    write_json(other_out / "plan.json", {"study": other.name,
                                         "runs": [s.to_json() for s in expand(other, tmp_path / "other")]})
    (other_out / "aggregate.json").write_text((out / "aggregate.json").read_text().replace("0.5", "0.6"))

    def selected(study_dir):
        grid = _section(build_report(agg, study_dir, project="synthetic"), "Signals per variant")
        return set(re.findall(r"'([0-9a-f]{64})'", grid.runsets[0].filters))

    def aggregate_filter(study_dir):
        return build_report(agg, study_dir, project="synthetic").blocks[4].runsets[0].filters

    good = {run["run_hash"] for run in json.loads((out / "plan.json").read_text())["runs"] if run["variant"] == "good"}
    assert len(selected(out)) == len(selected(other_out)) == 20 and selected(out) & selected(other_out) == good
    assert len(good) == 4
    assert aggregate_filter(out) != aggregate_filter(other_out)


def test_changed_bindings_are_the_variants_keys(finished):
    agg = finished[3]
    assert changed_bindings(agg) == ["ppo.kl_coef", "ppo.clip_range", "ppo.actor_learning_rate", "ppo.adam_eps"]


def _grids(spec: dict) -> list:
    """The saved definition's panel grids: (run sets, panels) as W&B stores them."""
    return [(b["metadata"]["runSets"], b["metadata"]["panelBankSectionConfig"]["panels"])
            for b in spec["spec"]["blocks"] if b["type"] == "panel-grid"]


def _filters(runset: dict) -> list:
    return [(f["key"]["section"], f["key"]["name"], f["op"], f["value"]) for f in runset["filters"]["filters"]]


def test_saved_definition_holds_each_panel(finished, tmp_path):
    """The JSON file W&B's report is created from, read back: each panel's type and the keys it plots."""
    _, _, out, agg = finished
    spec = json.loads(save_definition(build_report(agg, out, project="synthetic"), tmp_path / DEFINITION).read_text())
    assert spec["displayName"] == "synthetic: tuning decision" and spec["project"]["name"] == "synthetic"
    (aggregate_sets, aggregate), (seed_sets, decision), (signal_sets, signals) = _grids(spec)
    hashes = [run["run_hash"] for run in json.loads((out / "plan.json").read_text())["runs"]]
    study_runs = [("config", "study", "=", "synthetic"), ("config", "run_hash", "IN", hashes)]

    # The aggregate run's table: W&B's summary-table panel over this aggregate's run (job type 'aggregate').
    assert _filters(aggregate_sets[0]) == [("config", "study", "=", "synthetic"), ("run", "jobType", "=", "aggregate"),
                                           ("config", "aggregate_sha256", "=", aggregate_sha256(out))]
    (table,) = aggregate
    assert table["viewType"] == "Weave"
    pick = table["config"]["panel2Config"]["exp"]["fromOp"]
    assert pick["name"] == "pick" and pick["inputs"]["key"]["val"] == "variants"
    assert pick["inputs"]["obj"]["fromOp"]["name"] == "run-summary"

    # The decision metric per variant, over the study's runs one per seed.
    assert _filters(seed_sets[0]) == study_runs and seed_sets[0]["grouping"] == []
    bar, coordinates, importance, comparer = decision
    assert [p["viewType"] for p in decision] == ["Bar Chart", "Parallel Coordinates Plot", "Parameter Importance",
                                                 "Run Comparer"]
    assert {k: bar["config"][k] for k in ("metrics", "groupBy", "groupAgg", "groupArea", "aggregate")} == {
        "metrics": ["final.eval/accuracy"], "groupBy": "variant.value", "groupAgg": "mean", "groupArea": "stderr",
        "aggregate": True}
    assert [c["accessor"] for c in coordinates["config"]["columns"]] == [
        "config:variant.value", "config:ppo.value.kl_coef", "config:ppo.value.clip_range",
        "config:ppo.value.actor_learning_rate", "config:ppo.value.adam_eps", "summary:final.eval/accuracy"]
    assert importance["config"]["targetKey"] == "final.eval/accuracy"
    assert comparer["config"]["diffOnly"] == "split"

    # A mean +- std line per guide signal, the runs grouped by variant.
    assert _filters(signal_sets[0]) == study_runs
    assert signal_sets[0]["grouping"] == [{"section": "config", "name": "variant.value"}]
    assert [p["viewType"] for p in signals] == ["Run History Line Plot"] * len(SIGNALS)
    assert [p["config"]["metrics"] for p in signals] == [[m] for m in SIGNALS]
    assert all(p["config"]["groupAgg"] == "mean" and p["config"]["groupArea"] == "stddev" for p in signals)


def test_definition_round_trips_without_a_server(finished, tmp_path):
    _, _, out, agg = finished
    report = build_report(agg, out, project="synthetic")
    path = save_definition(report, tmp_path / DEFINITION)
    back = load_definition(path, entity="team", project="synthetic")
    assert [type(b).__name__ for b in back.blocks] == [type(b).__name__ for b in report.blocks]
    grids = [b for b in back.blocks if isinstance(b, wr.PanelGrid)]
    assert all(g.runsets[0].entity == "team" and g.runsets[0].project == "synthetic" for g in grids)
    assert "Config(\"study\") == 'synthetic'" in grids[-1].runsets[0].filters
    before = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert [[type(p).__name__ for p in g.panels] for g in grids] == [[type(p).__name__ for p in g.panels]
                                                                       for g in before]
    assert [p.title for p in grids[-1].panels] == [p.title for p in before[-1].panels]


def test_the_private_viewspec_calls_are_the_pinned_versions():
    """Saving and loading a definition offline uses wandb-workspaces' private Report._to_model /
    _from_model (no public call does it without a server): this fails as soon as the installed
    version is not the one constraints.txt pins, or the calls are gone or renamed."""
    pinned = re.search(r"^wandb-workspaces==(\S+)$", (REPO / "constraints.txt").read_text(), re.MULTILINE)
    assert pinned and version("wandb-workspaces") == pinned.group(1), (
        f"wandb-workspaces {version('wandb-workspaces')} is installed, constraints.txt pins "
        f"{pinned and pinned.group(1)}: check experiments/wandb_report.py _viewspec_api against it, then re-pin")
    to_model, from_model, viewspec = _viewspec_api()
    report = wr.Report(project="p", entity="e", title="t", blocks=[wr.H1(text="h")])
    model = to_model(report)
    assert isinstance(model, viewspec)
    back = from_model(viewspec.model_validate_json(model.model_dump_json(by_alias=True, exclude_none=True)))
    assert (back.title, back.project, back.entity, [b.text for b in back.blocks]) == ("t", "p", "e", ["h"])


def test_report_cli_offline_saves_the_definition_and_publish_needs_a_login(finished, capsys, monkeypatch, tmp_path):
    path, _, out, _ = finished
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["report", str(path), "--results", str(out.parent), "--wandb"]) == 0
    printed = capsys.readouterr().out
    assert "saved the W&B Report's definition" in printed and (out / DEFINITION).is_file()
    assert main(["report", str(path), "--results", str(out.parent), "--wandb", "--publish"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: W&B: not logged in") and "\n" not in err


def test_report_names_the_campaign_project(finished, capsys, monkeypatch, tmp_path):
    """The Report's project: study.wandb_project, else WANDB_PROJECT, else study.campaign, else the
    study's name; a name W&B refuses is one line, exit 2."""
    path, _, out, _ = finished
    monkeypatch.setenv("HOME", str(tmp_path))  # no login: the definition is saved, not published

    def project(*bindings: str):
        code = main(["report", str(path), "--results", str(out.parent), "--wandb",
                     *[arg for b in bindings for arg in ("-b", b)]])
        printed = capsys.readouterr()
        return json.loads((out / DEFINITION).read_text())["project"]["name"] if code == 0 else printed.err.strip()

    assert project() == "synthetic"
    assert project("study.campaign = 'tuning'") == "tuning"
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    assert project("study.campaign = 'tuning'") == "from-env"
    assert project("study.wandb_project = 'mine'", "study.campaign = 'tuning'") == "mine"
    monkeypatch.setenv("WANDB_PROJECT", "team/runs")
    assert project() == ("error: WANDB_PROJECT = 'team/runs' is invalid: it names a W&B project, which may not "
                         "contain / \\ # ? % : (it contains /)")
    monkeypatch.delenv("WANDB_PROJECT")
    assert project("study.campaign = 'a:b'") == ("error: study.campaign = 'a:b' is invalid: it names a W&B project, "
                                                 "which may not contain / \\ # ? % : (it contains :)")
