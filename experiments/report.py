"""Report: aggregate.json for machines, report.md and plots for people.

Reads the launched plan and the run dirs (via `collect`), aggregates (`aggregate`), then
writes RESULTS/<study>/aggregate.json, report.md and plots/*.png. Rendering is a pure function
of the typed aggregate (`results.StudyAggregate`), so a report can be re-rendered from
aggregate.json alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

from experiments.aggregate import aggregate
from experiments.collect import collect, load_plan, load_seed_plan
from experiments.paths import portable
from experiments.plan import RunSpec, git_commit
from experiments.plots import plot_study
from experiments.results import (
    BASELINE,
    EQUIVALENT,
    PAIRED,
    WELCH,
    CheckpointScore,
    RunOutcome,
    SeedPlan,
    SequentialRecord,
    StudyAggregate,
    VariantResult,
    aggregate_path,
)
from experiments.run_records import read_json
from experiments.seed_plan import find_pilot, pilot_correlation, plan_line, shortfall
from experiments.study import Study
from rlhf.atomic import write_json, write_text
from rlhf.provenance import hardware_fingerprint


def _fmt(x, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _ci(pair) -> str:
    if not pair or pair[0] is None:
        return "–"
    return f"[{_fmt(pair[0])}, {_fmt(pair[1])}]"


REPORT = "report.md"
"""The report for people, beside the aggregate in a study's results dir."""
MACHINE_PROVENANCE = "provenance.json"
"""A study's machine record beside its aggregate (rlhf/run_dir.py's MACHINE_RECORDS): the git
commit, library versions, hardware and command line the runs ran with."""


def provenance_summary(specs: Sequence[RunSpec], study: Optional[Study] = None) -> tuple:
    """(what the results depend on, what the machines were) of a study's runs. The first, kept in
    aggregate.json: the engine code's hash, data hashes, start checkpoints and recipe from the plan,
    the baseline's engine bindings as its runs got them and the overrides among them
    (`run_bindings`), and `hardware_mixed` ({fingerprint: runs}) when the runs' machines differ
    (their numbers may then differ in the last bits). The second, `MACHINE_PROVENANCE`: the git
    commit, and versions, hardware and command line from the first run dir with an engine
    provenance.json."""
    out: Dict = {}
    machine: Dict = {"git_sha": git_commit()}
    if specs:
        out["code_version"] = specs[0].code_version
        out["data_sha256"] = sorted({s.data_hash for s in specs})
        out["init_from"] = sorted({s.init_from for s in specs if s.init_from})
        out["recipe"] = portable(specs[0].recipe)
        out.update(run_bindings(specs, study))
    machines: Dict[str, List[str]] = {}
    for s in specs:
        prov = read_json(Path(s.run_dir) / "provenance.json")
        if not prov or "versions" not in prov:
            continue
        machines.setdefault(hardware_fingerprint(prov), []).append(s.key)
        if "versions" not in machine:
            machine["versions"] = prov.get("versions")
            hw = prov.get("hardware") or {}
            machine["hardware"] = {k: hw.get(k) for k in ("hostname", "platform", "cpu", "cpu_count", "cuda", "gpus",
                                                          "driver") if hw.get(k) is not None}
            machine["manager_command"] = (prov.get("manager") or {}).get("manager_command")
    if machines:
        machine["hardware_fingerprint"] = sorted(machines)
    if len(machines) > 1:
        out["hardware_mixed"] = machines
    return out, machine


def run_bindings(specs: Sequence[RunSpec], study: Optional[Study] = None) -> Dict[str, List[str]]:
    """{'baseline_bindings': the engine bindings the baseline's runs got, in order, less the ones
    the manager sets per run (seed, threads, start); 'overrides': those of them that neither the
    study file nor the resumed setting gives (`--overrides FILE:KEY` and `-b` bindings, which win
    over the file's)}, read from the plan's specs, so a report written later without the overrides
    still names them. A variant's runs got these and its own change after them. {} without a
    baseline run; no 'overrides' without the study (or when its file no longer loads)."""
    from experiments.errors import StudyError
    from experiments.resume_from import resumed_setting
    from experiments.study import MANAGED_BINDINGS, load_study, split_binding

    base = next((s for s in specs if s.variant == BASELINE), None)
    if base is None:
        return {}
    ran = [b for b in base.bindings if split_binding(b, "a planned run")[0] not in MANAGED_BINDINGS]
    out: Dict[str, List[str]] = {"baseline_bindings": ran}
    if study is not None:
        try:
            declared = [*resumed_setting(study), *load_study(study.path).baseline_bindings]
        except StudyError:
            return out
        extra = ran[len(declared):] if ran[:len(declared)] == declared else [b for b in ran if b not in declared]
        out["overrides"] = extra
    return out


