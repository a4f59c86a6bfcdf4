"""The embedded default: a character-level tokenizer, a tiny Llama, and its SFT warm start.

Everything is built locally and cached under a key of the configs that shape it, so every run
(and every seed of a study) reuses one warm start. Preparation is guarded by a file lock and
written atomically: parallel runs never see half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import torch
from filelock import FileLock
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rlhf import numerics
from rlhf.config import SFTConfig, TaskConfig, TinyModelConfig
from rlhf.data import Example, load_task
from rlhf.lr_schedule import lr_schedule
from rlhf.models import adamw
from rlhf.start_checks import TINY_MAX_POSITIONS

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
# transformers' model classes are imported where the tokenizer and model are built: the vocabulary
# below is what a study's planning reads (rlhf/memory/shapes.py), without seconds of transformers.

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-=*/ .,#?:()\n") + [chr(c) for c in range(ord("a"), ord("z") + 1)] \
    + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
FORMAT_VERSION = 2  # bump when the tokenizer, model or SFT recipe below changes meaning


def build_char_tokenizer(out_dir: str | Path) -> PreTrainedTokenizerFast:
    """A character-level tokenizer, saved so `AutoTokenizer.from_pretrained(out_dir)` loads it."""
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(str(out_dir))
    return tok


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int,
                     max_positions: int = TINY_MAX_POSITIONS) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, max_position_embeddings=max_positions,
        pad_token_id=cast(int, tokenizer.pad_token_id), bos_token_id=cast(int, tokenizer.bos_token_id),
        eos_token_id=cast(int, tokenizer.eos_token_id), tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def sft_batch(examples: Sequence[Example], tokenizer, device="cpu"):
    """Right-padded prompt+answer+EOS sequences; labels cover the answer and EOS only."""
    seqs, labels = [], []
    for ex in examples:
        p = tokenizer(ex.prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, row_labels) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device), lab.to(device)


def train_sft(model, tokenizer, train: Sequence[Example], cfg: SFTConfig, log=print) -> list[float]:
    """Plain next-token SFT on the answers; deterministic under cfg.seed."""
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = adamw(model.parameters(), lr=cfg.learning_rate)
    sched = lr_schedule(opt, "constant", warmup_steps=20, total_steps=cfg.steps, warmup_offset=1)
    model.train()
    losses = []
    for step in range(cfg.steps):
        idx = rng.integers(0, len(train), size=cfg.batch_size)
        ids, mask, labels = sft_batch([train[i] for i in idx], tokenizer)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            log(f"sft step {step + 1}/{cfg.steps} loss {np.mean(losses[-100:]):.4f}")
    model.eval()
    return losses


def cache_key(tiny: TinyModelConfig, sft: SFTConfig, task: TaskConfig) -> str:
    # The numeric settings shape the weights too: a native-kernel build is another checkpoint.
    blob = json.dumps({"v": FORMAT_VERSION, "tiny": tiny.__dict__, "sft": sft.__dict__,
                       "task": {"name": task.name, "max_operand": task.max_operand,
                                "eval_fraction": task.eval_fraction},
                       "numerics": numerics.cache_tag()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLHF_CACHE", Path.cwd() / ".cache" / "rlhf"))


def prepare_tiny(tiny: TinyModelConfig, sft: SFTConfig, task: TaskConfig,
                 cache_dir: str | Path | None = None, log=print) -> tuple[Path, Path]:
    """Returns (model_dir, tokenizer_dir) of the SFT warm start, building it once."""
    root = Path(cache_dir or default_cache_dir()) / f"tiny-{cache_key(tiny, sft, task)}"
    model_dir, tok_dir = root / "sft_model", root / "tokenizer"
    if (root / "DONE").is_file():
        return model_dir, tok_dir
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / "DONE").is_file():
            return model_dir, tok_dir
        if task.name != "arithmetic":  # RunConfig refuses this before any run gets here
            from rlhf.errors import ConfigError
            raise ConfigError(f"task.name = {task.name!r} is invalid: the tiny default is warm-started on the "
                              f"arithmetic task only")
        tmp = Path(str(root) + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            start = time.time()
            tokenizer = build_char_tokenizer(tmp / "tokenizer")
            train, _ = load_task(task)
            model = build_tiny_model(tiny, tokenizer, seed=sft.seed)
            log(f"building the tiny default SFT warm start ({sum(p.numel() for p in model.parameters())} "
                f"parameters, {sft.steps} steps) in {root}")
            with numerics.fixed_threads():  # the cached warm start must not depend on who builds it
                losses = train_sft(model, tokenizer, train, sft, log=log)
            model.save_pretrained(str(tmp / "sft_model"), safe_serialization=True)
            (tmp / "sft_info.json").write_text(json.dumps(
                {"final_loss": float(np.mean(losses[-20:])), "seconds": time.time() - start,
                 "tiny_model": tiny.__dict__, "sft": sft.__dict__, "numerics": numerics.cache_tag()}, indent=2))
            (tmp / "DONE").write_text("ok\n")
            shutil.rmtree(root, ignore_errors=True)
            os.replace(tmp, root)
        finally:  # a failed or interrupted build leaves nothing behind in the cache
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir, tok_dir
