"""Shared inputs of the GPU benchmarks: a Qwen2.5-0.5B-shaped model with random weights, a
character tokenizer in its own folder, and prompts of an exact token length.

No downloads: the model is built from a `Qwen2Config` with the published 0.5B shape, the
tokenizer locally (`rlhf.tiny.build_char_tokenizer`, one token per character). The model's
vocabulary (151,936) is larger than the tokenizer's; sampled ids the tokenizer does not know
decode to nothing, which is all a speed benchmark needs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

QWEN2_5_0_5B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                    max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=2048)
PROMPT_CHARS = "0123456789+-=*/ .,abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def model_config(tiny: bool = False):
    from transformers import Qwen2Config
    return Qwen2Config(**(TINY_SHAPE if tiny else QWEN2_5_0_5B), bos_token_id=1, eos_token_id=2, pad_token_id=0)


def parameter_count(config) -> int:
    """Parameters of the model (tied embeddings counted once), from the config alone: the memory
    plan's arithmetic (rlhf/placement/memory.py), so there is one copy of it."""
    from rlhf.placement.memory import parameter_count as from_shape
    return from_shape(config)


def build_assets(root: str | Path, tiny: bool = False, seed: int = 0) -> dict:
    """Writes `model/` (safetensors, bf16) and `tokenizer/` under root; returns their paths."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.tiny import build_char_tokenizer

    root = Path(root)
    model_dir, tok_dir = root / "model", root / "tokenizer"
    if not (model_dir / "config.json").is_file():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config(tiny), dtype=torch.bfloat16)
        model.save_pretrained(str(model_dir), safe_serialization=True)
        del model
    if not (tok_dir / "tokenizer.json").is_file():
        build_char_tokenizer(tok_dir)
    return {"model_dir": str(model_dir), "tokenizer_dir": str(tok_dir)}


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
