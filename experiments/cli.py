"""`python -m experiments SUBCOMMAND STUDY.gin [-b BINDING]... [--results DIR]`.

Subcommands are registered in `SUBCOMMANDS` (name -> help, handler, extra arguments), so a new
step of the loop (for example one that proposes the next round) adds one entry and one module.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, NamedTuple, Optional

from rich.console import Console

from experiments import commands
from experiments.advisor import command as advisor_command
from experiments.study import StudyError


class Subcommand(NamedTuple):
    help: str
    handler: Callable[[argparse.Namespace, Console], int]
    add_arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None


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
    "report": Subcommand("write aggregate.json, report.md and plots from the run dirs",
                         commands.cmd_report),
    "advise": Subcommand("apply the tuning guide's rules to a finished study (RESULTS/STUDY) and write the "
                         "next study recipe", advisor_command.cmd_advise, advisor_command.add_arguments),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments",
                                     description="Studies of one-parameter PPO variants x seeds, with a verdict.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
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
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return commands.EXIT_CONFIG
