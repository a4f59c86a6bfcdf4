"""The tuning path over several rounds (`python -m experiments summary`, reports/summary.md).

Its first line is a verdict with its evidence, never a bare recommendation. A confirmation run
(the tuned recipe against the baseline recipe on fresh seeds; its record, `Confirmation`, read
with `--confirmation`) decides it: "Deploy X: +d [CI] over the baseline (p)", or "No evidence that
the tuned recipe beats the baseline (...): keep the baseline or run N more seeds". Without one, the
tuned setting is unconfirmed, and the line says so with what the path does show: the gain of the
final choice over the warm start on the evaluation split, its interval, p-value and the
independent units behind it. The path never compared the tuned recipe with the baseline recipe
from one start: each round tested its variants against its own baseline, already carrying the
earlier rounds' choices and weights, and picked a winner among several, which flatters it. A
final choice whose runs break a guardrail is never recommended; the line says so instead. When
every round kept its baseline, what is deployed is the baseline recipe as is.

The setting is the bindings as the runs got them (`setting_as_run`): the choices of the rounds and
the overrides every run of a round got (`--overrides FILE:KEY` or `-b`, which the aggregate
records), each at the value the final round's runs trained with. Then one model to ship and the
command that makes it loadable (`model_to_ship`), the final choice over independent units (seeds
that share a start checkpoint are one lineage, `StudyAggregate.lineages`), the gain over the warm
start, the test split (experiments/heldout.py `heldout_lines`), and the advisor's next round;
then each round with its evidence.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from pydantic import TypeAdapter, ValidationError

from experiments import stats
from experiments.errors import StudyError
from experiments.paths import portable
from experiments.report import ANALYSIS_TEXT, beside_metrics, beside_text, best_checkpoint_text
from experiments.results import EQUIVALENT, RunStatus, StudyAggregate, VariantResult, aggregate_path
from experiments.seed_plan import plan_line, shortfall
from experiments.study import split_binding

EXPORT = "python -m rlhf.export"
"""The command that writes a checkpoint's policy as an ordinary HF model (rlhf/export.py)."""


# ----------------------------------------------------------------------------- the confirmation record
@dataclasses.dataclass(frozen=True)
class Confirmation:
    """The record of a confirmation run: the tuned recipe against the baseline recipe on fresh
    seeds, one test of one question, so its p-value needs no correction and no winner was picked
    on its seeds. A JSON object (`read_confirmation`) with these fields:

    bindings: the tuned recipe's engine bindings over the baseline recipe, as its runs got them
        (e.g. ["ppo.kl_coef = 0.408"]; [] when the tuned recipe is the baseline's).
    difference: tuned - baseline, the mean difference of the decision metric, in its units.
    ci: [low, high], the difference's 95% interval.
    p: the two-sided p-value of the difference.
    n_units: independent units per arm (lineages: seeds that share a start checkpoint count once).
    model: the tuned recipe's checkpoint to ship (a run's checkpoints/step_N).
    Optional: study (the confirmation's name), metric (the decision metric's name; default the last
    round's), n_seeds (seeds per arm), alpha (default 0.05), seeds_needed (units per arm that detect
    the last round's study.target_effect at 80% power; else estimated from the interval),
    baseline_model (the baseline recipe's checkpoint, shipped when the baseline is kept), and
    guardrail_violations (each guardrail the tuned recipe's runs break, in words; [] when they hold
    every one)."""

    bindings: Tuple[str, ...]
    difference: float
    ci: Tuple[float, float]
    p: float
    n_units: int
    model: str
    study: str = ""
    metric: str = ""
    n_seeds: Optional[int] = None
    alpha: float = 0.05
    seeds_needed: Optional[int] = None
    baseline_model: str = ""
    guardrail_violations: Tuple[str, ...] = ()


_CONFIRMATION = TypeAdapter(Confirmation)


NOTHING_TO_CONFIRM = "nothing_to_confirm"
"""The key of a confirmation record written when the rounds adopted no change: no run was needed."""


