"""One PPO run from a gin recipe.

    python -m rlhf.train RECIPE.gin [-b 'BINDING']... --out DIR [--resume | --overwrite] [--ray-address ADDR]
                         [--profile STEP]

One process writes a run dir at a time (a lock, `rlhf/run_dir.py`). A run dir that holds an earlier
run is refused unless --resume continues it or --overwrite replaces it; rerunning a completed run
with the same configuration does nothing. `--profile STEP` runs that iteration under torch.profiler
(one process, `ppo.placement = 'local'`) and writes its trace and where its time went, by phase, into
DIR/profile/ (rlhf/profiling.py); the step's record says `perf/profiled`.

Exit codes: 0 done, 2 bad configuration or run dir (one line, before any compute; a Ray address
where no cluster this process can join answers is one too), 3 training diverged, 4 disk full (one
line; nothing half-written is left, --resume continues from the last checkpoint), 5 out of GPU memory
(one line: the phase, what torch held, the memory plan's figure and the binding to change; the
checkpoints stay, --resume continues), 130 interrupted (Ctrl-C: one line), 1 any other error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List

from rlhf.config import without_placement
from rlhf.errors import (
    EXIT_CONFIG,
    EXIT_DISK_FULL,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    ConfigError,
    check_writable,
    honour_interrupts,
)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rlhf.train",
                                description=(__doc__ or "\n").split("\n")[1])
    p.add_argument("recipe", help="a gin recipe, e.g. recipes/tiny.gin")
    p.add_argument("-b", "--binding", action="append", default=[], help="a gin binding, e.g. 'ppo.kl_coef = 0.05'")
    p.add_argument("--out", required=True, help="the run directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run --out holds (its config.gin, metrics.jsonl, summary.json and checkpoints)")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster, HOST:PORT as `ray start --head` printed it (default: RAY_ADDRESS, "
                        "else a local instance) when ppo.world_size > 1 or ppo.placement is 'colocated' or 'split'")
    p.add_argument("--profile", type=int, default=0, metavar="STEP",
                   help="profile iteration STEP (torch.profiler, host and GPU): its trace and a summary by phase "
                        "into DIR/profile/; one-process runs (ppo.placement = 'local')")
    return p.parse_args(argv)


def check_profile(step: int, cfg) -> None:
    """`--profile STEP`: an iteration of this run, in this process."""
    if not step:
        return
    if not 1 <= step <= cfg.ppo.total_steps:
        raise ConfigError(f"--profile {step} is invalid: must be an iteration of this run, 1 to ppo.total_steps = "
                          f"{cfg.ppo.total_steps}")
    if cfg.ppo.resolved_placement != "local":
        raise ConfigError(f"--profile {step} profiles this process, but the roles run in Ray actors (ppo.placement "
                          f"resolves to {cfg.ppo.resolved_placement!r}); add -b \"ppo.placement = 'local'\" (one "
                          f"process, ppo.world_size = 1)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    honour_interrupts()
    args = parse_args(argv)
    # The CPU numerics profile must be in the environment before torch loads (rlhf/numerics.py).
    from rlhf import numerics
    try:
        numerics.apply()
    except numerics.NumericsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    # The CUDA allocator's settings, too, before CUDA starts (rlhf/allocator.py).
    from rlhf import allocator
    allocator.configure()
    # Heavy imports after argument parsing so `--help` is instant.
    from rlhf import configurable, run_dir

    out = Path(args.out)
    try:
        if args.resume and args.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other: --resume continues the run in --out, "
                              "--overwrite replaces it")
        from rlhf.placement.cluster import check_address, given_address
        given_address(args.ray_address)  # the address's form, whatever the placement: Ray's error is a traceback
        cfg, operative = configurable.resolve(args.recipe, args.binding)
        check_profile(args.profile, cfg)
        if cfg.ppo.resolved_placement != "local":  # a dead cluster fails now, not after minutes of retries
            check_address(args.ray_address)
        else:  # this process computes: what the recipe needs of this machine, before any model loads
            from rlhf.start_checks import check_machine
            check_machine(cfg.ppo.device, cfg.ppo.rollout_backend, cfg.ppo.vllm_own_process,
                          cfg.ppo.vllm_model_runner)
        check_writable(out)
        with run_dir.DirLock(out / run_dir.RUN_LOCK):
            return train(args, argv, cfg, operative, out)
    except run_dir.LockBusy as err:
        holder = f"pid {err.pid}" if err.pid is not None else "a process that has not said its pid yet"
        print(f"error: --out {str(out)!r} is in use by another rlhf.train ({holder}, lock {err.path}); "
              f"wait for it to finish or choose another --out", file=sys.stderr)
        return EXIT_CONFIG
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:  # Ctrl-C, while joining Ray or training: what was written stays
        print(f"interrupted: --resume continues from the latest checkpoint in --out {str(out)!r}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except allocator.OutOfMemory as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_OUT_OF_MEMORY
    except Exception as err:  # a full disk, anywhere in the run: one line, not a traceback
        from rlhf import checkpoint
        if out_of_memory(err):  # outside a phase: building the roles, evaluating, saving
            print(f"error: out of GPU memory outside the training phases ({str(err).splitlines()[0]}); "
                  f"python -m rlhf.memory {args.recipe} shows the plan and the bindings that shrink it",
                  file=sys.stderr)
            return EXIT_OUT_OF_MEMORY
        message = checkpoint.disk_full_message(err, out)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_DISK_FULL


def train(args, argv, cfg, operative: str, out: Path) -> int:
    """The run, with `out` locked: what `out` already holds decides (resume, refuse, nothing to do,
    replace), then the trainer runs. A ConfigError before the first step is exit 2."""
    from rlhf import gpu_gate, numerics, provenance, run_dir
    from rlhf.atomic import write_text
    from rlhf.metrics import ConsoleProgress, MetricLogger, MetricSink, run_dir_sinks

    resume_from = None
    try:
        earlier = run_dir.earlier_run(out)
        if args.resume:
            resume_from = resume_checkpoint(out / "checkpoints")
            if resume_from is None:
                print(f"--resume: no checkpoint under {out / 'checkpoints'}; starting from scratch", file=sys.stderr)
            else:
                saved = (out / "config.gin").read_text() if (out / "config.gin").exists() else None
                if saved is not None and without_placement(saved) != without_placement(operative):
                    raise ConfigError(f"--resume: the configuration differs from the one {out} was started with "
                                      f"({config_difference(saved, operative)}; see {out / 'config.gin'}); "
                                      f"resume with the same recipe and bindings")
        elif earlier is not None and args.overwrite:
            inside = cfg.ppo.init_from and Path(cfg.ppo.init_from).resolve().is_relative_to(out.resolve())
            if inside:
                raise ConfigError(f"ppo.init_from = {cfg.ppo.init_from!r} is inside --out {str(out)!r}, which "
                                  f"--overwrite replaces; copy the checkpoint elsewhere first")
        elif earlier is not None:
            if refuse_or_done(out, earlier, operative):
                return EXIT_OK
        from rlhf.trainer import PPOTrainer, TrainingDiverged
        if not runs_on_gpu(cfg):  # CPU numerics: a pinned thread count unless ppo.torch_threads says one
            numerics.set_threads(cfg.ppo.torch_threads)
        trainer = PPOTrainer(cfg, out, log=lambda m: print(m, file=sys.stderr), ray_address=args.ray_address)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG

    if earlier is not None and args.overwrite:  # every check has passed: the earlier run goes now
        run_dir.remove_outputs(out)
        print(f"--overwrite: removed the earlier run's outputs from {out} ({earlier})", file=sys.stderr)
    write_text(out / "config.gin", operative)
    prov = provenance.collect(argv, cfg.ppo.seed, trainer.data_hash, trainer.start_checkpoint, operative,
                              reward_model=cfg.reward.model_path if cfg.reward.uses_model else "")
    prov["placement"] = trainer.placement
    prov_path = out / "provenance.json"
    if prov_path.exists():  # keep fields others (the experiment manager) added
        prov = {**json.loads(prov_path.read_text()), **prov}
    write_text(prov_path, json.dumps(prov, indent=1))

    sinks: List[MetricSink] = list(run_dir_sinks(out, truncate_after_step=trainer_step_of(resume_from)))
    if not args.quiet:
        sinks.append(ConsoleProgress(cfg.ppo.total_steps, start_step=trainer_step_of(resume_from) or 0))
    logger = MetricLogger(sinks)
    ended = False
    try:
        summary = trainer.run(logger, resume_from=resume_from, profile_step=args.profile)
        ended = True
    except TrainingDiverged as err:
        ended = True
        print(f"error: {err}", file=sys.stderr)
        write_text(out / "summary.json", json.dumps({"status": "diverged", "error": str(err)}, indent=1))
        return EXIT_DIVERGED
    finally:
        logger.close()
        if ended:  # results are written; the memory this engine frees must not land in another's start
            gpu_gate.wait_for_starter(out)
        trainer.close()
    print(json.dumps({"initial": summary["initial"], "final": summary["final"]}), file=sys.stderr)
    return EXIT_OK


def refuse_or_done(out: Path, earlier: str, operative: str) -> bool:
    """Without --resume or --overwrite, into a run dir that holds run `earlier`: True (after a
    notice) when it is this very run, completed; otherwise a ConfigError saying what to pass."""
    from rlhf import checkpoint, run_dir
    saved = (out / "config.gin").read_text() if (out / "config.gin").is_file() else None
    same = saved is not None and without_placement(saved) == without_placement(operative)
    if earlier == run_dir.COMPLETED and same:
        print(f"--out {str(out)!r} already holds this run, completed (see its summary.json): nothing to do; "
              f"--overwrite runs it again", file=sys.stderr)
        return True
    if earlier == run_dir.COMPLETED:
        raise ConfigError(f"--out {str(out)!r} holds a completed run of another configuration "
                          f"({config_difference(saved, operative)}); choose another --out, or pass --overwrite "
                          f"to replace it")
    if earlier == run_dir.DIVERGED:
        raise ConfigError(f"--out {str(out)!r} holds a run that diverged (see its summary.json); choose another "
                          f"--out, or pass --overwrite to replace it")
    steps = checkpoint.list_checkpoints(out / "checkpoints")
    what = f"checkpoints up to step_{steps[-1][0]}" if steps else "no checkpoint yet"
    if not same:
        what += f"; another configuration: {config_difference(saved, operative)}"
    raise ConfigError(f"--out {str(out)!r} holds an unfinished run ({what}); pass --resume to continue it, "
                      f"--overwrite to start over, or choose another --out")


def config_difference(saved: str | None, operative: str) -> str:
    """'ppo.kl_coef = 0.2 here, 0.05 before': the first binding of `operative` that `saved` (an
    earlier run's config.gin) binds otherwise, or where to look when none is one line."""
    if saved is None:
        return "its config.gin is missing"

    def bindings(text: str) -> dict:
        return dict(line.split(" = ", 1) for line in without_placement(text).splitlines()
                    if " = " in line and not line.startswith((" ", "#")))
    before, now = bindings(saved), bindings(operative)
    for key, value in now.items():
        if before.get(key) != value:
            return f"{key} = {value} here, {before[key] if key in before else 'unset'} before"
    for key in before:
        if key not in now:
            return f"{key} = {before[key]} before, unset here"
    return "see its config.gin"



def resume_checkpoint(ckpt_root: Path):
    """The newest intact checkpoint; damaged newer ones are reported and moved aside so that no
    later retry resumes into them (`rlhf.checkpoint.resume_checkpoint`)."""
    from rlhf import checkpoint
    return checkpoint.resume_checkpoint(ckpt_root, log=lambda m: print(m, file=sys.stderr))


def out_of_memory(err: BaseException) -> bool:
    """A CUDA out-of-memory error (torch's, or one a Ray rank raised)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(err, torch.OutOfMemoryError)


def runs_on_gpu(cfg) -> bool:
    """True when this process computes on a GPU (a local run on CUDA)."""
    if cfg.ppo.resolved_placement != "local" or cfg.ppo.device == "cpu":
        return False
    import torch
    return torch.cuda.is_available()



def trainer_step_of(ckpt) -> int | None:
    if ckpt is None:
        return None
    from rlhf.checkpoint import load_state
    return load_state(ckpt)["step"]


if __name__ == "__main__":
    sys.exit(main())
