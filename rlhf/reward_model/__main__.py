"""Train a reward model on preference pairs.

    python -m rlhf.reward_model RECIPE.gin [-b 'BINDING']... --out DIR [--resume]

Exit codes: 0 done, 2 bad configuration or data (one line, before any compute), 4 disk full (one
line; nothing half-written is left, --resume continues from the last checkpoint), 1 any other error.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlhf.errors import EXIT_CONFIG, EXIT_DISK_FULL, EXIT_OK, ConfigError, check_writable


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.reward_model",
                                description=(__doc__ or "\n").split("\n")[1])
    p.add_argument("recipe", help="a gin recipe with rm.* bindings, e.g. recipes/rm/tiny_reward_model.gin")
    p.add_argument("-b", "--binding", action="append", default=[], help="a gin binding, e.g. 'rm.seed = 1'")
    p.add_argument("--out", required=True, help="the output dir: the trained checkpoint, metrics, checkpoints/")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    args = p.parse_args(argv)

    from rlhf import numerics  # before torch loads: the same weights on every x86-64 CPU (rlhf/numerics.py)
    try:
        numerics.apply()
    except numerics.NumericsError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    from pathlib import Path

    from rlhf import checkpoint
    from rlhf.reward_model.bradley_terry import RewardModelTrainer
    from rlhf.reward_model.config import resolve

    out = Path(args.out)
    try:
        cfg, operative = resolve(args.recipe, args.binding)
        check_writable(out)  # an existing file, an unwritable dir: one line before anything loads
        saved = out / "config.gin"
        if args.resume and saved.is_file() and saved.read_text() != operative:
            raise ConfigError(f"--resume: the configuration differs from the one {args.out} was started with "
                              f"(see {saved}); resume with the same recipe and bindings")
        if cfg.device != "cuda":
            numerics.set_threads(cfg.torch_threads)
        trainer = RewardModelTrainer(cfg, out, log=lambda m: print(m, file=sys.stderr))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        saved.write_text(operative)
        summary = trainer.run(resume=args.resume)
    except Exception as err:  # a full disk: one line (checkpoint.disk_full_message), not a traceback
        message = checkpoint.disk_full_message(err, out)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_DISK_FULL
    print(json.dumps({"initial": summary["initial"], "final": summary["final"]}), file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