def read_confirmation(path: str | Path) -> Optional[Confirmation]:
    """The confirmation record at `path`; None when it says the rounds adopted nothing to confirm
    (`NOTHING_TO_CONFIRM`: the tuned recipe is the baseline's); a StudyError in one line naming what
    is wrong."""
    try:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict) and data.get(NOTHING_TO_CONFIRM) is True and not data.get("bindings"):
            return None
        record = _CONFIRMATION.validate_python(data)
    except (OSError, ValueError) as err:  # json's and pydantic's errors are ValueErrors
        if isinstance(err, ValidationError):
            first = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in err.errors()[:2])
        else:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StudyError(f"--confirmation {path}: not a confirmation record ({first}); its fields: bindings, "
                         f"difference, ci, p, n_units, model (experiments/summary.py `Confirmation`)") from None
    if not all(math.isfinite(x) for x in (record.difference, *record.ci, record.p)) or record.n_units < 2:
        raise StudyError(f"--confirmation {path}: difference, ci and p must be finite numbers and n_units at "
                         f"least 2 (got difference {record.difference}, ci {list(record.ci)}, p {record.p}, "
                         f"n_units {record.n_units})")
    return record


# ----------------------------------------------------------------------------- the setting as run
def _bindings(lines: Sequence[str]) -> Dict[str, str]:
    """{'ppo.kl_coef': '0.408'} of binding lines, in order, the last of a parameter winning (as gin)."""
    out: Dict[str, str] = {}
    for line in lines:
        key, value = split_binding(line, "a recorded binding")
        out[key] = value
    return out


def setting_as_run(agg: StudyAggregate, variant: str) -> Optional[Dict[str, str]]:
    """{parameter: value} of every engine binding `variant`'s runs got: the baseline's as the
    aggregate records them (overrides included), then the variant's own change, which wins; None
    when the aggregate predates that record."""
    ran = (agg.provenance or {}).get("baseline_bindings")
    if ran is None or variant not in agg.variants:
        return None
    return _bindings([*ran, *agg.variants[variant].bindings])


