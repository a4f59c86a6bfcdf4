"""Write a run's policy as an ordinary HF checkpoint, to serve or evaluate it anywhere.

    python -m rlhf.export RUN/checkpoints/step_N --out DIR [--base MODEL_DIR] [--dtype bfloat16]

The checkpoint is verified first, as `ppo.init_from` verifies one (rlhf/checkpoint.py
`check_start_checkpoint`): the files of its `actor/` against the manifest's sizes and sha256, or,
without a manifest, by reading their safetensors headers. A damaged file is one line naming it.

A full fine-tuning checkpoint's `actor/` already is one and is copied (its weights converted to
`--dtype` when stored in another). A LoRA checkpoint's `actor/` holds peft's adapter: it is loaded
onto its base (`adapter_config.json`'s `base_model_name_or_path`, or `--base`, which must have the
shapes the adapter was trained on) with `PeftModel.from_pretrained`, merged with `merge_and_unload`
in float32, and saved with the tokenizer, so `AutoModelForCausalLM.from_pretrained(DIR)` (or vLLM)
loads it with no peft at all. Both ways the written weights are `--dtype` (rounded once, from the
checkpoint's or the float32 merge's values) and config.json's `dtype` says so.
The output is written to a temporary folder and renamed into place: a kill leaves no half-written DIR,
and an existing non-empty DIR is never overwritten.

Exit codes: 0 done, 2 bad input (one line naming it), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from rlhf.errors import EXIT_CONFIG, EXIT_OK

DTYPES = ("float32", "bfloat16")
EXPORT_FIX = "export an intact checkpoint (another step_N of the run)"
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_LORA_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def export_policy(ckpt: str | Path, out: str | Path, base: str | Path | None = None, dtype: str = "float32") -> Path:
    """Writes the (merged) policy of checkpoint `ckpt` (a `step_N` dir or its `actor/`) to `out`, a new
    or empty directory, through a temporary folder of this process renamed into place. Every input is
    checked (a ConfigError naming it) before any weights load, but for the LoRA base's shapes, checked
    against the adapter's once the base has loaded, before the merge."""
    from rlhf.errors import ConfigError

    ckpt = Path(ckpt)
    actor = ckpt / "actor" if (ckpt / "actor").is_dir() else ckpt
    out = Path(out)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is invalid: use 'float32' or 'bfloat16'")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory: nothing is "
                          f"overwritten; give a new directory")
    _verify(ckpt, actor)
    plan = _check_inputs(actor, ckpt, base)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))  # one per process
    except OSError as err:
        raise ConfigError(f"--out {str(out)!r} is not writable ({err.strerror or type(err).__name__})") from None
    try:
        _write(actor, tmp, plan, dtype)
        if out.is_dir():
            out.rmdir()  # empty (checked above); a second process that finished first makes this fail
        os.replace(tmp, out)
    except OSError as err:
        raise ConfigError(f"--out {str(out)!r}: could not be written ({err.strerror or type(err).__name__}); "
                          f"another export to it may have finished first") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _verify(ckpt: Path, actor: Path) -> None:
    """The checkpoint's manifest (or, without one, its safetensors headers), for the files of `actor/`:
    the policy is all an export reads. `ckpt` may be the `actor/` dir itself; its manifest is the step's."""
    from rlhf.checkpoint import MANIFEST, check_start_checkpoint
    if actor != ckpt:
        check_start_checkpoint(ckpt, "checkpoint", only=actor.name, fix=EXPORT_FIX)
    elif (actor.parent / MANIFEST).is_file():
        check_start_checkpoint(actor.parent, "checkpoint", only=actor.name, fix=EXPORT_FIX)
    else:  # an actor/ dir on its own: its safetensors headers
        check_start_checkpoint(actor, "checkpoint", fix=EXPORT_FIX)


def _check_inputs(actor: Path, ckpt: Path, base) -> dict:
    """What `_write` does, once every input it reads is known good: the kind of checkpoint, its
    tokenizer, and for LoRA the adapter's files and base (shapes are checked once the base loads)."""
    from transformers import AutoTokenizer

    from rlhf.checkpoint import damaged_weights
    from rlhf.errors import ConfigError
    from rlhf.models import ADAPTER_CONFIG, ADAPTER_WEIGHTS, TOKENIZER_FILES, check_policy_dir

    lora = (actor / ADAPTER_CONFIG).is_file()
    if not lora and not (actor / "config.json").is_file():
        raise ConfigError(f"{ckpt} is not a checkpoint: no actor/config.json (full fine-tuning) or "
                          f"actor/{ADAPTER_CONFIG} (LoRA); give a run's checkpoints/step_N")
    if not any((actor / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{actor} has no tokenizer files (none of {', '.join(TOKENIZER_FILES[:4])}, ...): the "
                          f"exported model needs the tokenizer the run trained with; save it into {actor} "
                          f"(tokenizer.save_pretrained) and export again")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(actor), local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{actor}: cannot load its tokenizer ({first}); the exported model needs the tokenizer "
                          f"the run trained with") from None
    if not lora:
        if not list(actor.glob("*.safetensors")):
            raise ConfigError(f"{actor} has no weights: no model.safetensors (full fine-tuning) or "
                              f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (LoRA); give a run's checkpoints/step_N")
        return {"lora": False, "tokenizer": tokenizer}
    if not (actor / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"{actor} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}: the adapter's weights are "
                          f"missing; give a run's checkpoints/step_N")
    try:
        adapter_config = json.loads((actor / ADAPTER_CONFIG).read_text())
        recorded = str(adapter_config.get("base_model_name_or_path") or "")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{actor / ADAPTER_CONFIG} is not a JSON object ({type(err).__name__}): the adapter "
                          f"cannot be read; give a run's checkpoints/step_N") from None
    if base is not None:
        base_dir, where = Path(base), f"--base {str(base)!r}"
        if not (base_dir / "config.json").is_file():
            raise ConfigError(f"--base {str(base)!r} is not a local model directory (no config.json there): give "
                              f"the directory of the model the adapter was trained on (its {ADAPTER_CONFIG} "
                              f"records {recorded!r})")
    else:
        base_dir = Path(recorded)
        where = f"the adapter's base {recorded!r} (base_model_name_or_path in {actor / ADAPTER_CONFIG})"
        if not recorded or not (base_dir / "config.json").is_file():
            raise ConfigError(f"the adapter in {actor} was trained on {recorded!r}, which is not a local model "
                              f"directory here; give its base with --base MODEL_DIR")
    check_policy_dir(base_dir, "--base" if base is not None else "the adapter's base")
    reason = damaged_weights(base_dir)
    if reason is not None:
        raise ConfigError(f"{where}: {reason}; give an intact copy of the model the adapter was trained on")
    return {"lora": True, "tokenizer": tokenizer, "base_dir": base_dir, "where": where, "recorded": recorded,
            "fan_in_fan_out": bool(adapter_config.get("fan_in_fan_out"))}


