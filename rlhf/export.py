"""Write a run's policy as an ordinary HF checkpoint, to serve or evaluate it anywhere.

    python -m rlhf.export RUN/checkpoints/step_N --out DIR [--base MODEL_DIR] [--dtype bfloat16]

A full fine-tuning checkpoint's `actor/` already is one and is copied. A LoRA checkpoint's `actor/`
holds peft's adapter: it is loaded onto its base (`adapter_config.json`'s `base_model_name_or_path`,
or `--base`) with `PeftModel.from_pretrained`, merged with `merge_and_unload`, and saved with the
tokenizer, so `AutoModelForCausalLM.from_pretrained(DIR)` (or vLLM) loads it with no peft at all.
The output is written to a temporary folder and renamed into place: a kill leaves no half-written DIR,
and an existing non-empty DIR is never overwritten.

Exit codes: 0 done, 2 bad input (one line naming it), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rlhf.train import EXIT_CONFIG, EXIT_OK  # the engine's exit codes


def export_policy(ckpt: str | Path, out: str | Path, base: str | Path | None = None, dtype: str = "float32") -> Path:
    """Writes the (merged) policy of checkpoint `ckpt` (a `step_N` dir or its `actor/`) to `out`, a new
    or empty directory, through a temporary folder of this process renamed into place."""
    from rlhf.config import ConfigError

    ckpt = Path(ckpt)
    actor = ckpt / "actor" if (ckpt / "actor").is_dir() else ckpt
    out = Path(out)
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype {dtype!r} is invalid: use 'float32' or 'bfloat16'")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory: nothing is "
                          f"overwritten; give a new directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))  # one per process
    except OSError as err:
        raise ConfigError(f"--out {str(out)!r} is not writable ({err.strerror or type(err).__name__})") from None
    try:
        _write(actor, ckpt, tmp, base, dtype)
        if out.is_dir():
            out.rmdir()  # empty (checked above); a second process that finished first makes this fail
        os.replace(tmp, out)
    except OSError as err:
        raise ConfigError(f"--out {str(out)!r}: could not be written ({err.strerror or type(err).__name__}); "
                          f"another export to it may have finished first") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(actor: Path, ckpt: Path, tmp: Path, base, dtype: str) -> None:
    import torch
    from transformers import AutoTokenizer

    from rlhf.config import ConfigError
    from rlhf.models import ADAPTER_CONFIG, load_policy

    tmp.rmdir()  # copytree and save_pretrained make it
    if (actor / "config.json").is_file() and not (actor / ADAPTER_CONFIG).is_file():
        shutil.copytree(actor, tmp)
    elif (actor / ADAPTER_CONFIG).is_file():
        from peft import PeftModel
        recorded = json.loads((actor / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
        base_dir = Path(base or recorded)
        if not (base_dir / "config.json").is_file():
            raise ConfigError(f"the adapter in {actor} was trained on {recorded!r}, which is not a local model "
                              f"directory here; give its base with --base MODEL_DIR")
        model = PeftModel.from_pretrained(load_policy(base_dir, getattr(torch, dtype)), str(actor))
        merged = model.merge_and_unload()
        merged.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(actor), local_files_only=True).save_pretrained(str(tmp))
    else:
        raise ConfigError(f"{ckpt} is not a checkpoint: no actor/config.json (full fine-tuning) or "
                          f"actor/{ADAPTER_CONFIG} (LoRA); give a run's checkpoints/step_N")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a run's checkpoints/step_N (or its actor/ dir)")
    p.add_argument("--out", required=True, help="where to write the HF checkpoint")
    p.add_argument("--base", default=None, help="the LoRA base model dir (default: the one the adapter names)")
    p.add_argument("--dtype", default="float32", help="'float32' (default) or 'bfloat16'")
    args = p.parse_args(argv)
    from rlhf.config import ConfigError
    try:
        out = export_policy(args.checkpoint, args.out, args.base, args.dtype)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
