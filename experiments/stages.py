"""The steps of the DVC pipeline (`dvc.yaml`) that are not a study run, as subcommands:

    python -m experiments data    --recipe R --out data/arithmetic
    python -m experiments sft     --recipe R --data data/arithmetic --out models/sft
    python -m experiments params  STUDY.gin... --out params
    python -m experiments export  STUDY.gin --results results --out reports
    python -m experiments summary STUDY.gin... --results results [--heldout reports/heldout.json]
        [--confirmation RECORD.json] --out reports/summary.md

DVC cannot read gin, so `params` resolves each study recipe into a YAML file that DVC reads as
params (the recipe stays the one source of truth): the parameters as the runs get them, so a
round that resumes another is resolved once that one has run (its setting and checkpoints);
`export` turns a finished study into what DVC versions beside it: headline statistics and
per-step curves for `dvc metrics` and `dvc plots`, the report and the per-seed values; `summary`
writes the tuning path over all rounds (rendered by `summary.render_summary`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from experiments.paths import output_dir, output_file, portable
from experiments.results import BASELINE, StudyAggregate, aggregate_path, read_aggregate
from rlhf.atomic import finite, write_text
from rlhf.metrics import SIGNALS


# ----------------------------------------------------------------------------- data + sft
def cmd_data(args) -> int:
    from rlhf import configurable
    from rlhf.data import dataset_hash, load_task

    cfg, _ = configurable.resolve(args.recipe, args.binding)
    train, held = load_task(cfg.task)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", held)):
        with open(out / f"{name}.jsonl", "w") as f:
            for ex in rows:
                f.write(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n")
    (out / "meta.json").write_text(json.dumps({"train": len(train), "eval": len(held),
                                               "sha256": dataset_hash(train + held)}, indent=1))
    print(f"wrote {len(train)} train and {len(held)} held-out examples to {out}")
    return 0


def cmd_sft(args) -> int:
    """The warm start: a tiny Llama and character tokenizer trained by SFT on the data's train split."""
    from rlhf import numerics
    numerics.apply()  # before torch loads: the warm start is the same on every x86-64 CPU
    from rlhf import configurable
    from rlhf.data import read_records, records_to_examples
    from rlhf.tiny import build_char_tokenizer, build_tiny_model, train_sft

    cfg, _ = configurable.resolve(args.recipe, args.binding)
    out = Path(args.out)
    train = records_to_examples(read_records(Path(args.data) / "train.jsonl"), "prompt", "answer", args.data)
    tokenizer = build_char_tokenizer(out / "tokenizer")
    model = build_tiny_model(cfg.tiny_model, tokenizer, seed=cfg.sft.seed)
    with numerics.fixed_threads():
        losses = train_sft(model, tokenizer, train, cfg.sft, log=print)
    model.save_pretrained(str(out / "model"), safe_serialization=True)
    (out / "sft.json").write_text(json.dumps({"final_loss": sum(losses[-20:]) / 20, "steps": cfg.sft.steps},
                                             indent=1))
    return 0