def overrides_text(agg: StudyAggregate) -> str:
    """'`ppo.clip_range = 0.1`; `ppo.lr = 1e-5`': the overrides a study's runs got ('' when none, or
    the aggregate predates their record)."""
    return "; ".join(f"`{b}`" for b in (agg.provenance or {}).get("overrides") or ())


def _verdict_text(v: VariantResult, margin: float = 0.0) -> str:
    text = v.verdict
    if v.verdict == EQUIVALENT and v.comparison is not None:
        p = v.comparison.equivalence_p_holm
        text = f"equivalent within ±{margin:g}" + (f" (p = {p:.3g})" if p is not None else "")
    text += " (underpowered)" if v.underpowered else ""
    if not v.guardrails_ok:
        text += " ⚠ guardrail"
    return text


ANALYSIS_TEXT = {PAIRED: "paired t-test over the seeds both sides ran", WELCH: "Welch's t-test"}


def alpha_text(agg: StudyAggregate) -> str:
    """'alpha 0.05 / 3 variants = 0.0167 (Holm's first step)': the level power is promised at."""
    k = max(1, len(agg.variants) - 1)
    return f"alpha {agg.alpha:g} / {k} variant{'s' if k != 1 else ''} = {agg.alpha / k:.3g} (Holm's first step)"


def method_text(agg: StudyAggregate) -> str:
    """How the verdicts were reached: the deciding test, Holm's correction, the margin when set."""
    text = (f"alpha {agg.alpha:g} ({ANALYSIS_TEXT.get(agg.analysis, agg.analysis)}, Holm-corrected across "
            f"{max(0, len(agg.variants) - 1)} variant(s))")
    if agg.equivalence_margin > 0:
        text += f"; equivalence: TOST within ±{agg.equivalence_margin:g}, Holm-corrected alike"
    return text


def render(agg: StudyAggregate) -> str:
    """report.md text from a study aggregate (its plots included)."""
    metric = f"{agg.metric_from} {agg.metric} ({agg.direction} is better)"
    lines = [f"# Study `{agg.study}`", ""]
    if agg.description:
        lines += [agg.description, ""]
    d = agg.decision
    decision = f"`{d.chosen}`: {d.reason}" if d.chosen else d.reason
    ci = "the paired t interval" if agg.analysis == PAIRED else "Welch's t interval"
    level = alpha_text(agg)
    lines += [f"**Decision:** {decision}.", "",
              f"Metric: {metric}; seeds: {list(agg.seeds)}; {method_text(agg)}; a variant's 95% CI: the t "
              f"interval of its mean; the difference's: {ci} (uncorrected); minimum detectable effects and seeds "
              f"needed: {level}, 80% power." + (f" Metric resolution: {agg.metric_resolution:g} (seeds spread less "
                                                 f"than a quarter of it tie)." if agg.metric_resolution else ""), ""]
    if agg.seed_plan:
        planned = [plan_line(agg.seed_plan, agg.direction), shortfall(agg.seed_plan, agg.direction)]
        lines += [f"Seed plan: {'; '.join(p.removeprefix('plan: ').removeprefix('notice: ') for p in planned if p)}.",
                  ""]
    if d.guardrail_violations:
        lines += [f"**Guardrail violations:** {', '.join(d.guardrail_violations)}.", ""]
    if overrides_text(agg):
        lines += [f"**Run with overrides:** {overrides_text(agg)}: bindings beyond the study file's (`--overrides` "
                  f"or `-b`), which every run got (a variant's own change wins).", ""]
    if agg.lineages:
        shared = "; ".join(f"seeds {', '.join(map(str, seeds))} start from `{start}`"
                           for start, seeds in agg.lineages.items() if len(seeds) > 1)
        lines += [f"**Shared starts:** {shared}. The tests compare the {len(agg.lineages)} lineages' means: seeds "
                  f"from one start share its luck, so they count as one unit.", ""]
    mixed = (agg.provenance or {}).get("hardware_mixed")
    if mixed:
        lines += [f"**Runs from different hardware:** {len(mixed)} machines ("
                  + "; ".join(f"{fp}: {', '.join(runs)}" for fp, runs in mixed.items())
                  + "). CPU numerics can differ across machines: compare variants run on the same one.", ""]
    lines += ["## Decision table", "", *decision_table(agg), ""]
    lines += explanations(agg)
    both = analyses_table(agg)
    if both:
        lines += ["", "## Both analyses", "", *both]
    lines += ["", "## Per-seed values", "", *per_seed_table(agg)]
    lines += best_checkpoint_lines(agg)
    if agg.guardrails:
        lines += ["", "## Guardrails (final-window values)", "", *guardrail_table(agg)]
    if agg.plots:
        lines += ["", "## Curves (mean ± std (ddof = 1) over seeds)", ""]
        lines += [f"![{stem}]({path})" for stem, path in agg.plots.items()]
    lines += provenance_lines(agg)
    if agg.sequential:
        lines.append(render_waves(agg.sequential, agg.direction))
    return "\n".join(lines) + "\n"


