"""`python -m experiments SUBCOMMAND ...`: the manager's one command line.

Study subcommands (`plan`, `run`, `status`, `report`, `advise`) take `STUDY.gin [-b BINDING]...
[--overrides FILE:KEY] [--results DIR]` (--overrides: bindings kept in a YAML file, such as the
DVC pipeline's per-round overrides in params.yaml); the DVC pipeline's other stages (`data`,
`sft`, `params`, `export`, `summary`, see `experiments/stages.py`; `testsplit` and `heldout`, see
`experiments/heldout.py`) take their own arguments. Subcommands are registered in `SUBCOMMANDS` (name -> help, handler,
extra arguments), so a new step of the loop adds one entry and one module. Exit codes: 0
success, 1 some runs failed (or nothing could be decided), 2 invalid study, binding or input
(one line, no traceback), 130 interrupted; a full disk stops the manager with one line naming
the file it could not write (`errors.disk_full_line`) and exit code 4, as the engine's (its files are written
atomically, so a rerun picks up where it stopped).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Union

from rich.console import Console

from experiments.errors import (
    EXIT_CONFIG,
    EXIT_DISK_FULL,
    EXIT_INTERRUPTED,
    INTERRUPTED,
    RUN_REMEDY,
    STAGE_REMEDY,
    StudyError,
    disk_full_line,
)
from rlhf.errors import ConfigError, honour_interrupts

Hook = Union[str, Callable]
"""A function, or 'module:function' imported when its subcommand is used: `data` and `sft` must not
pay for (or need) Ray, W&B and scipy, which only the study subcommands use."""


WRITE_RESULTS = ("run", "report", "advise")
"""The study subcommands that write into the results dir (pushed back to a storage location)."""


def _resolve(hook: Hook) -> Callable:
    if not isinstance(hook, str):
        return hook
    module, _, name = hook.partition(":")
    return getattr(importlib.import_module(module), name)


class Subcommand(NamedTuple):
    help: str
    handler: Hook
    """(args, console) -> exit code."""
    add_arguments: Optional[Hook] = None
    study: bool = True
    """Takes the study arguments (STUDY.gin, -b, --results); False: only its own."""
    stage: bool = False
    """A pipeline stage: its handler takes only the arguments."""


def _add_rerun_failed(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rerun-failed", action="store_true",
                        help="also rerun runs that diverged or had a configuration error (same hash)")


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    _resolve("experiments.commands:add_run_arguments")(parser)
    _add_rerun_failed(parser)


def _recipe_arguments(needs_data: bool) -> Callable[[argparse.ArgumentParser], None]:
    return lambda p: _resolve("experiments.stages:add_recipe_arguments")(p, needs_data=needs_data)


def _studies_arguments(default_out: str, overrides: bool = False, **kw) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        _resolve("experiments.stages:add_studies_arguments")(parser, default_out, **kw)
        if overrides:
            add_overrides_argument(parser)
    return add


SUBCOMMANDS: Dict[str, Subcommand] = {
    "plan": Subcommand("print the runs a study expands to, with their hashes; runs nothing",
                       "experiments.commands:cmd_plan", _add_rerun_failed),
    "run": Subcommand("run what the plan needs on Ray (skip finished, resume interrupted), then report",
                      "experiments.commands:cmd_run", _run_arguments),
    "status": Subcommand("show each run's state on disk", "experiments.commands:cmd_status"),
    "report": Subcommand("write aggregate.json, report.md and plots from the run dirs of the last launch (--wandb: "
                         "the W&B Report); runs that STUDY with these -b bindings would now rerun (stale in `status`) "
                         "are reported as they ran, with a notice saying how many",
                         "experiments.commands:cmd_report", "experiments.commands:add_report_arguments"),
    "advise": Subcommand("apply the tuning guide's rules to a finished study (RESULTS/STUDY) and write the "
                         "next study recipe", "experiments.advisor.command:cmd_advise",
                         "experiments.advisor.command:add_arguments"),
    "data": Subcommand("pipeline stage: write a recipe's task as train/eval JSONL", "experiments.stages:cmd_data",
                       _recipe_arguments(False), study=False, stage=True),
    "sft": Subcommand("pipeline stage: the SFT warm start of the tiny default on the data stage's output",
                      "experiments.stages:cmd_sft", _recipe_arguments(True), study=False, stage=True),
    "params": Subcommand("pipeline stage: each study's resolved parameters as YAML for `dvc params` (a file "
                         "edited by hand since it was generated is refused, not overwritten)",
                         "experiments.stages:cmd_params", _studies_arguments("params", results=False, overrides=True),
                         study=False, stage=True),
    "export": Subcommand("pipeline stage: a finished study's headline metrics and curves for `dvc metrics/plots`, "
                         "its report and per-seed values",
                         "experiments.stages:cmd_export", _studies_arguments("reports", many=False),
                         study=False, stage=True),
    "summary": Subcommand("pipeline stage: the tuning path over all rounds (markdown)",
                          "experiments.stages:cmd_summary",
                          _studies_arguments("reports/summary.md", heldout=True), study=False, stage=True),
    "testsplit": Subcommand("pipeline stage: the task's held-out rows no run evaluates, as a test split (JSONL)",
                            "experiments.heldout:cmd_testsplit", "experiments.heldout:add_testsplit_arguments",
                            study=False, stage=True),
    "confirm": Subcommand("pipeline stage: the tuned recipe against the original baseline on fresh seeds, judged "
                          "on the test split (JSON)", "experiments.confirm:cmd_confirm",
                          "experiments.confirm:add_confirm_arguments", study=False, stage=True),
    "heldout": Subcommand("pipeline stage: the warm start, the last round's choice and the best gold checkpoint "
                          "scored on the test split (JSON)", "experiments.heldout:cmd_heldout",
                          "experiments.heldout:add_heldout_arguments", study=False, stage=True),
}


OVERRIDES_HELP = ("FILE:KEY, e.g. params.yaml:round1: the bindings under KEY of a YAML file, as {scope: {parameter: "
                  "value}} (`dvc exp run -S '++round1.ppo.kl_coef=0.1'` writes them there), applied like -b bindings "
                  "before those given with -b")


def add_overrides_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overrides", default=None, metavar="FILE:KEY", help=OVERRIDES_HELP)


def _apply_overrides(args: argparse.Namespace, command: Subcommand) -> None:
    """`--overrides FILE:KEY`: its bindings join the -b bindings (before them, so -b wins), checked
    against each study first (one line naming FILE:KEY)."""
    spec = getattr(args, "overrides", None)
    if not spec:
        return
    from experiments.overrides import check_overrides, read_overrides
    bindings = read_overrides(spec)
    for path in [args.study] if command.study else args.studies:
        check_overrides(path, bindings, spec)
    if command.study:
        args.bindings = [*bindings, *args.bindings]
    else:
        args.binding = [*bindings, *args.binding]


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, the arguments of that subcommand alone (the others are
    listed by name and help, without importing their modules)."""
    parser = argparse.ArgumentParser(prog="python -m experiments",
                                     description="Studies of one-parameter PPO variants x seeds, with a verdict.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if only is not None and name != only:
            continue
        if command.study:
            p.add_argument("study", help="a study recipe, e.g. recipes/studies/smoke.gin")
            p.add_argument("-b", "--binding", dest="bindings", action="append", default=[],
                           help="a gin binding: study.* changes the study, anything else every run's baseline "
                                "config (repeatable)")
            p.add_argument("--results", default="results",
                           help="results root: a path, or a URI pyarrow.fs reaches (s3://, gs://, file://; "
                                "docs/scaling.md); the study lives in RESULTS/<name>/")
            add_overrides_argument(p)
        if command.add_arguments:
            _resolve(command.add_arguments)(p)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    honour_interrupts()  # a study started in a script's background still stops its runs on Ctrl-C / SIGTERM
    args = build_parser(argv[0] if argv and argv[0] in SUBCOMMANDS else None).parse_args(argv)
    args.argv = argv
    args.rerun_failed = getattr(args, "rerun_failed", False)
    console = Console(soft_wrap=True, markup=False, highlight=False)
    if not console.is_terminal:
        console = Console(soft_wrap=True, markup=False, highlight=False, width=200)
    command = SUBCOMMANDS[args.command]
    try:
        _apply_overrides(args, command)
        handler = _resolve(command.handler)
        if not command.study:
            return handler(args) if command.stage else handler(args, console)
        from experiments.storage import results_location  # --results as a URI: a local copy, synced
        with results_location(args.results, write=args.command in WRITE_RESULTS) as args.results:
            return handler(args, console)
    except (ConfigError, StudyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # Ctrl-C outside a launch's own handling (planning, joining a Ray cluster)
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:  # a full disk: one line naming the file (or dir) that could not be written
        where = getattr(args, "results", None) or getattr(args, "out", None)
        line = disk_full_line(err, str(Path(where).resolve()) if isinstance(where, str) else None,
                              STAGE_REMEDY if command.stage else RUN_REMEDY)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return EXIT_DISK_FULL
