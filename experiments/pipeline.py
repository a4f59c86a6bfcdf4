"""The steps of the DVC pipeline (`dvc.yaml`) that are not a study run.

    python -m experiments.pipeline data   --recipe R --out data/arithmetic
    python -m experiments.pipeline sft    --recipe R --data data/arithmetic --out models/sft
    python -m experiments.pipeline params STUDY.gin... --out params
    python -m experiments.pipeline export STUDY.gin --results results --out reports

DVC cannot read gin, so `params` resolves each study recipe into a YAML file that DVC reads as
params (the recipe stays the one source of truth); `export` turns a finished study into what
`dvc metrics` and `dvc plots` show: headline statistics and per-step curves.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Dict, List

import yaml


def _nested(flat: Dict[str, object]) -> Dict:
    """{'ppo.kl_coef': 0.1} -> {'ppo': {'kl_coef': 0.1}}."""
    out: Dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


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
    from rlhf import configurable
    from rlhf.data import read_records, records_to_examples
    from rlhf.tiny import build_char_tokenizer, build_tiny_model, train_sft

    cfg, _ = configurable.resolve(args.recipe, args.binding)
    out = Path(args.out)
    train = records_to_examples(read_records(Path(args.data) / "train.jsonl"), "prompt", "answer", args.data)
    tokenizer = build_char_tokenizer(out / "tokenizer")
    model = build_tiny_model(cfg.tiny_model, tokenizer, seed=cfg.sft.seed)
    losses = train_sft(model, tokenizer, train, cfg.sft, log=print)
    model.save_pretrained(str(out / "model"), safe_serialization=True)
    (out / "sft.json").write_text(json.dumps({"final_loss": sum(losses[-20:]) / 20, "steps": cfg.sft.steps},
                                             indent=1))
    return 0


# ----------------------------------------------------------------------------- params
def study_params(path: str, bindings: List[str]) -> Dict:
    """A study's resolved settings as nested YAML-able dicts: the baseline's operative config,
    each variant's change, seeds and the decision metric."""
    from experiments.plan import config_changes, resolve_config
    from experiments.study import load_study
    from rlhf.config import flat_dict

    study = load_study(path, bindings)
    base_cfg, _ = resolve_config(study.baseline_recipe, study.baseline_bindings, "study.baseline_bindings")
    base = flat_dict(base_cfg)
    flat = {k: v for k, v in base.items() if k != "ppo.seed"}
    variants = {}
    for variant in study.variants:
        cfg, _ = resolve_config(study.baseline_recipe, [*study.baseline_bindings, *variant.bindings],
                          f"study.variants[{variant.name!r}]")
        variants[variant.name] = config_changes(base, flat_dict(cfg))
    return {"study": {"name": study.name, "seeds": list(study.seeds), "metric": study.metric,
                      "direction": study.direction, "resume_from": _relative_to_cwd(study.resume_from)},
            "baseline": _nested(flat), "variants": {k: _nested(v) for k, v in variants.items()}}


def _relative_to_cwd(path: str):
    """Params must not depend on where the repository is checked out."""
    if not path:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def cmd_params(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for path in args.studies:
        params = study_params(path, args.binding)
        target = out / f"{params['study']['name']}.yaml"
        target.write_text(yaml.safe_dump(params, sort_keys=True))
        print(f"wrote {target}")
    return 0


# ----------------------------------------------------------------------------- export
def headline(aggregate: Dict) -> Dict:
    """dvc metrics: per variant n/mean/std/CI and, against the baseline, difference, p, verdict."""
    out: Dict = {"chosen": aggregate["decision"]["chosen"], "metric": aggregate["metric"]}
    for name, v in aggregate["variants"].items():
        s = v["summary"]
        row = {"n": s.get("n"), "mean": s.get("mean"), "std": s.get("std"), "ci95_low": (s.get("ci95") or [None])[0],
               "ci95_high": (s.get("ci95") or [None, None])[1]}
        cmp = v.get("comparison") or {}
        if cmp:
            row.update(difference=cmp.get("difference"), p_value_holm=cmp.get("p_value_holm"),
                       prob_improvement=cmp.get("prob_improvement"))
        if v.get("verdict"):
            row["verdict"] = v["verdict"]
        out[name] = row
    return out


CURVE_METRICS = ("reward_mean", "kl_divergence", "clip_fraction", "response_length_mean", "eval/accuracy")


def curves(study_dir: Path, aggregate: Dict) -> List[Dict]:
    """Mean over seeds per (variant, step) for the curve metrics: rows for `dvc plots`."""
    from rlhf.metrics import read_metrics

    rows = []
    for name, v in aggregate["variants"].items():
        per_step: Dict[int, Dict[str, List[float]]] = {}
        for run in v["runs"]:
            for record in read_metrics(study_dir / run["run_dir"] / "metrics.jsonl"):
                for metric in CURVE_METRICS:
                    value = record.get(metric)
                    if isinstance(value, (int, float)):
                        per_step.setdefault(record["step"], {}).setdefault(metric, []).append(value)
        for step in sorted(per_step):
            row = {"variant": name, "step": step}
            for metric in CURVE_METRICS:
                values = per_step[step].get(metric)
                row[metric.replace("/", "_")] = sum(values) / len(values) if values else ""
            rows.append(row)
    return rows


def cmd_export(args) -> int:
    from experiments.study import load_study

    study = load_study(args.study, args.binding)
    study_dir = Path(args.results) / study.name
    aggregate = json.loads((study_dir / "aggregate.json").read_text())
    out = Path(args.out) / study.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(headline(aggregate), indent=1, sort_keys=True))
    rows = curves(study_dir, aggregate)
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["variant", "step", *[m.replace("/", "_") for m in CURVE_METRICS]])
        writer.writeheader()
        writer.writerows(rows)
    import shutil
    plots = out / "plots"
    shutil.rmtree(plots, ignore_errors=True)
    plots.mkdir()
    for png in sorted((study_dir / "plots").glob("*.png")):
        shutil.copy2(png, plots / png.name)
    print(f"wrote {out / 'metrics.json'}, {out / 'curves.csv'} and {plots}")
    return 0


