"""`python -m experiments SUBCOMMAND ...`: the manager's one command line.

Study subcommands (`plan`, `run`, `status`, `report`, `advise`) take `STUDY.gin [-b BINDING]...
[--results DIR]`; the DVC pipeline's other stages (`data`, `sft`, `params`, `export`,
`summary`, see `experiments/stages.py`) take their own arguments. Subcommands are registered in
`SUBCOMMANDS` (name -> help, handler, extra arguments), so a new step of the loop adds one
entry and one module. Exit codes: 0 success, 1 some runs failed (or nothing could be decided),
2 invalid study, binding or input (one line, no traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, NamedTuple, Optional

from rich.console import Console

from experiments import commands, stages
from experiments.advisor import command as advisor_command
from experiments.study import StudyError
from rlhf.config import ConfigError


class Subcommand(NamedTuple):
    help: str
    handler: Callable[[argparse.Namespace, Console], int]
    add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
    study: bool = True
    """Takes the study arguments (STUDY.gin, -b, --results); False: only its own."""


def _stage(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace, Console], int]:
    return lambda args, console: handler(args)


def _add_rerun_failed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rerun-failed", action="store_true",
                        help="also rerun runs that diverged or had a configuration error (same hash)")


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    commands.add_run_arguments(parser)
    _add_rerun_failed(parser)


SUBCOMMANDS: Dict[str, Subcommand] = {
    "plan": Subcommand("print the runs a study expands to, with their hashes; runs nothing",
                       commands.cmd_plan, _add_rerun_failed),
    "run": Subcommand("run what the plan needs on Ray (skip finished, resume interrupted), then report",
                      commands.cmd_run, _run_arguments),
    "status": Subcommand("show each run's state on disk", commands.cmd_status),
    "report": Subcommand("write aggregate.json, report.md and plots from the run dirs (--wandb: the W&B Report)",
                         commands.cmd_report, commands.add_report_arguments),
    "advise": Subcommand("apply the tuning guide's rules to a finished study (RESULTS/STUDY) and write the "
                         "next study recipe", advisor_command.cmd_advise, advisor_command.add_arguments),
    "data": Subcommand("pipeline stage: write a recipe's task as train/eval JSONL", _stage(stages.cmd_data),
                       stages.add_recipe_arguments, study=False),
    "sft": Subcommand("pipeline stage: the SFT warm start of the tiny default on the data stage's output",
                      _stage(stages.cmd_sft), lambda p: stages.add_recipe_arguments(p, needs_data=True),
                      study=False),
    "params": Subcommand("pipeline stage: each study's resolved parameters as YAML for `dvc params`",
                         _stage(stages.cmd_params),
                         lambda p: stages.add_studies_arguments(p, "params", results=False), study=False),
    "export": Subcommand("pipeline stage: a finished study's headline metrics and curves for `dvc metrics/plots`",
                         _stage(stages.cmd_export), lambda p: stages.add_studies_arguments(p, "reports", many=False),
                         study=False),
    "summary": Subcommand("pipeline stage: the tuning path over all rounds (markdown)", _stage(stages.cmd_summary),
                          lambda p: stages.add_studies_arguments(p, "reports/summary.md"), study=False),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments",
                                     description="Studies of one-parameter PPO variants x seeds, with a verdict.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if command.study:
            p.add_argument("study", help="a study recipe, e.g. recipes/studies/smoke.gin")
            p.add_argument("-b", "--binding", dest="bindings", action="append", default=[],
                           help="a gin binding: study.* changes the study, anything else every run's baseline "
                                "config (repeatable)")
            p.add_argument("--results", default="results", help="results root; the study lives in RESULTS/<name>/")
        if command.add_arguments:
            command.add_arguments(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.rerun_failed = getattr(args, "rerun_failed", False)
    console = Console(soft_wrap=True, markup=False, highlight=False)
    if not console.is_terminal:
        console = Console(soft_wrap=True, markup=False, highlight=False, width=200)
    try:
        return SUBCOMMANDS[args.command].handler(args, console)
    except (StudyError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return commands.EXIT_CONFIG
