"""Model building: policies are ordinary `AutoModelForCausalLM` checkpoints; the critic is the
same backbone with a scalar value head. Weights are read and written as safetensors only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from rlhf.config import ConfigError


def adamw(params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The engine's AdamW, for every model it trains (policy, critic, SFT warm start, reward model):
    torch's fused kernel on CPU and GPU. On a GPU it is one launch for all parameters instead of ~10
    per tensor; on the CPU it is ~3x faster than the per-tensor loop and, unlike it, gives the same
    bits on every x86-64 CPU: the loop's `sqrt` goes to MKL's vector maths, whose result differs
    between Intel and AMD CPUs by an ulp in ~5% of values whatever MKL_CBWR says (measured by
    `bench/cpu_numerics.py probe`), while the fused kernel uses the ISA's exact square root."""
    return torch.optim.AdamW(list(params), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=True)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A left-padding tokenizer (generation pads prompts on the left)."""
    if not Path(path).is_dir():
        raise ConfigError(f"tokenizer directory {str(path)!r} does not exist (model.tokenizer_path)")
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer {str(path)!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {str(path)!r} has no EOS token: responses could never end")
    return tok


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.name_or_path = {str(path)!r}: not a local model directory "
                          f"(no config.json); use 'tiny' or a saved AutoModelForCausalLM checkpoint")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                 use_safetensors=True)
    model.config.use_cache = True
    return model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


class ValueModel(nn.Module):
    """Critic: a causal LM backbone plus a linear value head; `values[b, t]` scores prefix 0..t."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    @classmethod
    def from_policy_checkpoint(cls, path: str | Path, seed: int, random_init: bool = False,
                               dtype: torch.dtype = torch.float32) -> "ValueModel":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if random_init:
                config = AutoConfig.from_pretrained(str(path), local_files_only=True)
                lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
            else:
                lm = load_policy(path, dtype)
            model = cls(lm.base_model, lm.config.hidden_size)
            nn.init.normal_(model.value_head.weight, std=1.0 / (lm.config.hidden_size + 1) ** 0.5)
            nn.init.zeros_(model.value_head.bias)
        return model.to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Padded rows (attention_mask), or packed rows: no mask, position ids restarting at 0 for
        each sequence (rlhf/packing.py)."""
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False)
        return self.value_head(out.last_hidden_state).squeeze(-1).float()