# ----------------------------------------------------------------------------- params
def study_params(path: str, bindings: List[str]) -> Dict:
    """A study's resolved settings as nested YAML-able dicts: the baseline's operative config as
    its runs get it, each variant's change, seeds, the decision metric and how it is judged
    (alpha, analysis, equivalence margin: they change the report, not a run). `bindings` (`-b`, and
    those of `--overrides`, e.g. params.yaml:round1) show as the values they set.

    A study that resumes a previous round (`study.resume_from`) is resolved as the planner resolves
    it, so the previous round must have run: the baseline carries the resumed setting
    (`study.resumed_setting`, the previous choice's bindings, under the baseline's own), and
    `ppo.init_from` is each seed's start checkpoint ({seed: path}), which the planner binds per run."""
    from experiments.plan import config_changes, resolve_config
    from experiments.resume_from import resume_checkpoints, resumed_setting, resumed_study
    from experiments.study import load_study
    from rlhf.configurable import flat_dict, nested_dict

    declared = load_study(path, bindings)
    starts = resume_checkpoints(declared)
    study = resumed_study(declared)
    base_cfg, _ = resolve_config(study.baseline_recipe, study.baseline_bindings, "study.baseline_bindings")
    base = flat_dict(base_cfg)
    flat = {k: v for k, v in base.items() if k != "ppo.seed"}
    if starts:
        flat["ppo.init_from"] = dict(starts)
    variants = {}
    for variant in study.variants:
        cfg, _ = resolve_config(study.baseline_recipe, [*study.baseline_bindings, *variant.bindings],
                                f"study.variants[{variant.name!r}]")
        variants[variant.name] = config_changes(base, flat_dict(cfg))
    return {"changed": recipe_changes(path, flat, study),
            "study": {"name": study.name, "seeds": list(study.seeds), "metric": study.metric,
                      "direction": study.direction, "resume_from": portable(study.resume_from) or None,
                      "resumed_setting": list(resumed_setting(declared)),
                      "alpha": study.alpha, "analysis": study.analysis,
                      "equivalence_margin": study.equivalence_margin,
                      "metric_resolution": study.metric_resolution},
            "baseline": nested_dict(flat), "variants": {k: nested_dict(v) for k, v in variants.items()}}


def _settings(study) -> Dict:
    """The study settings a round's params show ('study.x': value): seeds and how it is judged."""
    return {"study.seeds": list(study.seeds), "study.alpha": study.alpha, "study.analysis": study.analysis,
            "study.equivalence_margin": study.equivalence_margin, "study.metric_resolution": study.metric_resolution}


def recipe_changes(path: str, flat: Dict, study) -> Dict:
    """What the round's runs get that its recipe (`path`, read alone) does not say: the overrides and,
    in a round that resumes another, the setting it inherits, as nested {scope: {parameter: value}},
    with the study settings (`_settings`) that differ from the recipe's (`study`: as the round
    runs). The round's params in `dvc exp show` and `dvc params diff` (dvc.yaml tracks this key of
    params/roundN.yaml): a column per changed parameter instead of one per engine default. Per-seed
    start checkpoints are left out: they follow from the round it resumes."""
    from experiments.plan import config_changes, resolve_config
    from experiments.study import load_study
    from rlhf.configurable import flat_dict, nested_dict

    plain = load_study(path)
    cfg, _ = resolve_config(plain.baseline_recipe, plain.baseline_bindings, "study.baseline_bindings")
    written = {k: v for k, v in flat_dict(cfg).items() if k != "ppo.seed"}
    changes = {k: v for k, v in config_changes(written, flat).items() if k != "ppo.init_from"}
    declared = _settings(plain)
    changes.update({k: v for k, v in _settings(study).items() if declared[k] != v})
    return nested_dict(changes)


OVERRIDES_FILE = "params.yaml"
"""Where the pipeline keeps each round's overrides (dvc.yaml passes `--overrides params.yaml:<round>`):
DVC's default params file, which `dvc exp run -S` edits."""
STAMP = "# sha256 of the YAML below (a hand edit is told from a regeneration by it): "


def _override_target(params: Dict, spec: Optional[str]) -> Tuple[str, str]:
    """(file, key) a round's overrides live under: `--overrides FILE:KEY`, else params.yaml:<study name>."""
    if spec:
        file, _, key = spec.rpartition(":")
        return file, key
    return OVERRIDES_FILE, params["study"]["name"]


def set_param_command(file: str, key: str, value) -> str:
    """The `dvc exp run -S` that sets `key` (e.g. 'round1.ppo.kl_coef') to `value` in `file`: `++` adds
    the key or changes it (Hydra's override grammar, which DVC's -S speaks); a file other than
    params.yaml, DVC's default, is named before the key."""
    where = "" if file == OVERRIDES_FILE else f"{file}:"
    return f"dvc exp run -S '{where}++{key}={_hydra_value(value)}'"


