"""Write a run's policy as an ordinary HF checkpoint, to serve or evaluate it anywhere.

    python -m rlhf.export RUN/checkpoints/step_N --out DIR [--base MODEL_DIR] [--dtype bfloat16]

A full fine-tuning checkpoint's `actor/` already is one and is copied. A LoRA checkpoint's `actor/`
holds peft's adapter: it is loaded onto its base (`adapter_config.json`'s `base_model_name_or_path`,
or `--base`) with `PeftModel.from_pretrained`, merged with `merge_and_unload`, and saved with the
tokenizer, so `AutoModelForCausalLM.from_pretrained(DIR)` (or vLLM) loads it with no peft at all.
The output is written to a temporary folder and renamed into place: a kill leaves no half-written DIR.

Exit codes: 0 done, 2 bad input (one line naming it), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from rlhf.train import EXIT_CONFIG, EXIT_OK  # the engine's exit codes


def export_policy(ckpt: str | Path, out: str | Path, base: str | Path | None = None, dtype: str = "float32") -> Path:
    """Writes the (merged) policy of checkpoint `ckpt` (a `step_N` dir or its `actor/`) to `out`."""
    import torch
    from transformers import AutoTokenizer

    from rlhf.config import ConfigError
    from rlhf.models import ADAPTER_CONFIG, load_policy

    ckpt = Path(ckpt)
    actor = ckpt / "actor" if (ckpt / "actor").is_dir() else ckpt
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    if (actor / "config.json").is_file() and not (actor / ADAPTER_CONFIG).is_file():
        shutil.copytree(actor, tmp)
    elif (actor / ADAPTER_CONFIG).is_file():
        from peft import PeftModel
        recorded = json.loads((actor / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
        base_dir = Path(base or recorded)
        if not (base_dir / "config.json").is_file():
            raise ConfigError(f"the adapter in {actor} was trained on {recorded!r}, which is not a local model "
                              f"directory here; give its base with --base MODEL_DIR")
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--dtype {dtype!r} is invalid: use 'float32' or 'bfloat16'")
        model = PeftModel.from_pretrained(load_policy(base_dir, getattr(torch, dtype)), str(actor))
        merged = model.merge_and_unload()
        merged.save_pretrained(str(tmp), safe_serialization=True)
        AutoTokenizer.from_pretrained(str(actor), local_files_only=True).save_pretrained(str(tmp))
    else:
        raise ConfigError(f"{ckpt} is not a checkpoint: no actor/config.json (full fine-tuning) or "
                          f"actor/{ADAPTER_CONFIG} (LoRA); give a run's checkpoints/step_N")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


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