def stored_dtypes(model_dir: Path) -> set:
    """The dtypes ('float32', 'bfloat16', ...) of the floating-point tensors of a model directory's
    safetensors files (headers only)."""
    from safetensors import safe_open
    found = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                if name is not None:
                    found.add(name)
    return found


def _check_adapter_fits(actor: Path, model, plan: dict) -> None:
    """A ConfigError unless every LoRA matrix of the adapter in `actor` fits a linear layer of the
    loaded base `model` (its lora_A takes the layer's inputs, its lora_B gives its outputs). peft
    would raise a size mismatch, or silently skip an adapter whose layer is not there."""
    from safetensors import safe_open

    from rlhf.errors import ConfigError
    from rlhf.models import ADAPTER_WEIGHTS
    trained: dict = {}
    with safe_open(str(actor / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():
            m = _LORA_KEY.match(key)
            if m:
                trained.setdefault(m.group(1), {})[m.group(2)] = list(f.get_slice(key).get_shape())
    modules = dict(model.named_modules())
    where = plan["where"]
    fix = (f"give the model the adapter was trained on (its {actor.name}/adapter_config.json records "
           f"{plan['recorded']!r})")
    for name, ab in sorted(trained.items()):
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if module is None or weight is None:
            raise ConfigError(f"{where} does not match the adapter in {actor}: the adapter adapts {name}, which that "
                              f"model does not have; {fix}")
        if weight.dim() != 2 or any(len(s) != 2 for s in ab.values()):
            continue
        out_f, in_f = (weight.shape[1], weight.shape[0]) if plan["fan_in_fan_out"] else tuple(weight.shape)
        want_out = ab["B"][0] if "B" in ab else out_f
        want_in = ab["A"][1] if "A" in ab else in_f
        if (out_f, in_f) != (want_out, want_in):
            raise ConfigError(f"{where} does not match the adapter in {actor}: {name} is {out_f}x{in_f} "
                              f"(outputs x inputs) there, the adapter was trained on {want_out}x{want_in}; {fix}")


def _write(actor: Path, tmp: Path, plan: dict, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.checkpoint import damaged_weights
    from rlhf.errors import ConfigError
    from rlhf.models import load_policy

    tmp.rmdir()  # copytree and save_pretrained make it
    if not plan["lora"]:
        if stored_dtypes(actor) <= {dtype}:
            shutil.copytree(actor, tmp)  # already in --dtype: the checkpoint's own bytes
        else:  # the other files as they are; the weights (and config.json's dtype) converted
            shutil.copytree(actor, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
            model = AutoModelForCausalLM.from_pretrained(str(actor), dtype=getattr(torch, dtype),
                                                         local_files_only=True, use_safetensors=True)
            model.save_pretrained(str(tmp), safe_serialization=True)
    else:
        from peft import PeftModel
        # The merge in float32 (a bfloat16 base loads exactly), rounded to --dtype once at the end.
        base_model = load_policy(plan["base_dir"], torch.float32)
        _check_adapter_fits(actor, base_model, plan)
        try:
            model = PeftModel.from_pretrained(base_model, str(actor))
        except (RuntimeError, ValueError) as err:  # what the shape check above does not foresee
            raise ConfigError(f"{plan['where']}: the adapter in {actor} does not load "
                              f"onto it ({str(err).strip().splitlines()[-1][:300]}); give the model the adapter "
                              f"was trained on") from None
        merged = model.merge_and_unload().to(getattr(torch, dtype))
        merged.save_pretrained(str(tmp), safe_serialization=True)
        plan["tokenizer"].save_pretrained(str(tmp))
    reason = damaged_weights(tmp)
    if reason is not None:
        raise RuntimeError(f"the exported model does not read back: {reason}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.export",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("checkpoint", help="a run's checkpoints/step_N (or its actor/ dir)")
    p.add_argument("--out", required=True, help="where to write the HF checkpoint")
    p.add_argument("--base", default=None, help="the LoRA base model dir (default: the one the adapter names)")
    p.add_argument("--dtype", default="float32", help="the written weights' dtype: 'float32' (default) or 'bfloat16'")
    args = p.parse_args(argv)
    from rlhf.errors import ConfigError
    try:
        import transformers
        transformers.utils.logging.disable_progress_bar()  # stderr: the result, or one line of error
        out = export_policy(args.checkpoint, args.out, args.base, args.dtype)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