def params_header(path: str, params: Dict, spec: Optional[str] = None) -> str:
    """The comment above a params file: where it comes from, that it is generated (a hand edit is
    refused), and how to change a parameter instead."""
    resumed = params["study"]["resume_from"]
    source = f"{portable(path)} and {resumed} (the round it resumes)" if resumed else portable(path)
    file, key = _override_target(params, spec)
    given = f"# with the overrides under {file}:{key}.\n" if spec else ""
    return (f"# {params['study']['name']}'s parameters as its runs get them, resolved by "
            f"`python -m experiments params`\n"
            f"# from {source}{'' if spec else '.'}\n{given}"
            f"# DVC reads them as the round's params (`dvc params diff`). GENERATED: do not edit; when it is\n"
            f"# regenerated, a hand edit is refused, not overwritten. Edit the recipe, or override a parameter\n"
            f"# of this round in {file}, e.g.: {set_param_command(file, f'{key}.ppo.kl_coef', 0.1)}\n")


def params_text(path: str, params: Dict, spec: Optional[str] = None) -> str:
    """The params file: its header, the stamp (sha256 of the YAML), the YAML."""
    body = yaml.safe_dump(params, sort_keys=True)
    return f"{params_header(path, params, spec)}{STAMP}{hashlib.sha256(body.encode()).hexdigest()}\n{body}"