def _units(agg: StudyAggregate) -> str:
    """' (3 lineages)' beside a seed count when seeds share starts and the tests read lineage means."""
    return f" ({len(agg.lineages)} lineages)" if agg.lineages else ""


def decision_table(agg: StudyAggregate) -> List[str]:
    """The decision table (markdown): per variant its statistics, the comparison by the deciding
    analysis (its difference interval, Holm p, MDE and seeds needed) and the verdict."""
    lines = ["| variant | change | n | mean | std | SE | median | IQM | 95% CI | difference [95% CI] | analysis | "
             "p (Holm) | Hedges' g | P(improve) | MDE | seeds needed | verdict |",
             "|" + "---|" * 17]
    for name, v in agg.variants.items():
        s, c = v.summary, v.comparison
        own = c.decisive if c else None
        change = "; ".join(v.bindings) or "–"
        if v.coupled:
            change += " (coupled)"
        diff = f"{_fmt(own.difference)} {_ci(own.difference_ci95)}" if own is not None else "–"
        lines.append(f"| {name} | `{change}` | {s.n}/{len(v.runs)}{_units(agg)} | {_fmt(s.mean)} | {_fmt(s.std)} | "
                     f"{_fmt(s.se)} | {_fmt(s.median)} | {_fmt(s.iqm)} | {_ci(s.ci95)} | {diff} | "
                     f"{c.analysis if c else '–'} | "
                     f"{_fmt(c.p_value_holm if c else None)} | {_fmt(c.hedges_g if c else None, 3)} | "
                     f"{_fmt(c.prob_improvement if c else None, 3)} | "
                     f"{_fmt(own.min_detectable_effect if own is not None else None)} | "
                     f"{_fmt(own.seeds_needed if own is not None else None)} | "
                     f"{_verdict_text(v, agg.equivalence_margin)} |")
    beside = beside_metrics(agg)
    if beside:
        lines += ["", f"Beside {agg.metric} (final held-out, mean +- std over the completed seeds):", "",
                  "| variant | " + " | ".join(beside) + " |", "|---|" + "---|" * len(beside)]
        lines += [f"| {name} | " + " | ".join(beside_text(v, m) for m in beside) + " |"
                  for name, v in agg.variants.items()]
    return lines


def beside_metrics(agg: StudyAggregate) -> List[str]:
    """The metrics some variant reports beside the decision metric, in first-seen order."""
    return list(dict.fromkeys(m for v in agg.variants.values() for m in v.beside))


def beside_text(variant, metric: str) -> str:
    """'2.05 +- 0.13' over the seeds with a finite value, then '(1 of 4 missing)' when some completed
    seed has none (not logged, NaN or inf); '–' for no value."""
    s = variant.beside.get(metric)
    if s is None:
        return "–"
    text = f"{_fmt(s.mean)} +- {_fmt(s.std)}" if s.mean is not None else "–"
    return text + _missing(variant.completed - s.n, variant.completed)


def _missing(missing: int, of: int) -> str:
    return f" ({missing} of {of} missing)" if missing > 0 else ""


def explanations(agg: StudyAggregate) -> List[str]:
    """One line per verdict: why."""
    lines = []
    for name, v in agg.variants.items():
        if v.explanation:
            said = v.explanation.startswith(v.verdict)  # "equivalent within ±0.02 (...)" names itself
            line = f"- `{name}`: {v.explanation}" if said else f"- `{name}`: {v.verdict}: {v.explanation}"
            lines.append(line + ".")
    return lines