def setting_after(setting: Dict[str, str], sources: Dict[str, str], name: str,
                  agg: StudyAggregate) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(the tuned setting, where each parameter came from) after round `name` (aggregate `agg`),
    from those before it: the parameters the round's choice binds ('chosen by NAME') and those its
    overrides set ("set by NAME's overrides") join the setting, and every parameter takes the value
    the chosen variant's runs trained with (`setting_as_run`); one those runs did not bind leaves
    it (they ran the recipe's value). An aggregate written before the bindings were recorded adds
    its choice as stated."""
    overridden = _bindings((agg.provenance or {}).get("overrides") or ())
    own = _bindings(agg.chosen.bindings if agg.chosen is not None else ())
    sources = {**sources, **{k: f"set by {name}'s overrides" for k in overridden},
               **{k: f"chosen by {name}" for k in own}}
    choice = agg.decision.chosen
    ran = setting_as_run(agg, choice) if choice else None
    if ran is None:
        new = {**setting, **own}
    else:
        new = {k: ran[k] for k in [*setting, *(k for k in [*overridden, *own] if k not in setting)] if k in ran}
    return new, {k: sources[k] for k in new}


def _setting_text(setting: Dict[str, str]) -> str:
    return ", ".join(f"`{k} = {v}`" for k, v in setting.items())


def _guardrail_text(variant: VariantResult) -> str:
    """'kl_divergence <= 0.5: seeds 1, 2' for each guardrail the variant's runs break."""
    return "; ".join(f"{g.bound}: seed{'s' if len(g.violated_seeds) != 1 else ''} "
                     f"{', '.join(map(str, g.violated_seeds))}" for g in variant.guardrails.values() if not g.ok)


# ----------------------------------------------------------------------------- statistics of the first screen
def _units(agg: StudyAggregate, variant: VariantResult) -> List[List[float]]:
    """The variant's completed values grouped into independent units (a lineage's seeds together)."""
    by_seed = {r.seed: r.value for r in variant.runs if r.status == RunStatus.COMPLETED and r.value is not None}
    return [[by_seed[s] for s in unit] for unit in stats.seed_units(list(by_seed), agg.lineages)]


def units_text(units: int, seeds: int) -> str:
    """'3 lineages (5 seeds)' when seeds share starts, else '5 seeds'."""
    if units == seeds:
        return f"{seeds} seed{'s' if seeds != 1 else ''}"
    return f"{units} lineage{'s' if units != 1 else ''} ({seeds} seeds)"


def gain(final_units: Sequence[float], start: Sequence[float]) -> Optional[dict]:
    """The final choice's unit means against the warm start's first evaluations (one per
    first-round baseline seed, before any training): the difference, Welch's 95% interval and
    p-value (`stats.difference_ci`, `stats.welch_p`); None without both."""
    if not final_units or not start:
        return None
    diff = sum(final_units) / len(final_units) - sum(start) / len(start)
    lo, hi = stats.difference_ci(final_units, start)
    p = stats.welch_p(final_units, start)
    return {"difference": diff, "ci95": (lo, hi) if math.isfinite(lo) else (None, None),
            "p": p if math.isfinite(p) else None}


def _gain_text(g: Optional[dict], final_units: int, final_seeds: int, starts: int) -> str:
    """'+0.0052 [-0.0416, 0.0520] (p = 0.79; 3 lineages (5 seeds) against 3 first evaluations)'."""
    if g is None:
        return ("unknown (the first round's run dirs are not here: `dvc pull` brings results/)" if not starts
                else "unknown (the final choice has no completed seed with a value)")
    p = f"p = {g['p']:.2g}; " if g["p"] is not None else ""
    return (f"{g['difference']:+.4f} {_ci4(g['ci95'])} ({p}{units_text(final_units, final_seeds)} against "
            f"{starts} first evaluation{'s' if starts != 1 else ''})")


def _ci(pair) -> str:
    """'[0.1, 0.2]' at 4 significant digits, as the rounds' tables print an interval."""
    return "–" if not pair or pair[0] is None else f"[{pair[0]:.4g}, {pair[1]:.4g}]"


def _ci4(ci) -> str:
    return "[-]" if not ci or ci[0] is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def model_to_ship(agg: StudyAggregate, study_dir: Path, heldout: Optional[dict] = None) -> Optional[dict]:
    """The one model of the final choice to ship: the final checkpoint of its seed whose decision
    value is the median of its completed seeds (the lower of the two middle ones for an even count,
    the lower seed on a tie). Not the best seed: its value is the top of several draws of the same
    recipe, which overstates what the recipe gives and what the model will do; the median seed is a
    typical draw, so the recipe's figures describe it. The checkpoint is the run's newest intact one
    when the results are here, else the one the `heldout` record scored, else the run's final step.
    {seed, value, n (the completed seeds), path, exists (the checkpoint is here)}; None without a
    completed seed."""
    from experiments.run_records import latest_checkpoint

    chosen = agg.chosen
    runs = sorted((r for r in chosen.runs if r.status == RunStatus.COMPLETED and r.value is not None),
                  key=lambda r: (r.value, r.seed)) if chosen else []
    if not runs:
        return None
    run = runs[(len(runs) - 1) // 2]
    ckpt = latest_checkpoint(study_dir / run.run_dir)
    final = (heldout or {}).get("final_choice") or {}
    scored = {row["seed"]: row["path"] for row in final.get("seeds", [])} if final.get("study") == agg.study else {}
    path = (portable(ckpt) if ckpt is not None else scored.get(run.seed)
            or f"{portable(study_dir / run.run_dir)}/checkpoints/step_{run.steps}")
    return {"seed": run.seed, "value": run.value, "n": len(runs), "path": path, "exists": ckpt is not None}


def export_dir(ckpt: str) -> str:
    """Where the export of checkpoint `ckpt` goes: models/<study>-<variant>-seed<N>-step<K> for a
    run's checkpoint, else models/deploy."""
    m = re.search(r"([^/]+)/runs/([^/]+)/seed(\d+)/checkpoints/step_(\d+)/?$", ckpt)
    return f"models/{m.group(1)}-{m.group(2)}-seed{m.group(3)}-step{m.group(4)}" if m else "models/deploy"


def export_lines(ckpt: str, why: str, exists: bool = True) -> List[str]:
    """The model to ship, why it, and the command that makes it loadable: a checkpoint's folder is
    no HF model (the policy is in its actor/, a LoRA adapter without its base), `EXPORT` writes one."""
    out = export_dir(ckpt)
    return [f"**Model to ship:** `{ckpt}` ({why}){'' if exists else '; `dvc pull` brings it'}.",
            f"Its folder does not load with `from_pretrained` (the policy is in its `actor/`); `{EXPORT} {ckpt} "
            f"--out {out}` writes one that does (with its tokenizer; a LoRA adapter is merged into its base): "
            f"`AutoModelForCausalLM.from_pretrained(\"{out}\")`."]


# ----------------------------------------------------------------------------- the verdict
def _verdict_unconfirmed(setting: Dict[str, str], sources: Dict[str, str], recipe: str, evidence: str) -> str:
    """The first line without a confirmation run."""
    if not setting:
        return (f"**No tuned change:** every round kept its baseline, so what is deployed is the baseline recipe "
                f"`{recipe}` as is; its training's gain over the warm start: {evidence}.")
    if len(setting) == 1:
        (key, value), = setting.items()
        what = f"`{key} = {value}` was {sources[key]} but"
    else:
        what = "the tuned setting (" + "; ".join(f"`{k} = {v}`, {sources[k]}" for k, v in setting.items()) + ") was"
    return (f"**Not confirmed:** {what} never run against the baseline recipe `{recipe}`; gain over the warm "
            f"start {evidence}.")


def confirms(record: Confirmation, higher: bool) -> bool:
    """Whether the confirmation shows the tuned recipe better than the baseline, its guardrails holding."""
    return (not record.guardrail_violations and record.p < record.alpha and record.difference != 0
            and (record.difference > 0) == higher)


def _verdict_confirmed(record: Confirmation, higher: bool, recipe: str, target: Optional[float]) -> str:
    """The first line from a confirmation run's record."""
    from scipy.stats import norm

    change = _setting_text(_bindings(record.bindings)) or f"the baseline recipe `{recipe}` as is"
    interval = f"{record.difference:+.4f} [{record.ci[0]:.4f}, {record.ci[1]:.4f}]"
    seeds = f" ({record.n_seeds} seeds)" if record.n_seeds and record.n_seeds != record.n_units else ""
    units = f"{record.n_units} lineages per arm{seeds}" + (f", `{record.study}`" if record.study else "")
    if record.guardrail_violations:
        return (f"**Nothing to deploy:** the confirmation runs of {change} break a guardrail "
                f"({'; '.join(record.guardrail_violations)}) ({interval}, p = {record.p:.2g}; {units}): keep the "
                f"baseline recipe `{recipe}`.")
    if confirms(record, higher):
        return f"**Deploy** {change}: {interval} over the baseline (p = {record.p:.2g}; {units})."
    needed = record.seeds_needed
    effect = target if target else abs(record.difference)
    if needed is None and effect:  # the per-arm spread the interval implies: its half-width is z * sd * sqrt(2 / n)
        sd = (record.ci[1] - record.ci[0]) / (2 * float(norm.ppf(0.975))) * math.sqrt(record.n_units / 2)
        needed = stats.seeds_needed(effect, sd, record.alpha)
    keep = (f"**No evidence that the tuned recipe beats the baseline** ({interval}, p = {record.p:.2g}; {units}): keep "
            f"the baseline recipe `{recipe}`")
    if needed is not None and needed <= record.n_units:
        return (f"{keep}: {record.n_units} lineages per arm detect {effect:+.3g} at 80% power, so a gain that size "
                f"would likely have shown.")
    more = (f"run {needed - record.n_units} more seeds per arm ({needed} detect {effect:+.3g} at 80% power)"
            if needed is not None else "run more seeds per arm")
    return f"{keep} or {more}."


# ----------------------------------------------------------------------------- the summary
def _round_facts(agg: StudyAggregate) -> List[str]:
    """What a round's verdicts rest on: the seeds run against the plan and the power they gave,
    shared starts, the equivalence question and its answer, the overrides its runs got."""
    lines = []
    plan = agg.seed_plan
    if plan is not None:
        planned = plan_line(plan, agg.direction).removeprefix("plan: ")
        short = shortfall(plan, agg.direction)
        lines.append(f"Seeds: {plan.seeds_run} per variant ran; {planned}"
                     + (f". **Short of the plan:** {short.removeprefix('notice: ')}" if short else "") + ".")
    if agg.lineages:
        shared = "; ".join(f"seeds {', '.join(map(str, seeds))} from `{start}`" for start, seeds in agg.lineages.items()
                           if len(seeds) > 1)
        lines.append(f"Shared starts: {shared}. The tests compare {len(agg.lineages)} lineage means (seeds from one "
                     f"start share its luck, so they count as one unit).")
    if agg.equivalence_margin > 0:
        answers = []
        for name, v in agg.variants.items():
            c = v.comparison
            if c is not None:
                p = c.equivalence_p_holm
                answers.append(f"{name}: {'yes' if v.verdict == EQUIVALENT else 'not shown'}"
                               + (f" (TOST p = {p:.3g}, Holm)" if p is not None else ""))
        lines.append(f"Equivalence within ±{agg.equivalence_margin:g}? " + "; ".join(answers) + ".")
    overrides = (agg.provenance or {}).get("overrides")
    if overrides:
        lines.append("Run with overrides: " + "; ".join(f"`{b}`" for b in overrides) + " (bindings beyond the study "
                     "file's, from `--overrides` or `-b`: every run of the round got them, a variant's own change "
                     "winning).")
    return [*lines, ""] if lines else []


def _finite_mean(values: Sequence[float]) -> str:
    """'0.5000' over the finite values, then '(1 of 4 missing)' when some are NaN or inf; '–' for none."""
    finite = [x for x in values if math.isfinite(x)]
    missing = len(values) - len(finite)
    return ((f"{sum(finite) / len(finite):.4f}" if finite else "–")
            + (f" ({missing} of {len(values)} missing)" if missing else ""))


def _flags(v: VariantResult) -> str:
    text = v.verdict
    if v.underpowered:
        text += " (underpowered)"
    return text


def _units_column(agg: StudyAggregate) -> str:
    return f" ({len(agg.lineages)} lineages)" if agg.lineages else ""


def render_summary(rounds: Sequence[tuple], results_dir: Path, heldout: Optional[dict] = None,
                   confirmation: Optional[Confirmation] = None) -> str:
    """The tuning path's summary (see the module docstring). `rounds`: (Study, StudyAggregate)
    pairs in round order; `heldout`: the test split's record (experiments/heldout.py), which no
    decision read; `confirmation`: a confirmation run's record, which decides the first line."""
    from experiments.advisor.advise import advise
    from experiments.advisor.evidence import advice_lines, initial_values
    from experiments.advisor.window import AdviceError, load_window

    setting: Dict[str, str] = {}
    sources: Dict[str, str] = {}
    body: List[str] = []
    start_values: List[float] = []
    start_beside: Dict[str, List[float]] = {}
    first, best_overall = None, None
    fmt = lambda x: "" if x is None else f"{x:.4g}"  # noqa: E731
    for study, agg in rounds:
        decision = agg.decision
        study_dir = Path(results_dir) / study.name
        body += [f"## {study.name}: {agg.description}", ""]
        if study.resume_from and aggregate_path(study.resume_from).is_file():
            body += advice_lines(Path(study.resume_from), agg, study_dir)
        if first is None:
            first = (study, agg)
            start_values = list(initial_values(agg, study_dir, agg.metric))  # NaNs are counted as missing
            start_beside = {m: list(initial_values(agg, study_dir, m)) for m in beside_metrics(agg)}
        body += [f"Decision: **{decision.chosen}**: {decision.reason}." if decision.chosen
                 else f"Decision: none: {decision.reason}.", ""]
        body += _round_facts(agg)
        beside = beside_metrics(agg)
        body += ["| variant | change | n | mean | std | difference [95% CI] | Holm p | verdict |"
                 + "".join(f" {m} |" for m in beside),
                 "|---|---|---|---|---|---|---|---|" + "---|" * len(beside)]
        for name, var in agg.variants.items():
            own = var.comparison.decisive if var.comparison else None
            diff = f"{fmt(own.difference)} {_ci(own.difference_ci95)}" if own else ""
            body.append(f"| {name} | {'; '.join(var.bindings) or '-'} | {var.summary.n}{_units_column(agg)} | "
                        f"{fmt(var.summary.mean)} | {fmt(var.summary.std)} | {diff} | "
                        f"{fmt(var.comparison.p_value_holm if var.comparison else None)} | {_flags(var)} |"
                        + "".join(f" {beside_text(var, m)} |" for m in beside))
        body += [f"\nDifferences: {ANALYSIS_TEXT.get(agg.analysis, agg.analysis)}, 95% t interval (uncorrected); "
                 f"means: std over seeds (ddof = 1)."]
        if decision.guardrail_violations:
            body.append(f"\nGuardrail violations: {list(decision.guardrail_violations)}")
        chosen = agg.chosen
        setting, sources = setting_after(setting, sources, study.name, agg)
        after = _setting_text(setting) or "the baseline's"
        if chosen is not None and not chosen.guardrails_ok:
            after += f" ⚠ its runs break a guardrail ({_guardrail_text(chosen)})"
        body += ["", f"Setting after {study.name}: {after}", ""]
        record = agg.best_checkpoints
        if record is not None and record.best is not None:
            body += [f"Best gold checkpoint of {study.name} (on the eval split that made the decisions): "
                     f"{best_checkpoint_text(record.best, record.metric, f'{portable(study_dir)}/')}.", ""]
            if best_overall is None or record.best.rank > best_overall[1].rank:
                best_overall = (study, record.best, record.metric)
    lines = ["# Tuning path", ""]
    if rounds:
        lines += _first_screen(rounds, Path(results_dir), setting, sources, start_values, start_beside, best_overall,
                               heldout, confirmation)
        last_study, last = rounds[-1]
        try:
            advice = advise(load_window(Path(results_dir) / last_study.name))
        except AdviceError as err:
            advice = None
            lines += [f"**Next round:** the advisor cannot read {last_study.name} ({err}).", ""]
        if advice is not None:
            if advice.changes:
                lines += [f"**Next round** (the advisor on {last_study.name}/{last.decision.chosen}): "
                          + "; ".join(f"{s.rule}: {' or '.join(f'`{b}`' for b in s.bindings)}" for s in advice.changes)
                          + f" (`python -m experiments advise {portable(last_study.path)}`).", ""]
            else:
                lines += [f"**Next round:** none: no advisor rule fires on {last_study.name}/{last.decision.chosen}; "
                          f"tuning has converged for the rules' signals.", ""]
    return "\n".join(lines + body)


def _first_screen(rounds, results_dir: Path, setting: Dict[str, str], sources: Dict[str, str],
                  start_values: List[float], start_beside: Dict[str, List[float]], best_overall,
                  heldout: Optional[dict], confirmation: Optional[Confirmation]) -> List[str]:
    """The verdict line, then what is deployed (the setting as run, the model to ship and how to
    load it), the final choice over independent units, its gain over the warm start, the best
    single checkpoint and the test split. `start_values` may hold NaNs (a seed that logged none): the
    warm start's line counts them as missing, the gain reads the finite ones."""
    raw_start, start_values = start_values, [v for v in start_values if math.isfinite(v)]
    last_study, last = rounds[-1]
    recipe = (last.provenance or {}).get("recipe") or portable(last_study.baseline_recipe)
    target = next((s.target_effect for s, _ in reversed(rounds) if s.target_effect), None)
    higher = last.direction == "higher"
    chosen = last.chosen
    study_dir = results_dir / last_study.name
    if chosen is None:
        return [f"**Nothing to deploy:** {last_study.name} decided nothing ({last.decision.reason}).", ""]
    units = _units(last, chosen)
    unit_means = [sum(u) / len(u) for u in units]
    seeds = sum(len(u) for u in units)
    g = gain(unit_means, start_values)
    evidence = _gain_text(g, len(units), seeds, len(start_values)) + " on the eval split, which every decision read"
    broken = not chosen.guardrails_ok
    if broken:
        verdict = (f"**Nothing to deploy:** {last_study.name}'s final choice `{last.decision.chosen}` breaks its "
                   f"guardrails ({_guardrail_text(chosen)}), and no variant that held them beat it: this path "
                   f"recommends no setting. The round's report lists each seed's guardrail values; find what breaks "
                   f"them and run the round again.")
    elif confirmation is not None:
        verdict = _verdict_confirmed(confirmation, higher, recipe, target)
    else:
        verdict = _verdict_unconfirmed(setting, sources, recipe, evidence)
    lines = [verdict, ""]
    if confirmation is not None:
        confirmed = _bindings(confirmation.bindings)
        if confirmed != setting:
            lines.append(f"The confirmation ran {_setting_text(confirmed) or 'the baseline recipe as is'}, not the "
                         f"path's tuned setting ({_setting_text(setting) or 'none'}): its verdict is about what it "
                         f"ran.")
        if not broken:
            lines.append(f"Without the confirmation, the path's own evidence: gain over the warm start {evidence}.")
    ran = setting_as_run(last, last.decision.chosen or "")
    if setting:
        lines.append(f"Tuned setting: {', '.join(f'`{k} = {v}` ({sources[k]})' for k, v in setting.items())}, on "
                     f"the baseline recipe `{recipe}`.")
    if ran is not None:
        lines.append(f"The final choice's runs trained with `{recipe}` and "
                     + ("; ".join(f"`{k} = {v}`" for k, v in ran.items()) or "no bindings")
                     + f" ({last_study.name}'s `{last.decision.chosen}` as run; the manager adds each run's seed, "
                       f"threads and start checkpoint).")
    lines += _ship_lines(last, study_dir, heldout, confirmation, broken, higher)
    s = chosen.summary
    also = "".join(f"; {m} = {beside_text(chosen, m)}" for m in chosen.beside)
    if len(units) < seeds:
        lo, hi = stats.mean_ci(unit_means) if len(units) > 1 else (None, None)
        lines.append(f"Final choice: `{last.decision.chosen}` of {last_study.name}, {last.metric} = "
                     f"{sum(unit_means) / len(unit_means):.4g}, the mean over {units_text(len(units), seeds)} (95% t "
                     f"interval over the lineage means {_ci4((lo, hi))}; {_fmt4(s.mean)} ± {_fmt4(s.std)} over the "
                     f"seeds, which share starts){also}.")
    else:
        lines.append(f"Final choice: `{last.decision.chosen}` of {last_study.name}, {last.metric} = {_fmt4(s.mean)} ± "
                     f"{_fmt4(s.std)} over {units_text(len(units), seeds)} (95% t interval {_ci(s.ci95)}){also}.")
    if raw_start:
        start = [(last.metric, raw_start), *((m, v) for m, v in start_beside.items() if v)]
        lines.append("At the warm start (each first-round baseline seed's evaluation before training): "
                     + "; ".join(f"{m} = {_finite_mean(v)}" for m, v in start) + ".")
    if g is not None:
        each = "lineage means" if len(units) < seeds else "seeds"
        lines.append(f"Gain over the warm start: {_gain_text(g, len(units), seeds, len(start_values))}, Welch's test "
                     f"of the final choice's {each} against the first evaluations, on the eval split.")
    if best_overall is not None:
        study, best, metric = best_overall
        lines.append(f"Best single checkpoint on the eval split: "
                     f"{best_checkpoint_text(best, metric, f'{portable(results_dir / study.name)}/')}: a maximum "
                     f"over every evaluated checkpoint, so optimistic; not the model to ship.")
    lines.append("")
    if heldout:
        from experiments.heldout import heldout_lines
        lines += [*heldout_lines(heldout, last.lineages, target, last.alpha), ""]
    return lines


def _ship_lines(last: StudyAggregate, study_dir: Path, heldout: Optional[dict], confirmation: Optional[Confirmation],
                broken: bool, higher: bool) -> List[str]:
    """The model to ship and how to make it loadable; none when the final choice breaks a guardrail."""
    if broken:
        return ["No model to ship: the final choice's runs break a guardrail."]
    if confirmation is not None:
        if confirms(confirmation, higher):
            return export_lines(confirmation.model, "the tuned recipe's model the confirmation run names")
        if confirmation.baseline_model:
            return export_lines(confirmation.baseline_model, "the baseline recipe's model the confirmation run names")
        return ["No model to ship from this path: the baseline recipe is kept, and the confirmation names none of "
                "its models."]
    ship = model_to_ship(last, study_dir, heldout)
    if ship is None:
        return []
    why = (f"seed {ship['seed']} of {last.study}'s `{last.decision.chosen}`, {last.metric} {ship['value']:.4g}: the "
           f"median of its {ship['n']} seeds; the best seed's value is the top of {ship['n']} draws of one recipe and "
           f"overstates what it gives")
    return export_lines(ship["path"], why, ship["exists"])


def _fmt4(x) -> str:
    return "–" if x is None else f"{x:.4g}"
