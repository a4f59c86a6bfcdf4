"""One PPO run from a gin recipe.

    python -m rlhf.train RECIPE.gin [-b 'BINDING']... --out DIR [--resume] [--ray-address ADDR]

Exit codes: 0 done, 2 bad configuration (one line, before any compute), 3 training diverged,
4 disk full (one line; nothing half-written is left, --resume continues from the last checkpoint),
1 any other error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_DIVERGED, EXIT_DISK_FULL = 0, 1, 2, 3, 4


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rlhf.train", description=__doc__.split("\n")[1])
    p.add_argument("recipe", help="a gin recipe, e.g. recipes/tiny.gin")
    p.add_argument("-b", "--binding", action="append", default=[], help="a gin binding, e.g. 'ppo.kl_coef = 0.05'")
    p.add_argument("--out", required=True, help="the run directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--quiet", action="store_true", help="no live progress line")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: RAY_ADDRESS, else a local instance) when "
                        "ppo.world_size > 1 or ppo.placement is 'colocated' or 'split'")
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # The CPU numerics profile must be in the environment before torch loads (rlhf/numerics.py).
    from rlhf import numerics
    try:
        numerics.apply()
    except numerics.NumericsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    # Heavy imports after argument parsing so `--help` is instant.
    from rlhf import checkpoint, configurable, provenance
    from rlhf.config import ConfigError
    from rlhf.metrics import ConsoleProgress, JsonlSink, MetricLogger

    out = Path(args.out)
    try:
        cfg, operative = configurable.resolve(args.recipe, args.binding)
        check_writable(out)
        resume_from = None
        if args.resume:
            resume_from = resume_checkpoint(out / "checkpoints")
            if resume_from is None:
                print(f"--resume: no checkpoint under {out / 'checkpoints'}; starting from scratch", file=sys.stderr)
            else:
                saved = (out / "config.gin").read_text() if (out / "config.gin").exists() else None
                if saved is not None and without_placement(saved) != without_placement(operative):
                    raise ConfigError(f"--resume: the configuration differs from the one {out} was started with "
                                      f"(see {out / 'config.gin'}); resume with the same recipe and bindings")
        from rlhf.trainer import PPOTrainer, TrainingDiverged
        if not runs_on_gpu(cfg):  # CPU numerics: a pinned thread count unless ppo.torch_threads says one
            numerics.set_threads(cfg.ppo.torch_threads)
        out.mkdir(parents=True, exist_ok=True)
        trainer = PPOTrainer(cfg, out, log=lambda m: print(m, file=sys.stderr), ray_address=args.ray_address)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG

    (out / "config.gin").write_text(operative)
    prov = provenance.collect(argv, cfg.ppo.seed, trainer.data_hash, trainer.start_checkpoint, operative,
                              reward_model=cfg.reward.model_path if cfg.reward.uses_model else "")
    prov["placement"] = trainer.placement
    prov_path = out / "provenance.json"
    if prov_path.exists():  # keep fields others (the experiment manager) added
        prov = {**json.loads(prov_path.read_text()), **prov}
    prov_path.write_text(json.dumps(prov, indent=1))

    sinks = [JsonlSink(out / "metrics.jsonl", truncate_after_step=trainer_step_of(resume_from))]
    if not args.quiet:
        sinks.append(ConsoleProgress(cfg.ppo.total_steps, start_step=trainer_step_of(resume_from) or 0))
    logger = MetricLogger(sinks)
    try:
        summary = trainer.run(logger, resume_from=resume_from)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        (out / "summary.json").write_text(json.dumps({"status": "diverged", "error": str(err)}, indent=1))
        return EXIT_DIVERGED
    except Exception as err:  # a full disk: one line (checkpoint.disk_full_message), not a traceback
        message = checkpoint.disk_full_message(err, out)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_DISK_FULL
    finally:
        logger.close()
        trainer.close()
    print(json.dumps({"initial": summary["initial"], "final": summary["final"]}), file=sys.stderr)
    return EXIT_OK


def check_writable(out: Path) -> None:
    """The run dir exists (or is made) and takes files: a ConfigError naming it otherwise, before any compute."""
    from rlhf.config import ConfigError
    probe = out / f".write_probe_{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--out {str(out)!r} is not a writable run dir ({err.strerror or type(err).__name__}"
                          f"{': ' + str(err.filename) if err.filename and str(err.filename) != str(probe) else ''}); "
                          f"choose a directory you can write") from None


def resume_checkpoint(ckpt_root: Path):
    """The newest intact checkpoint; damaged newer ones are reported and moved aside so that no
    later retry resumes into them (`rlhf.checkpoint.resume_checkpoint`)."""
    from rlhf import checkpoint
    return checkpoint.resume_checkpoint(ckpt_root, log=lambda m: print(m, file=sys.stderr))


def runs_on_gpu(cfg) -> bool:
    """True when this process computes on a GPU (a local run on CUDA)."""
    if cfg.ppo.resolved_placement != "local" or cfg.ppo.device == "cpu":
        return False
    import torch
    return torch.cuda.is_available()


def without_placement(config_text: str) -> str:
    """The operative config without the bindings that say where a run executes: a checkpoint
    resumes at any world size and placement."""
    from rlhf.config import PLACEMENT_BINDINGS
    return "\n".join(line for line in config_text.splitlines()
                     if not line.strip().startswith(PLACEMENT_BINDINGS))


def trainer_step_of(ckpt) -> int | None:
    if ckpt is None:
        return None
    from rlhf.checkpoint import load_state
    return load_state(ckpt)["step"]


if __name__ == "__main__":
    sys.exit(main())
