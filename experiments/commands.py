"""The subcommands `plan`, `run`, `status` and `report`: each loads the study, then one step.

Every command first loads and plans the study (pure, fast), so a bad binding fails with one
line before anything starts. Exit codes: 0 success, 1 some runs failed, 2 invalid study or
binding, 130 interrupted.
"""

from __future__ import annotations

import shlex
from argparse import ArgumentParser, Namespace
from typing import Optional

from rich.console import Console
from rich.table import Table

from experiments.driver import decision_line, run_study
from experiments.errors import EXIT_OK, EXIT_RUNS_FAILED, StudyError
from experiments.launch import decide, is_locked
from experiments.plan import expand, study_dir
from experiments.results import BASELINE, RunStatus
from experiments.run_records import last_attempt, scalar, state, tail_metrics
from experiments.seed_plan import plan_lines, seed_plan, with_planned_waves
from experiments.study import load_study
from rlhf.errors import ConfigError
from rlhf.start_checks import check_machine


def _planned(args: Namespace):
    """(study, run specs, seed plan): seed waves left without 'max_seeds' take the plan's last wave."""
    study = load_study(args.study, args.bindings)
    specs = expand(study, args.results)
    plan = seed_plan(study, args.results)
    return with_planned_waves(study, plan), specs, plan


def preflight(study, specs, args: Namespace) -> None:
    """What `run` would refuse, refused by `plan` as well and by the same checks: the Ray address's form
    (--ray-address, else RAY_ADDRESS), the W&B project, and, when the runs compute on this machine (no
    cluster address), what each variant's recipe needs of it (a GPU, vLLM). One line each."""
    from experiments.plan import resolve_config
    from experiments.wandb_sink import project_for, wandb_mode
    from rlhf.placement.cluster import given_address  # imports torch: only for the commands that check
    address = given_address(getattr(args, "ray_address", None))
    if wandb_mode() != "disabled":
        project_for(study)
    if address is not None:  # a cluster's nodes are other machines: the engine checks there when a run starts
        return
    base = next(s for s in specs if s.variant == BASELINE)
    ppo = resolve_config(base.recipe, base.bindings, "the baseline")[0].ppo
    for spec in {s.variant: s for s in specs}.values():  # a variant differs from the baseline by its changes
        where = "the baseline" if spec.variant == BASELINE else f"study.variants[{spec.variant!r}]"
        device, backend, own, runner = (spec.changes.get(f"ppo.{k}", getattr(ppo, k))
                                        for k in ("device", "rollout_backend", "vllm_own_process", "vllm_model_runner"))
        try:
            check_machine(device=device, rollout_backend=backend, vllm_own_process=own, vllm_model_runner=runner)
        except ConfigError as err:
            raise StudyError(f"{where}: {err}{CPU_STUDY if study.gpus_per_run > 0 else ''}") from None


CPU_STUDY = ", study.gpus_per_run = 0 (README, quick start 3)"
"""The study's own binding a CPU run needs beside the engine's, said after them."""


PLAN_TABLE_RUNS = 1000
"""Above this many runs `plan` prints one row per variant (its seeds and what a `run` would do with
them) rather than one per run: rendering a table of thousands of rows takes longer than planning them."""


def _change(spec) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in spec.changes.items()) or "–"


def _seed_range(seeds) -> str:
    """'0..9999' for consecutive seeds, else the first two and the last ('0, 5, ..., 9999')."""
    seeds = sorted(seeds)
    if len(seeds) > 1 and seeds[-1] - seeds[0] == len(seeds) - 1:
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds)) if len(seeds) <= 4 else f"{seeds[0]}, {seeds[1]}, ..., {seeds[-1]}"


