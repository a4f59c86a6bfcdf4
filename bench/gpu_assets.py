"""Shared inputs of the GPU benchmarks: a Qwen2.5-shaped model with random weights (0.5B, or 7B
with `shape='7b'`), a character tokenizer in its own folder, and prompts of an exact token length.

    python bench/gpu_assets.py --shape 0.5b|7b --out DIR [--device cuda] [--tiny]

No downloads: the model is built from a `Qwen2Config` with the published shape, the tokenizer
locally (`rlhf.tiny.build_char_tokenizer`, one token per character). The model's vocabulary
(151,936 or 152,064) is larger than the tokenizer's; sampled ids the tokenizer does not know
decode to nothing, which is all a speed benchmark needs (bench/peers/common.py adds a tokenizer
covering the whole vocabulary).

The 0.5B shape (and the tiny one) are built as always: `from_config` on the CPU in bf16 after
`torch.manual_seed(seed)`, one safetensors file. The 7B shape (7.6B parameters, 15.2 GB in bf16)
is never materialised on the CPU: the module tree is built on the meta device for the names and
shapes, each tensor is drawn directly on `device` (the GPU) in bf16 with transformers' init
(normal(0, initializer_range) for linear and embedding weights, the padding row of the
embedding zeroed, zero biases, unit RMSNorm weights) from a seeded generator, and written as
5 GB safetensors shards with an index, as `save_pretrained` would.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QWEN2_5_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
QWEN2_5_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                  max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
SHAPES = {"0.5b": QWEN2_5_0_5B, "7b": QWEN2_5_7B}
DIRECT_SHAPES = ("7b",)  # built tensor by tensor on the device (too slow on the CPU in fp32 modules)
SHARD_BYTES = 5 * 10**9
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048)
PROMPT_CHARS = "0123456789+-=*/ .,abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def model_config(tiny: bool = False, shape: str = "0.5b"):
    """The Qwen2 config of `shape` ('0.5b' or '7b'; `tiny` overrides it), pad/bos/eos ids 0/1/2."""
    from transformers import Qwen2Config
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
    return Qwen2Config(**(TINY_SHAPE if tiny else SHAPES[shape]), bos_token_id=1, eos_token_id=2, pad_token_id=0)


def parameter_count(config) -> int:
    """Parameters of the model (tied embeddings counted once), from the config alone: the memory
    plan's arithmetic (rlhf/memory/shapes.py), so there is one copy of it."""
    from rlhf.memory import parameter_count as from_shape
    return from_shape(config)


def build_assets(root: str | Path, tiny: bool = False, seed: int = 0, shape: str = "0.5b",
                 device: str | None = None) -> dict:
    """Writes `model/` (safetensors, bf16) and `tokenizer/` under root; returns their paths.

    An existing `model/` is reused if its config has the requested shape (else this fails: one
    directory holds one shape). `device` is where the 7B shape's tensors are drawn (default:
    cuda if available)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.tiny import build_char_tokenizer

    root = Path(root)
    model_dir, tok_dir = root / "model", root / "tokenizer"
    if (model_dir / "config.json").is_file():
        check_shape(model_dir, model_config(tiny, shape))
    elif shape in DIRECT_SHAPES and not tiny:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        write_random_model(model_config(tiny, shape), model_dir, seed=seed, device=device)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(tiny, shape), dtype=torch.bfloat16)
        model.save_pretrained(str(model_dir), safe_serialization=True)
        del model
    if not (tok_dir / "tokenizer.json").is_file():
        build_char_tokenizer(tok_dir)
    return {"model_dir": str(model_dir), "tokenizer_dir": str(tok_dir)}


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "tie_word_embeddings")


def check_shape(model_dir: Path, config) -> None:
    """Fails unless the config.json in model_dir has config's shape."""
    from transformers import AutoConfig
    saved = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    diff = {k: (getattr(saved, k, None), getattr(config, k)) for k in SHAPE_KEYS
            if getattr(saved, k, None) != getattr(config, k)}
    if diff:
        raise SystemExit(f"{model_dir} holds another shape than the one asked for (saved, asked): {diff}")


