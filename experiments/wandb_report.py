"""A W&B Report for each tuning decision, built with `wandb-workspaces` (W&B's library for reports).

    python -m experiments report STUDY.gin --wandb             # creates it when W&B is online
    python -m experiments report STUDY.gin --wandb --publish   # creates a saved definition later

The report holds, in this order:
- the decision and its reason, and the decision table (Markdown), with the study's aggregate run's
  table as a panel beside it (mean, std, 95% CI, the difference and its CI, verdicts per variant);
- the decision metric per variant: a bar per variant (the mean over seeds, the standard error as
  its whisker: W&B's grouped bar plot draws mean +- stderr/stddev/min-max, not a t interval, so the
  95% CI is the table's), a parallel-coordinates plot over the variant and the bindings the
  variants change against the decision metric, W&B's parameter importance for that metric, and a
  run comparer (the runs' config and summary side by side, differences only);
- the per-seed values (Markdown);
- one mean +- std panel per guide signal (a line per variant, the runs grouped by `variant`);
- the advisor's evidence: why this round tested what it tested (the rules that fired on the
  previous round) and what the rules say about this round's choice.
Run sets: the study's runs, by the run hashes of its plan (config `run_hash`, one W&B run per
configuration), grouped by variant, and the aggregate run of this very aggregate (config
`aggregate_sha256`, job type `aggregate`). Nothing else of the project shows: not the campaign's
other rounds, nor runs of the same study under other configurations (a `dvc exp run -S` of
another value, an earlier commit's code), which `study` and `variant` alone would pool.

Offline (no login, `WANDB_MODE=offline`), the report's definition, the view spec W&B stores,
is written to `RESULTS/<study>/wandb_report.json`; `--publish` reads it back and creates the
report. Building and saving the definition need no server; only publishing does.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import List, Optional

from experiments.collect import load_plan
from experiments.results import StudyAggregate, aggregate_path
from experiments.study import split_binding
from experiments.wandb_sink import AGGREGATE_JOB_TYPE, AGGREGATE_TABLE, aggregate_sha256, decision_key
from rlhf.metrics import SIGNALS  # each a panel

DEFINITION = "wandb_report.json"


def _advisor_markdown(agg: StudyAggregate, study_dir: Path, resume_from: str = "") -> str:
    from experiments.advisor.advise import advise
    from experiments.advisor.evidence import advice_lines
    from experiments.advisor.window import AdviceError, load_window

    lines: List[str] = []
    if resume_from and aggregate_path(resume_from).is_file():
        lines += ["**Why these variants** (the advisor on the previous round):", ""]
        lines += advice_lines(Path(resume_from), agg)
    try:
        window = load_window(study_dir)
    except AdviceError as err:
        return "\n".join(lines + [f"Advisor on this round: not available ({err})."])
    advice = advise(window)
    lines += [f"**The advisor on this round's choice** `{window.variant}` (last {len(window.steps)} steps, "
              f"{len(window.seeds)} seeds):", "", "| rule | change | evidence | why |", "|---|---|---|---|"]
    for s in [*advice.warnings, *advice.changes]:
        evidence = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
                             for k, v in s.evidence.items() if v is not None)
        change = "flag" if s.is_warning else " or ".join(f"`{b}`" for b in s.bindings)
        lines.append(f"| {s.rule} | {change} | {evidence} | "
                     f"{s.rationale} |")
    lines += ["", f"Rules silent: {', '.join(advice.silent) or 'none'}."]
    return "\n".join(lines)


def changed_bindings(agg: StudyAggregate) -> List[str]:
    """The engine bindings the study's variants change ('ppo.kl_coef', ...), in the variants' order."""
    keys = [split_binding(line, f"variant {name!r}")[0] for name, v in agg.variants.items() for line in v.bindings]
    return list(dict.fromkeys(keys))


def _decision_panels(agg: StudyAggregate) -> list:
    """The decision metric per variant: a bar with its standard error, the parallel coordinates of
    the changed bindings, parameter importance, and a run comparer."""
    import wandb_workspaces.reports.v2.interface as wr  # where v2's report types are defined and exported

    key = decision_key(agg)
    columns = [wr.Config("variant"), *[wr.Config(k) for k in changed_bindings(agg)], wr.SummaryMetric(key)]
    return [
        wr.BarPlot(title=f"{key} per variant (mean ± standard error over seeds)", metrics=[key], orientation="v",
                   groupby=wr.Config("variant"), groupby_aggfunc="mean", groupby_rangefunc="stderr",
                   layout=wr.Layout(x=0, y=0, w=12, h=8)),
        wr.ParallelCoordinatesPlot(title=f"changed bindings against {key}",
                                   columns=[wr.ParallelCoordinatesPlotColumn(metric=c) for c in columns],
                                   layout=wr.Layout(x=12, y=0, w=12, h=8)),
        wr.ParameterImportancePlot(with_respect_to=key, layout=wr.Layout(x=0, y=8, w=12, h=8)),
        wr.RunComparer(diff_only="split", layout=wr.Layout(x=12, y=8, w=12, h=8)),
    ]


def build_report(agg: StudyAggregate, study_dir: str | Path, project: str, entity: str = "",
                 resume_from: str = ""):
    """The Report object for one study's decision (no server needed)."""
    import wandb_workspaces.reports.v2.interface as wr  # where v2's report types are defined and exported
    from wandb_workspaces import expr

    from experiments.report import decision_table, explanations, method_text, per_seed_table

    d = agg.decision
    decision = f"**Decision: `{d.chosen}`**: {d.reason}." if d.chosen else f"**No decision**: {d.reason}."
    notes = []
    if (agg.provenance or {}).get("hardware_mixed"):
        notes.append(f"Runs come from {len(agg.provenance['hardware_mixed'])} different machines.")
    run_hashes = [spec.run_hash for spec in load_plan(Path(study_dir))]
    study_runs = expr.And(expr.Config("study") == agg.study, expr.Config("run_hash").isin(run_hashes))
    runs = wr.Runset(entity=entity, project=project, name=f"{agg.study} runs", filters=study_runs,
                     groupby=["config.variant"])
    seeds = wr.Runset(entity=entity, project=project, name=f"{agg.study} runs, one per seed", filters=study_runs)
    aggregate_run = wr.Runset(entity=entity, project=project, name=f"{agg.study} aggregate",
                              filters=expr.And(expr.Config("study") == agg.study,
                                               expr.Metric("JobType") == AGGREGATE_JOB_TYPE,
                                               expr.Config("aggregate_sha256") == aggregate_sha256(study_dir)))
    panels: List[wr.PanelTypes] = [
        wr.LinePlot(title=f"{metric} (mean ± std over seeds)", x="Step", y=[metric], groupby_aggfunc="mean",
                    groupby_rangefunc="stddev", layout=wr.Layout(x=8 * (i % 3), y=6 * (i // 3), w=8, h=6))
        for i, metric in enumerate(SIGNALS)]
    table = wr.WeavePanelSummaryTable(table_name=AGGREGATE_TABLE, layout=wr.Layout(x=0, y=0, w=24, h=8))
    blocks = [
        wr.H1(text=f"Study {agg.study}: {d.chosen or 'no decision'}"),
        wr.MarkdownBlock(text="\n\n".join([agg.description, decision,
                                           f"Metric: {agg.metric_from} {agg.metric} ({agg.direction} is better); "
                                           f"seeds {list(agg.seeds)}; {method_text(agg)}.", *notes]).strip()),
        wr.H2(text="Decision table"),
        wr.MarkdownBlock(text="\n".join([*decision_table(agg), "", *explanations(agg)])),
        wr.PanelGrid(runsets=[aggregate_run], panels=[table]),
        wr.H2(text="Decision metric per variant"),
        wr.PanelGrid(runsets=[seeds], panels=_decision_panels(agg)),
        wr.H2(text="Per-seed values"),
        wr.MarkdownBlock(text="\n".join(per_seed_table(agg))),
        wr.H2(text="Signals per variant"),
        wr.PanelGrid(runsets=[runs], panels=panels),
        wr.H2(text="The advisor's evidence"),
        wr.MarkdownBlock(text=_advisor_markdown(agg, Path(study_dir), resume_from)),
    ]
    return wr.Report(project=project, entity=entity, title=f"{agg.study}: tuning decision",
                     description=f"{agg.study}: {d.chosen or 'no decision'} ({d.reason})", blocks=blocks)


def _viewspec_api():
    """wandb-workspaces' conversions between a Report and its view spec, the JSON W&B stores:
    (Report -> ReportViewspec, ReportViewspec -> Report, the ReportViewspec model). The library
    offers them only privately (`Report._to_model` / `_from_model`; its public `save` and
    `from_url` need a server), so this is the one place that reaches for them; constraints.txt
    pins the version they were checked on, and tests/experiments/test_wandb_report.py fails when
    they change."""
    import wandb_workspaces.reports.v2.interface as wr  # where v2's report types are defined and exported
    from wandb_workspaces.reports.v2 import internal

    try:
        return wr.Report._to_model, wr.Report._from_model, internal.ReportViewspec
    except AttributeError as err:
        raise RuntimeError(f"wandb-workspaces {version('wandb-workspaces')} has no {err.name}: install the version "
                           f"constraints.txt pins (pip install -c constraints.txt wandb-workspaces)") from None


def save_definition(report, path: str | Path) -> Path:
    """Writes the report's view spec (what W&B stores) as JSON; needs no server."""
    to_model, _, _ = _viewspec_api()
    path = Path(path)
    path.write_text(json.dumps(json.loads(to_model(report).model_dump_json(by_alias=True, exclude_none=True)),
                               indent=1))
    return path


def load_definition(path: str | Path, entity: Optional[str] = None, project: Optional[str] = None):
    """A saved definition back as a Report, with the entity (and project) it is to be created in."""
    _, from_model, viewspec = _viewspec_api()
    report = from_model(viewspec.model_validate_json(Path(path).read_text()))
    if entity is not None:
        report.entity = entity
    if project is not None:
        report.project = project
    for block in report.blocks:
        for runset in getattr(block, "runsets", ()):
            runset.entity = report.entity
            runset.project = report.project
    return report


def default_entity() -> Optional[str]:
    import wandb
    return wandb.Api().default_entity