def cmd_plan(args: Namespace, console: Console) -> int:
    """Prints the run table (variant, seed, change, hashes, what a `run` would do) without running;
    above PLAN_TABLE_RUNS runs, one row per variant, with a notice saying so."""
    study, specs, plan = _planned(args)
    preflight(study, specs, args)
    table = Table(title=f"study {study.name}: {len(study.all_variants)} variants x {len(study.seeds)} seeds "
                        f"= {len(specs)} runs ({study.cpus_per_run} CPU, {study.gpus_per_run:g} GPU each)")
    if len(specs) > PLAN_TABLE_RUNS:
        for col in ("variant", "seeds", "change", "steps", "code", "data", "starts", "on run"):
            table.add_column(col, overflow="fold")
        for variant in study.all_variants:
            runs = [s for s in specs if s.variant == variant.name]
            actions = {}
            for s in runs:
                action = decide(s, args.rerun_failed)
                actions[action] = actions.get(action, 0) + 1
            starts = {s.init_from_hash for s in runs if s.init_from_hash}
            table.add_row(variant.name, f"{_seed_range(s.seed for s in runs)} ({len(runs)})", _change(runs[0]),
                          str(runs[0].total_steps), runs[0].code_version["engine_sha256"][:12],
                          runs[0].data_hash[:12], str(len(starts)) if starts else "–",
                          ", ".join(f"{n} {a}" for a, n in sorted(actions.items())))
    else:
        for col in ("variant", "seed", "change", "steps", "run hash", "config", "code", "data", "start", "on run"):
            table.add_column(col, overflow="fold")
        for s in specs:
            table.add_row(s.variant, str(s.seed), _change(s), str(s.total_steps), s.run_hash[:12], s.config_hash[:12],
                          s.code_version["engine_sha256"][:12], s.data_hash[:12],
                          (s.init_from_hash or "")[:12] or "–", decide(s, args.rerun_failed))
    console.print(table)
    if len(specs) > PLAN_TABLE_RUNS:
        console.print(f"notice: {len(specs)} runs, more than {PLAN_TABLE_RUNS}: one row per variant; each run's "
                      f"hashes are in plan.json once `run` launches them", highlight=False)
    console.print(f"metric: {study.metric_from} {study.metric} ({study.direction} is better); "
                  f"guardrails: {', '.join(g.describe() for g in study.guardrails) or 'none'}; "
                  f"results: {study_dir(study, args.results)}", highlight=False)
    for line in plan_lines(study, plan, specs):
        console.print(line, highlight=False)
    return EXIT_OK


def cmd_run(args: Namespace, console: Console) -> int:
    """Runs what the plan needs on Ray, then writes the report (experiments/driver.py)."""
    study, specs, plan = _planned(args)
    preflight(study, specs, args)
    for line in plan_lines(study, plan, specs):
        console.print(line, highlight=False)
    return run_study(study, specs, args, console, plan)


def cmd_status(args: Namespace, console: Console) -> int:
    """Each run's state on disk: completed, failed, interrupted, pending or stale (hash changed)."""
    study, specs, _ = _planned(args)
    busy = is_locked(study_dir(study, args.results))
    table = Table(title=f"study {study.name}" + (" (a manager is running it)" if busy else ""))
    for col in ("run", "state", "step", "reward_mean", "error"):
        table.add_column(col, overflow="fold")
    counts = {}
    for s in specs:
        st = state(s)
        attempt = last_attempt(s.run_dir)
        if busy and attempt.get("start") and attempt.get("end") is None:
            st = RunStatus.RUNNING
        counts[st] = counts.get(st, 0) + 1
        row = tail_metrics(s.run_dir)
        reward = scalar(row.get("reward_mean"))
        # A row's step is the updates done (step 0: the initial evaluation, before any).
        step = f"{int(row['step']) if 'step' in row else 0}/{s.total_steps}"
        table.add_row(s.key, st, step, f"{reward:.3f}" if reward is not None else "-",
                      (attempt.get("error") or "") if st == RunStatus.FAILED else "")
    console.print(table)
    console.print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())), highlight=False)
    return EXIT_OK if counts.get(RunStatus.COMPLETED, 0) == len(specs) else EXIT_RUNS_FAILED


def stale_runs(specs) -> list:
    """The runs of `specs` whose run dir holds a run of another hash (config, code, data or start
    changed): `status`'s 'stale' (run_records.state), which `run` would move aside and run again."""
    return [s for s in specs if state(s) == RunStatus.STALE]


def _rerun_command(args: Namespace) -> str:
    """The `run` command line with this command's study, bindings and results dir."""
    argv = ["python", "-m", "experiments", "run", args.study, *[x for b in args.bindings for x in ("-b", b)]]
    return shlex.join(argv + (["--results", args.results] if args.results != "results" else []))