def _flat_keys(data, prefix: str = "") -> Dict[str, object]:
    """{'baseline': {'ppo': {'kl_coef': 0.1}}} -> {'baseline.ppo.kl_coef': 0.1} (empty dicts kept as values)."""
    if not isinstance(data, dict) or not data:
        return {prefix: data}
    out: Dict[str, object] = {}
    for key, value in data.items():
        out.update(_flat_keys(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _hydra_value(value) -> str:
    """`value` as DVC's -S (Hydra's override grammar) takes it."""
    if isinstance(value, str):
        return value if re.fullmatch(r"[A-Za-z_][\w./-]*", value) and value.lower() not in (
            "true", "false", "null") else json.dumps(value)
    return repr(value) if isinstance(value, float) else json.dumps(value)


def hand_edit(target: Path, params: Dict, path: str, spec: Optional[str] = None) -> Optional[str]:
    """Why writing `params` to `target` would lose a hand edit, or None: `target` is absent, holds
    what was generated (its YAML matches its stamp), or already holds `params`. The line names the
    first edited key and what to do instead: the `dvc exp run -S` override of params.yaml for a
    baseline parameter or a study setting, else the recipe."""
    if not target.is_file():
        return None
    text = target.read_text()
    lines = text.splitlines(keepends=True)
    header = [line for line in lines if line.startswith("#")]
    body = "".join(line for line in lines if not line.startswith("#"))
    stamps = [line[len(STAMP):].strip() for line in header if line.startswith(STAMP)]
    if stamps and stamps[-1] == hashlib.sha256(body.encode()).hexdigest():
        return None
    try:
        edited = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return (f"{portable(target)} does not parse as YAML{where} ({getattr(err, 'problem', None) or err}): it is "
                f"generated from {portable(path)} by `python -m experiments params`, which would overwrite it; "
                f"restore it (git checkout -- {portable(target)}) or delete it, and change {portable(path)} instead")
    if edited == params:
        return None
    now, then = _flat_keys(params), _flat_keys(edited if isinstance(edited, dict) else {})
    key = next((k for k in [*then, *now] if then.get(k, ...) != now.get(k, ...)), "")
    value = then.get(key, ...)
    file, round_key = _override_target(params, spec)
    parts = key.split(".")
    name = ".".join(parts[1:])
    from experiments.overrides import OVERRIDE_FIXED
    from experiments.study import MANAGED_BINDINGS, STUDY_PARAMETERS
    overridable = (parts[0] == "baseline" and len(parts) == 3 and name not in MANAGED_BINDINGS) or (
        parts[0] == "study" and len(parts) == 2 and parts[1] in STUDY_PARAMETERS and key not in OVERRIDE_FIXED)
    if overridable and value is not ...:
        scoped = name if parts[0] == "baseline" else key
        instead = f"set it in {file} instead: {set_param_command(file, f'{round_key}.{scoped}', value)}"
    else:
        instead = f"change {portable(path)} instead"
    shown = f"{key}: {now.get(key)!r} -> {value!r}" if value is not ... else f"{key} removed"
    return (f"{portable(target)} was edited by hand ({shown}), but it is generated from {portable(path)} by "
            f"`python -m experiments params` and regenerating it would lose the edit: restore it "
            f"(git checkout -- {portable(target)}) and {instead}")


def cmd_params(args) -> int:
    """Writes each study's params file; refuses (one line, before writing any) a file edited by hand
    since it was generated (`hand_edit`), which would otherwise be overwritten without a word."""
    from experiments.errors import StudyError

    out = Path(args.out)
    spec = getattr(args, "overrides", None)
    files = []
    for path in args.studies:
        params = study_params(path, args.binding)
        target = out / f"{params['study']['name']}.yaml"
        problem = hand_edit(target, params, path, spec)
        if problem:
            raise StudyError(problem)
        files.append((target, params_text(path, params, spec)))
    out.mkdir(parents=True, exist_ok=True)
    for target, text in files:
        write_text(target, text)
        print(f"wrote {target}")
    return 0


# ----------------------------------------------------------------------------- export
def metric_key(name: str, taken: Sequence[str] = ()) -> str:
    """A variant's name as a metrics key: DVC joins nested keys with dots (`variants.kl_coef_x8.2.p`
    would be ambiguous), so every character but letters, digits, '_' and '-' becomes '_'; a name
    that then collides with one in `taken` gets a numeric suffix."""
    key = re.sub(r"[^A-Za-z0-9_-]", "_", name)
    base, n = key, 2
    while key in taken:
        key, n = f"{base}_{n}", n + 1
    return key


def headline(aggregate: StudyAggregate) -> Dict:
    """dvc metrics (reports/<study>/metrics.json), under keys that are the same in every round and
    experiment, so `dvc metrics diff` compares like with like and `dvc exp show` has a column per
    number that matters (the full rows are in the report, seeds.csv and aggregate.json):
    `decision`: `chosen` (the variant's name, null when nothing could be decided), `chosen_value` and
        `baseline_value` (their means of the decision metric), `effect` (chosen - baseline, as the
        deciding analysis measured it; 0 when the baseline is kept) and `p_value` (its Holm-corrected
        p; null when the baseline is kept);
    `variants`: per variant other than the baseline, under its name without dots (`metric_key`),
        `difference` (against the baseline) and `verdict`."""
    chosen = aggregate.decision.chosen
    variant = aggregate.variants.get(chosen) if chosen is not None else None
    baseline = aggregate.variants.get(BASELINE)
    comparison = variant.comparison if variant is not None else None
    decisive = comparison.decisive if comparison else None
    decision = {"chosen": chosen,
                "chosen_value": variant.summary.mean if variant is not None else None,
                "baseline_value": baseline.summary.mean if baseline is not None else None,
                "effect": decisive.difference if decisive else (0.0 if chosen == BASELINE else None),
                "p_value": comparison.p_value_holm if comparison else None}
    variants: Dict[str, Dict] = {}
    for name, v in aggregate.variants.items():
        if name != BASELINE:
            variants[metric_key(name, list(variants))] = {
                "difference": v.comparison.difference if v.comparison else None, "verdict": v.verdict}
    return {"decision": decision, "variants": variants}


CURVE_METRICS = tuple(m for m in SIGNALS if m not in ("clip_fraction_lower", "clip_fraction_upper",
                                                      "rollout_success_rate"))
"""The signals a column of curves.csv each: the columns dvc.yaml's `plots:` draw and the rounds' tracked
curves hold. The clip fraction's two sides are drawn by the plots, and the rollout success rate, a
guardrail near 1, is in the report's guardrail table per seed."""


def curves(study_dir: Path, aggregate: StudyAggregate) -> List[Dict]:
    """Mean over seeds per (variant, step) for the curve metrics: rows for `dvc plots`, which draws
    one line per study and variant (dvc.yaml's `plots:` and their template, .dvc/plots/variants.json)."""
    from rlhf.metrics import read_metrics

    rows = []
    for name, v in aggregate.variants.items():
        per_step: Dict[int, Dict[str, List[float]]] = {}
        for run in v.runs:
            for record in read_metrics(study_dir / run.run_dir / "metrics.jsonl"):
                for metric in CURVE_METRICS:
                    value = record.get(metric)
                    if isinstance(value, (int, float)):
                        per_step.setdefault(record["step"], {}).setdefault(metric, []).append(value)
        for step in sorted(per_step):
            row = {"study": aggregate.study, "variant": name, "step": step}
            for metric in CURVE_METRICS:
                values = per_step[step].get(metric)
                row[metric.replace("/", "_")] = sum(values) / len(values) if values else ""
            rows.append(row)
    return rows


def exported_report(aggregate: StudyAggregate, where: str) -> str:
    """The study's report.md (`report.render`) for reports/<study>/, where DVC versions it with the
    round's outputs: its plots' links hold there (the export copies the plots beside it), its
    checkpoint paths become paths from the repository root (under `where`, the study's results
    dir), and a note under the title says where everything else it names lies."""
    from experiments.report import MACHINE_PROVENANCE, REPORT, render

    def moved(score):
        return score and dataclasses.replace(score, path=f"{where}/{score.path}")

    record = aggregate.best_checkpoints
    if record is not None:
        aggregate = aggregate.replace(best_checkpoints=dataclasses.replace(
            record, runs=tuple(moved(c) for c in record.runs), best=moved(record.best)))
    title, _, rest = render(aggregate).partition("\n")
    note = (f"*The report of {where} ({REPORT} there), exported with the round's metrics by `python -m experiments "
            f"export`: the plots are beside it (plots/), the per-seed values also in {SEEDS}; the run dirs and "
            f"checkpoints it names are under {where}/ (`dvc pull`), its machine records ({MACHINE_PROVENANCE}) "
            f"there on the machine that ran the round (DVC does not version them).*")
    return f"{title}\n\n{note}\n{rest}"


SEEDS = "seeds.csv"
"""The per-seed values of an exported study, for machines (reports/<study>/seeds.csv)."""


def seeds_table(aggregate: StudyAggregate, where: str) -> str:
    """seeds.csv: one row per run, the baseline first, with its status, decision metric, steps,
    each guardrail's final-window value (a column per metric, empty when the run has none) and its
    run dir under `where`: a verdict can be checked from the seeds without the results."""
    guardrails = list(dict.fromkeys(m for v in aggregate.variants.values() for r in v.runs for m in r.guardrails))
    blank = lambda x: "" if x is None else x  # noqa: E731
    rows = [{"variant": name, "seed": r.seed, "status": r.status.value, "value": blank(r.value),
             "steps": blank(r.steps), **{m: blank(r.guardrails.get(m)) for m in guardrails},
             "run_dir": f"{where}/{r.run_dir}"}
            for name, v in aggregate.variants.items() for r in v.runs]
    return _csv(rows, ["variant", "seed", "status", "value", "steps", *guardrails, "run_dir"])


def _csv(rows: List[Dict], fieldnames: List[str]) -> str:
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=fieldnames)
    writer.writeheader()
    writer.writerows(rows)
    return table.getvalue()


def cmd_export(args) -> int:
    """What DVC versions of a finished round, in reports/<study>/: metrics.json (`dvc metrics`),
    curves.csv and plots/ (`dvc plots`), report.md and seeds.csv (the verdicts with the per-seed
    values they rest on). Every file is a function of the results alone, the same bytes on every
    machine: paths are relative, nothing records a time or a host."""
    from experiments.report import REPORT
    from experiments.study import load_study

    study = load_study(args.study, args.binding)
    study_dir = Path(args.results) / study.name
    where = portable(study_dir)
    out = output_dir(Path(args.out) / study.name)
    aggregate = _load(study_dir)
    metrics = headline(aggregate)
    write_text(out / "metrics.json", json.dumps(finite(metrics), indent=1, sort_keys=True, allow_nan=False))
    write_text(out / "curves.csv", _csv(curves(study_dir, aggregate),
                                        ["study", "variant", "step", *[m.replace("/", "_") for m in CURVE_METRICS]]))
    write_text(out / SEEDS, seeds_table(aggregate, where))
    write_text(out / REPORT, exported_report(aggregate, where))
    import shutil
    plots = out / "plots"
    shutil.rmtree(plots, ignore_errors=True)
    plots.mkdir()
    for png in sorted((study_dir / "plots").glob("*.png")):
        shutil.copy2(png, plots / png.name)
    print(f"wrote {out / 'metrics.json'}, {out / 'curves.csv'}, {out / SEEDS}, {out / REPORT} and {plots}")
    return 0


def _load(study_dir: Path) -> StudyAggregate:
    return read_aggregate(study_dir, f"{aggregate_path(study_dir)} not found: run `python -m experiments run` on "
                                     f"the study first")


def cmd_summary(args) -> int:
    """The final report over all rounds: the path from the baseline to the chosen setting, each
    step with its evidence, ending with the held-out evaluation of the last round's choice.
    `--heldout` reads the `heldout` stage's record and passes it on to `render_summary`: the test
    split's scores, which no decision read (experiments/heldout.py `heldout_lines`).
    `--confirmation` reads a confirmation run's record (experiments/summary.py `Confirmation`),
    which decides the summary's first line."""
    from experiments.heldout import read_heldout, read_rounds
    from experiments.summary import read_confirmation, render_summary

    out = output_file(args.out)
    rounds = [(study, agg) for study, _, agg in read_rounds(args)]
    heldout = None
    if getattr(args, "heldout", None):  # the test split's record
        heldout = read_heldout(args.heldout, [study.name for study, _ in rounds])
    confirmation = read_confirmation(args.confirmation) if getattr(args, "confirmation", None) else None
    write_text(out, render_summary(rounds, Path(args.results), heldout, confirmation))
    print(f"wrote {out}")
    return 0


def add_recipe_arguments(parser: argparse.ArgumentParser, needs_data: bool = False) -> None:
    parser.add_argument("--recipe", default="recipes/tiny.gin", help="the engine recipe (default: %(default)s)")
    parser.add_argument("-b", "--binding", action="append", default=[], help="a gin binding (repeatable)")
    parser.add_argument("--out", required=True, help="the output directory")
    if needs_data:
        parser.add_argument("--data", required=True, help="the `data` stage's output directory")


def add_studies_arguments(parser: argparse.ArgumentParser, out: str, many: bool = True,
                          results: bool = True, heldout: bool = False) -> None:
    if many:
        parser.add_argument("studies", nargs="+", help="study recipes, in round order")
    else:
        parser.add_argument("study", help="a study recipe")
    parser.add_argument("-b", "--binding", action="append", default=[], help="a gin binding (repeatable)")
    if results:
        parser.add_argument("--results", default="results", help="results root (default: %(default)s)")
    parser.add_argument("--out", default=out, help="output (default: %(default)s)")
    if heldout:
        parser.add_argument("--heldout", default=None,
                            help="the `heldout` stage's record (reports/heldout.json): the test split's section")
        parser.add_argument("--confirmation", default=None,
                            help="a confirmation run's record (JSON: the tuned recipe against the baseline recipe on "
                                 "fresh seeds; fields in experiments/summary.py `Confirmation`): it decides the first "
                                 "line")