def _init_plan(model, std: float) -> list:
    """(name, shape, how) for every tensor of the state dict, in order: how is 'normal', 'zeros' or
    'ones', with the padding row of embeddings zeroed ('normal_pad:<idx>'), as transformers'
    `_init_weights` does for these module types."""
    import torch
    plan, seen = [], set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, torch.nn.Embedding):
                how = f"normal_pad:{module.padding_idx}" if module.padding_idx is not None else "normal"
            elif isinstance(module, torch.nn.Linear):
                how = "normal" if p_name == "weight" else "zeros"
            elif p_name == "weight" and param.dim() == 1:  # RMSNorm
                how = "ones"
            else:
                raise ValueError(f"no init rule for {name} ({type(module).__name__})")
            plan.append((name, tuple(param.shape), how))
            seen.add(name)
    missing = set(model.state_dict()) - seen
    if missing:
        raise ValueError(f"state dict entries without an init rule: {sorted(missing)[:5]}")
    return plan


def write_random_model(config, model_dir: str | Path, seed: int = 0, device: str = "cuda") -> dict:
    """A `from_pretrained`-loadable bf16 checkpoint of config's architecture with random weights,
    drawn tensor by tensor on `device` (never the whole model in host memory); returns the index."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    tmp = model_dir.with_name(model_dir.name + ".partial")
    if tmp.exists():
        import shutil
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plan = _init_plan(model, config.initializer_range)
    nbytes = [2 * int(torch.Size(shape).numel()) for _, shape, _ in plan]
    shards, size = [[]], 0  # consecutive tensors, each shard at most SHARD_BYTES (or one tensor)
    for entry, n in zip(plan, nbytes):
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {}
        for name, shape, how in shard:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
            if how == "ones":
                t.fill_(1.0)
            elif how == "zeros":
                t.zero_()
            else:
                t.normal_(0.0, config.initializer_range, generator=gen)
                if how.startswith("normal_pad:"):
                    t[int(how.split(":", 1)[1])].zero_()
            tensors[name] = t.to("cpu")
            weight_map[name] = fname
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": weight_map}
    if len(shards) > 1:
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(tmp))
    GenerationConfig.from_model_config(model.config).save_pretrained(str(tmp))
    tmp.rename(model_dir)  # complete or absent: a cut build is redone, never reused
    return index


def random_prompts(n: int, length: int, seed: int = 0) -> list[str]:
    """n prompts of exactly `length` characters (= tokens for the character tokenizer)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(PROMPT_CHARS) for _ in range(length)) for _ in range(n)]


def write_prompt_file(path: str | Path, n: int, length: int, seed: int = 0) -> str:
    """A JSONL task file (`prompt`, `answer`) for `task.name = 'file'`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, p in enumerate(random_prompts(n, length, seed)):
            f.write(json.dumps({"prompt": p, "answer": str(i % 10)}) + "\n")
    return str(path)


def main(argv=None) -> int:
    import argparse
    import sys
    import time
    p = argparse.ArgumentParser(description="Builds (or reuses) the benchmark model and tokenizer under --out.")
    p.add_argument("--shape", choices=tuple(SHAPES), default="0.5b")
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke tests)")
    p.add_argument("--device", default=None, help="where the 7B shape's tensors are drawn (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    t0 = time.perf_counter()
    out = build_assets(args.out, tiny=args.tiny, seed=args.seed, shape=args.shape, device=args.device)
    size = sum(f.stat().st_size for f in Path(out["model_dir"]).iterdir()) / 1e9
    print(f"assets ({'tiny' if args.tiny else args.shape}) ready in {time.perf_counter() - t0:.1f} s: {out}, "
          f"model files {size:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