def cmd_summary(args) -> int:
    """The final report over all rounds: the path from the baseline to the chosen setting, each
    step with its evidence, ending with the held-out evaluation of the last round's choice."""
    from experiments.advisor.evidence import advice_lines, heldout_start
    from experiments.study import load_study

    lines = ["# Tuning path", ""]
    setting: Dict[str, object] = {}
    last, start = None, None
    for path in args.studies:
        study = load_study(path, args.binding)
        aggregate = json.loads((Path(args.results) / study.name / "aggregate.json").read_text())
        decision = aggregate["decision"]
        chosen = decision["chosen"]
        v = aggregate["variants"][chosen]
        s = v["summary"]
        lines += [f"## {study.name}: {aggregate.get('description', '')}", ""]
        if study.resume_from and (Path(study.resume_from) / "aggregate.json").is_file():
            lines += advice_lines(Path(study.resume_from), aggregate)
        if start is None:
            start = heldout_start(aggregate, Path(args.results) / study.name, aggregate["metric"])
        lines += [f"Decision: **{chosen}**: {decision['reason']}.", "",
                  "| variant | change | n | mean | std | diff vs baseline | Holm p | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, var in aggregate["variants"].items():
            cmp = var.get("comparison") or {}
            fmt = lambda x: "" if x is None else f"{x:.4g}"  # noqa: E731
            lines.append(f"| {name} | {'; '.join(var['bindings']) or '-'} | {var['summary'].get('n')} | "
                         f"{fmt(var['summary'].get('mean'))} | {fmt(var['summary'].get('std'))} | "
                         f"{fmt(cmp.get('difference'))} | {fmt(cmp.get('p_value_holm'))} | {var.get('verdict') or ''} |")
        if decision.get("guardrail_violations"):
            lines.append(f"\nGuardrail violations: {decision['guardrail_violations']}")
        for binding in v["bindings"]:
            key, _, value = binding.partition("=")
            setting[key.strip()] = value.strip()
        lines += ["", f"Setting after {study.name}: " + (", ".join(f"`{k} = {v}`" for k, v in setting.items())
                                                        or "the baseline's"), ""]
        last = (study.name, chosen, s, aggregate["metric"])
    if last:
        name, chosen, s, metric = last
        lines += ["## Held-out evaluation", "",
                  f"Final choice `{chosen}` of {name}: {metric} = {s.get('mean', float('nan')):.4f} "
                  f"+- {s.get('std') or 0:.4f} (n = {s.get('n')}, 95% CI {s.get('ci95')}).", ""]
        if start is not None:
            lines += [f"At the start of the first round (the warm start): {metric} = {start:.4f}.", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.pipeline", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("data", "sft"):
        s = sub.add_parser(name)
        s.add_argument("--recipe", default="recipes/tiny.gin")
        s.add_argument("-b", "--binding", action="append", default=[])
        s.add_argument("--out", required=True)
        if name == "sft":
            s.add_argument("--data", required=True)
    s = sub.add_parser("params")
    s.add_argument("studies", nargs="+")
    s.add_argument("-b", "--binding", action="append", default=[])
    s.add_argument("--out", default="params")
    s = sub.add_parser("export")
    s.add_argument("study")
    s.add_argument("-b", "--binding", action="append", default=[])
    s.add_argument("--results", default="results")
    s.add_argument("--out", default="reports")
    s = sub.add_parser("summary")
    s.add_argument("studies", nargs="+")
    s.add_argument("-b", "--binding", action="append", default=[])
    s.add_argument("--results", default="results")
    s.add_argument("--out", default="reports/summary.md")
    args = p.parse_args(argv)
    from rlhf.config import ConfigError
    from experiments.study import StudyError
    try:
        return {"data": cmd_data, "sft": cmd_sft, "params": cmd_params, "export": cmd_export,
                "summary": cmd_summary}[args.command](args)
    except (ConfigError, StudyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
