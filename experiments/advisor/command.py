"""`python -m experiments advise RESULTS/STUDY`: ranked suggestions, and the next study written.

Reads a finished study's results dir (or a study recipe, whose results dir is RESULTS/<name>),
applies the rules to its chosen variant's last steps, prints a table and writes the next study
recipe, ready for `python -m experiments plan|run`.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser, Namespace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from experiments.advisor.advise import advise, build_rules, parse_threshold
from experiments.advisor.recipe import next_study_text
from experiments.advisor.rules import GROUPS
from experiments.advisor.window import DEFAULT_WINDOW, AdviceError, load_window


def add_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="the next study recipe (default: ./<name>.gin)")
    parser.add_argument("--name", default=None,
                        help="the next study's name (default: --out's file name without .gin, else <study>_next)")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="last steps read per seed")
    parser.add_argument("--variant", default=None, help="advise on this variant (default: the chosen one)")
    parser.add_argument("--group", action="append", default=[], choices=GROUPS,
                        help="only rules of this group (repeatable): kl_and_clip = the guide's round 2, "
                             "throughput_and_quality = round 3, health = flags")
    parser.add_argument("--rule", action="append", default=[], help="only this rule (repeatable)")
    parser.add_argument("-t", "--threshold", action="append", default=[],
                        help="RULE.PARAMETER=NUMBER overrides a rule's threshold, e.g. kl_high.kl_max=0.2")
    parser.add_argument("--max-variants", type=int, default=None,
                        help="keep the top N variants (a bracket's values are one variant each)")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="the GPU's total memory, when the runs did not record it")
    parser.add_argument("--json", default=None, help="also write the advice as JSON here")


def study_results_dir(arg: str, results: str, bindings) -> Path:
    """A results dir as given, or RESULTS/<name> of a study recipe."""
    path = Path(arg)
    if path.suffix == ".gin" and path.is_file():
        from experiments.study import load_study
        return Path(results) / load_study(path, bindings).name
    if not path.is_dir():
        raise AdviceError(f"{arg!r} is neither a study results dir (RESULTS/<study>) nor a study recipe")
    return path


def cmd_advise(args: Namespace, console: Console) -> int:
    study_dir = study_results_dir(args.study, args.results, args.bindings)
    if args.max_variants is not None and args.max_variants < 0:
        raise AdviceError(f"--max-variants = {args.max_variants} is invalid: must be >= 0")
    overrides: dict = {}
    for text in args.threshold:
        rule, field, value = parse_threshold(text)
        overrides.setdefault(rule, {})[field] = value
    rules = build_rules(overrides, args.group or None, args.rule or None)
    window = load_window(study_dir, args.variant, args.window, args.device_memory_gb)
    advice = advise(window, rules)
    table = Table(title=f"advice on {study_dir.name}/{window.variant} (last {len(window.steps)} steps, "
                        f"{len(window.seeds)} seeds)")
    for col in ("rank", "rule", "change", "evidence", "why"):
        table.add_column(col, overflow="fold")
    for s in advice.warnings:
        table.add_row("flag", s.rule, s.change, _evidence(s.evidence), s.rationale)
    kept = advice.variants(args.max_variants)
    for i, s in enumerate(advice.changes, 1):
        written = sum(k is s for k, _, _ in kept)
        rank = str(i) if written == len(s.values) else f"{i} ({'left out' if not written else f'{written} kept'})"
        table.add_row(rank, s.rule, s.change, _evidence(s.evidence), s.rationale)
    for s in advice.superseded:
        table.add_row("superseded", s.rule, s.change, _evidence(s.evidence), s.rationale)
    for s, why in advice.settled:
        table.add_row("settled", s.rule, s.change, _evidence(s.evidence), f"not proposed again: {why}")
    console.print(table)
    console.print(f"silent: {', '.join(advice.silent) or 'none'}", highlight=False)
    # `--out my_round2.gin` names the study after its file, as the file names it everywhere else.
    name = args.name or (Path(args.out).name.removesuffix(".gin") if args.out else f"{study_dir.name}_next")
    out = Path(args.out or f"{name}.gin")
    command = "python -m experiments advise " + " ".join(args.argv[1:]) if getattr(args, "argv", None) else ""
    text = next_study_text(study_dir, advice, name=name, max_variants=args.max_variants, command=command)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(advice.to_json(), indent=1, default=str))
    console.print(f"wrote {out}: {len(kept)} variant(s); next: python -m experiments plan {out}", highlight=False)
    return 0


def _evidence(evidence: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in evidence.items()
                     if v is not None)