def analyses_table(agg: StudyAggregate) -> List[str]:
    """Both analyses of every variant (markdown), whichever decided: Welch's (independent groups)
    and the paired one (seed s against seed s), with Wilcoxon's signed-rank p and the pairs'
    correlation, and the TOST p-values when an equivalence margin is set (all before Holm)."""
    rows = [(name, v.comparison) for name, v in agg.variants.items() if v.comparison is not None]
    if not rows:
        return []
    margin = agg.equivalence_margin
    tost = margin > 0
    lines = [f"p-values before Holm's correction; {agg.analysis} decides (study.analysis). Correlation: "
             f"Pearson's, of the variant's and the baseline's values over the shared seeds."
             + (f" TOST: equivalence within ±{margin:g}." if tost else ""), "",
             "| variant | Welch difference [95% CI] | Welch p | pairs | paired difference [95% CI] | paired t p | "
             "Wilcoxon p | correlation |" + (" TOST p (Welch) | TOST p (paired) |" if tost else ""),
             "|" + "---|" * (8 + 2 * tost)]
    for name, c in rows:
        pr = c.paired
        paired = (f"{pr.n_pairs} | {_fmt(pr.difference)} {_ci(pr.difference_ci95)} | {_fmt(pr.p_value)} | "
                  f"{_fmt(pr.wilcoxon_p_value)} | {_fmt(pr.correlation, 3)} |") if pr else "– | – | – | – | – |"
        line = f"| {name} | {_fmt(c.difference)} {_ci(c.difference_ci95)} | {_fmt(c.p_value)} | {paired}"
        if tost:
            line += f" {_fmt(c.equivalence_p)} | {_fmt(pr.equivalence_p if pr else None)} |"
        lines.append(line)
    return lines


def per_seed_table(agg: StudyAggregate) -> List[str]:
    lines = ["| variant | seed | status | value | steps | error |", "|---|---|---|---|---|---|"]
    for name, v in agg.variants.items():
        for r in v.runs:
            lines.append(f"| {name} | {r.seed} | {r.status} | {_fmt(r.value)} | {_fmt(r.steps)} | "
                         f"{(r.error or '').replace('|', '/')[:160]} |")
    return lines


def best_checkpoint_text(best: CheckpointScore, metric: str, where: str = "") -> str:
    """'`runs/v/seed0/checkpoints/step_75` (v, seed 0, step 75): eval/accuracy = 0.2344'."""
    return f"`{where}{best.path}` ({best.variant}, seed {best.seed}, step {best.step}): {metric} = {_fmt(best.value)}"


def best_checkpoint_lines(agg: StudyAggregate) -> List[str]:
    """The section naming the checkpoint with the best held-out gold accuracy, per run and overall
    (nothing when no checkpoint's step was evaluated, or the aggregate predates the record)."""
    record = agg.best_checkpoints
    if record is None or record.best is None:
        return []
    lines = ["", f"## Best checkpoint by gold ({record.metric})", "",
             f"Best of the study: {best_checkpoint_text(record.best, record.metric)}. Gold is scored at every "
             f"evaluated step that kept a checkpoint; the last checkpoint is not always the best one.", "",
             f"| variant | seed | step | {record.metric} | checkpoint |", "|---|---|---|---|---|"]
    lines += [f"| {c.variant} | {c.seed} | {c.step} | {_fmt(c.value)} | `{c.path}` |" for c in record.runs]
    return lines


def guardrail_table(agg: StudyAggregate) -> List[str]:
    lines = ["| variant | guardrail | per-seed values | violated seeds |", "|---|---|---|---|"]
    for name, v in agg.variants.items():
        for g in v.guardrails.values():
            vals = ", ".join(f"{k}: {_fmt(x)}" for k, x in g.values.items()) or "–"
            bad = ", ".join(map(str, g.violated_seeds)) or "none"
            lines.append(f"| {name} | {g.bound} | {vals} | {'⚠ ' if not g.ok else ''}{bad} |")
    return lines