def stale_notice(study, args: Namespace) -> Optional[str]:
    """A notice when runs on disk ran another configuration than the study file and `-b` bindings
    give now (stale, as `status` says): `report` reports them as launched, and says so."""
    specs = expand(study, args.results)
    stale = stale_runs(specs)
    if not stale:
        return None
    given = f"{args.study}{' with these -b bindings' if args.bindings else ''}"
    return (f"notice: {len(stale)} of {len(specs)} runs on disk ran with another configuration than {given} gives "
            f"now (stale in `status`: config, code, data or start changed); this report is of the runs as last "
            f"launched; `{_rerun_command(args)}` would rerun them")


def cmd_report(args: Namespace, console: Console) -> int:
    """Rewrites aggregate.json, report.md and plots from the run dirs of the last launch; with
    --wandb also the study's W&B Report (created when W&B is online, else its definition saved
    for --publish). Runs the study file and -b bindings would now run differently (stale in
    `status`) are reported as they ran, with a one-line notice saying how many and how to rerun them."""
    from experiments.report import REPORT, write_report
    study = load_study(args.study, args.bindings)
    if getattr(args, "publish", False):
        return publish_wandb_report(study, args, console)
    notice = stale_notice(study, args)
    agg = write_report(study, study_dir(study, args.results))
    if notice:
        console.print(notice, highlight=False)
    for name, v in agg.variants.items():
        mean = f"{v.summary.mean:.4g}" if v.summary.mean is not None else "–"
        console.print(f"  {name}: n={v.summary.n} mean={mean} -> {v.verdict}"
                      f"{' (underpowered)' if v.underpowered else ''}"
                      f"{'' if v.guardrails_ok else ' [guardrail violated]'}", highlight=False)
    console.print(f"{decision_line(agg)}; report: {study_dir(study, args.results) / REPORT}", highlight=False)
    if getattr(args, "wandb", False):
        from experiments.wandb_report import DEFINITION, build_report, save_definition
        from experiments.wandb_sink import logged_in, project_for, wandb_mode
        path = save_definition(build_report(agg, study_dir(study, args.results), project_for(study),
                                            resume_from=study.resume_from), study_dir(study, args.results) / DEFINITION)
        if wandb_mode() == "online" and logged_in():
            status = publish_wandb_report(study, args, console)
            if status != EXIT_OK:
                return status
        else:
            console.print(f"W&B is offline: saved the W&B Report's definition to {path}; create it once logged in "
                          f"with: python -m experiments report {args.study} --wandb --publish", highlight=False,
                          soft_wrap=True)
    return EXIT_OK if agg.decision.chosen is not None else EXIT_RUNS_FAILED


def publish_wandb_report(study, args: Namespace, console: Console) -> int:
    """Creates the study's W&B Report from its saved definition (`report --wandb` wrote it)."""
    import os

    from experiments.wandb_report import DEFINITION, default_entity, load_definition
    from experiments.wandb_sink import logged_in
    path = study_dir(study, args.results) / DEFINITION
    if not path.is_file():
        raise StudyError(f"{path} not found: run `python -m experiments report {args.study} --wandb` first")
    if not logged_in():
        raise StudyError("W&B: not logged in (no WANDB_API_KEY, no `wandb login`): log in, then --publish again")
    try:
        entity = getattr(args, "entity", None) or os.environ.get("WANDB_ENTITY") or default_entity()
        report = load_definition(path, entity=entity).save()
    except Exception as err:  # noqa: BLE001 - the server's answer, in one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        console.print(f"error: W&B Report not created ({first}); its definition stays in {path}", highlight=False)
        return EXIT_RUNS_FAILED
    console.print(f"W&B Report: {report.url}", highlight=False)
    return EXIT_OK


def add_report_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--wandb", action="store_true",
                        help="also the study's W&B Report: created when W&B is online, else its definition saved to "
                             "RESULTS/<study>/wandb_report.json")
    parser.add_argument("--publish", action="store_true",
                        help="create the W&B Report from the saved definition (needs a W&B login)")
    parser.add_argument("--entity", default=None, help="the W&B entity of the report (default: WANDB_ENTITY, "
                                                       "else your default entity)")


def add_run_arguments(parser: ArgumentParser) -> None:
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster: HOST:PORT as `ray start --head` printed it, from one of the "
                             "cluster's nodes (default: RAY_ADDRESS, else start a private local instance)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray instance (default: all)")
    parser.add_argument("--num-gpus", type=float, default=None, help="GPUs of a local Ray instance (default: all)")
    parser.add_argument("--cache-dir", default=None,
                        help="RLHF_CACHE shared by the runs (default: $RLHF_CACHE, else the repo's .cache/rlhf)")