def provenance_lines(agg: StudyAggregate) -> List[str]:
    lines: List[str] = []
    prov = agg.provenance or {}
    if prov:
        code = prov.get("code_version") or {}
        dirty = code.get("engine_dirty", code.get("dirty"))
        data_sha = ", ".join(h[:16] for h in prov.get("data_sha256", []))
        lines += ["", "## Provenance", "",
                  f"- engine files sha256 {str(code.get('engine_sha256'))[:16]}"
                  f"{' (engine files modified since the last commit)' if dirty else ''}",
                  f"- recipe: {prov.get('recipe')}; data sha256: {data_sha}"]
        if prov.get("baseline_bindings") is not None:
            lines.append("- the baseline's bindings as its runs got them: "
                         + ("; ".join(f"`{b}`" for b in prov["baseline_bindings"]) or "none")
                         + (f" (overrides: {overrides_text(agg)})" if overrides_text(agg) else ""))
        if prov.get("init_from"):
            lines.append(f"- started from: {', '.join(prov['init_from'])}")
        lines.append(f"- the machines' records (git commit, versions, hardware, command): {MACHINE_PROVENANCE} "
                     "beside this report; each run dir holds config.gin, metrics.jsonl and summary.json (its "
                     "results), provenance.json, perf.jsonl and attempts.json (its machine's)")
    return lines


def render_waves(record: SequentialRecord, direction: str = "higher") -> str:
    """The report section of a study run in seed waves: the boundaries, how each variant ended,
    the runs used."""
    better = "above" if direction == "higher" else "below"
    lines = ["", "## Seed waves", "",
             f"Seeds ran in waves of {'/'.join(map(str, record.waves))} per variant; at each look a variant was "
             f"decided when its z crossed the efficacy boundary ({record.spending} spending) and stopped when it "
             f"fell below the futility boundary ({record.futility} spending, non-binding), each variant at two-sided "
             f"alpha {record.alpha_per_variant:.3g}. z is the difference's t statistic at the look, as the normal "
             f"quantile of the same p-value ({better} zero improves).", "",
             "| look | seeds | efficacy \\|z\\| >= | nominal p | futility z < |", "|---|---|---|---|---|"]
    for row in record.boundaries:
        fut = f"{row['futility_z']:.3f}" if row.get("futility_z") is not None else "–"
        lines.append(f"| {row['look']} | {row['seeds']} | {row['efficacy_z']:.3f} | {row['nominal_p']:.3g} | {fut} |")
    lines += ["", "| variant | stopped at look | seeds | units | z | decision | difference | adjusted | 95% interval "
                  "| design p |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in record.variants.items():
        decision = ("not crossed" if v["decision"] == "futile" and v["look"] == len(record.waves)
                    else "undefined" if v.get("z") is None and v["decision"] != "continue" else v["decision"])
        lines.append(f"| {name} | {v['look']} | {v['seeds']} | {v['units']} | {_fmt(v.get('z'), 3)} | {decision} "
                     f"| {_fmt(v.get('difference'))} | {_fmt(v.get('estimate'))} | {_ci(v.get('interval'))} "
                     f"| {_fmt(v.get('p_value'), 3)} |")
    lines += ["", "The interval is the stagewise-ordering interval, valid under the design (a t interval at the "
                  "stopping look is not: an early stop for efficacy overestimates); 'adjusted' is the median-unbiased "
                  "difference. Units are the independent starts the look compared (seeds that share a start "
                  "checkpoint count as one).", ""]
    fixed = (f", against {record.runs_fixed} for the fixed design that detects the target effect with "
             f"{record.power:.0%} power" if record.runs_fixed else "")
    lines += [f"Runs used: {record.runs_used} of at most {record.runs_max}{fixed}.", ""]
    return "\n".join(lines)


def write_report(study: Study, study_dir: Path, specs: Optional[List[RunSpec]] = None,
                 seed_plan: Optional[SeedPlan] = None) -> StudyAggregate:
    """Collects, aggregates and writes aggregate.json, report.md and plots; returns the aggregate.
    The seed plan, when not given, is the one plan.json recorded at launch."""
    specs = specs if specs is not None else load_plan(study_dir)
    seed_plan = seed_plan if seed_plan is not None else load_seed_plan(study_dir)
    results: List[RunOutcome] = collect(specs, study)
    plots = plot_study(study.name, results, study_dir / "plots")
    provenance, machine = provenance_summary(specs, study)
    agg = aggregate(study, results, provenance, plots=plots, seed_plan=seed_plan,
                    pilot_correlation=pilot_correlation(find_pilot(study, study_dir.parent)),
                    starts={s.seed: s.init_from for s in specs if s.variant == BASELINE and s.init_from})
    write_json(study_dir / MACHINE_PROVENANCE, machine)
    agg.save(aggregate_path(study_dir))
    write_text(study_dir / REPORT, render(agg))
    return agg
