"""Model building: policies are ordinary `AutoModelForCausalLM` checkpoints; the critic is the
same backbone with a scalar value head. Weights are read and written as safetensors only.

LoRA (`ppo.lora_rank > 0`) is peft's: `add_lora` wraps a model in a `PeftModel` whose base is
frozen and whose adapters train; `merged_weights` folds the adapters into the base for a rollout
engine; adapters are saved in peft's own format (`PeftModel.from_pretrained` loads them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, Mapping, Tuple

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf.config import ConfigError


def adamw(params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The engine's AdamW, for every model it trains (policy, critic, SFT warm start, reward model):
    torch's fused kernel on CPU and GPU. On a GPU it is one launch for all parameters instead of ~10
    per tensor; on the CPU it is ~3x faster than the per-tensor loop and, unlike it, gives the same
    bits on every x86-64 CPU: the loop's `sqrt` goes to MKL's vector maths, whose result differs
    between Intel and AMD CPUs by an ulp in ~5% of values whatever MKL_CBWR says (measured by
    `bench/cpu_numerics.py probe`), while the fused kernel uses the ISA's exact square root."""
    return torch.optim.AdamW(list(params), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tekken.json")
"""What a saved tokenizer leaves in its directory (one of them at least)."""


def read_tokenizer(path: str | Path, binding: str, fix: str = "") -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path` (named by `binding`), or a one-line ConfigError naming the binding
    to set (`fix`): for a missing directory, a directory without tokenizer files (transformers would
    build an empty tokenizer for some model types from config.json alone), one it cannot load, and
    a tokenizer without a vocabulary."""
    path = Path(path)
    where = f"{binding} = {str(path)!r}"
    set_it = f"set {fix} to the directory the model's tokenizer was saved in" if fix and fix != binding else \
        "point it at the directory the model's tokenizer was saved in"
    if not path.is_dir():
        raise ConfigError(f"{where} is invalid: no such tokenizer directory; {set_it}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where}: no tokenizer files in that directory (none of {', '.join(TOKENIZER_FILES[:4])}, "
                          f"...); {set_it}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{where}: cannot load a tokenizer there ({first}); {set_it}") from None
    special = set(tok.all_special_tokens)
    if not [t for t in tok.get_vocab() if t not in special]:
        raise ConfigError(f"{where}: the tokenizer there has an empty vocabulary ({len(tok)} tokens, all special); "
                          f"{set_it}")
    return tok


def check_vocab_fits(tokenizer, tokenizer_binding: str, tokenizer_dir: str | Path, model_binding: str,
                     model_dir: str | Path) -> None:
    """A ConfigError unless every id of `tokenizer` (from `tokenizer_dir`, named by `tokenizer_binding`)
    indexes the embedding of the model in `model_dir`
    (`vocab_size` in its config.json; nothing to check when it says none): a larger id would fail
    inside the forward pass."""
    import json
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab_size = text.get("vocab_size") if isinstance(text, dict) else None
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        return
    max_id = max(tokenizer.get_vocab().values(), default=-1)
    if max_id >= vocab_size:
        raise ConfigError(f"{tokenizer_binding} = {str(tokenizer_dir)!r}: the tokenizer has ids up to {max_id} "
                          f"({len(tokenizer)} tokens), beyond the embedding of {model_binding} = {str(model_dir)!r} "
                          f"(vocab_size = {vocab_size} in its config.json); use the tokenizer the model was "
                          f"trained with")


def load_tokenizer(path: str | Path, binding: str = "model.tokenizer_path") -> PreTrainedTokenizerBase:
    """A left-padding tokenizer (generation pads prompts on the left). `binding`: the one that named
    `path` (model.tokenizer_path, or model.name_or_path when the tokenizer is the model's own)."""
    tok = read_tokenizer(path, binding, fix="model.tokenizer_path")
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer {str(path)!r} has neither a pad nor an EOS token")
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {str(path)!r} has no EOS token: responses could never end")
    return tok


CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel", "WithLMHead", "ForConditionalGeneration")
"""How the architectures of a checkpoint with a language-model head end (config.json)."""


def check_policy_dir(path: str | Path, binding: str = "model.name_or_path") -> None:
    """The policy directory holds a causal LM: config.json present and its `architectures` (when it
    names them) a model with a language-model head. A sequence classifier or a bare backbone would
    load into AutoModelForCausalLM with a freshly initialised head: a ConfigError instead, before
    any weights load."""
    import json
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: not a local model directory (no config.json); "
                          f"use 'tiny' or a saved AutoModelForCausalLM checkpoint")
    try:
        archs = json.loads(cfg_file.read_text()).get("architectures") or []
    except (ValueError, AttributeError):
        raise ConfigError(f"{binding} = {str(path)!r}: config.json is not a JSON object") from None
    if archs and not any(str(a).endswith(CAUSAL_LM_ARCHITECTURES) for a in archs):
        kind = "a sequence classifier (a reward model?)" if any(str(a).endswith("ForSequenceClassification")
                                                                for a in archs) else "not a causal LM"
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: its config.json says architectures = {archs}, "
                          f"{kind}; loading it as the policy would start from an untrained LM head. Use a "
                          f"causal LM checkpoint (architectures ending in ForCausalLM)")


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> nn.Module:
    """`device`: a GPU to load the weights straight onto (a frozen 7B base: no pass through host memory)."""
    check_policy_dir(path)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True, use_safetensors=True,
                                                 **({"device_map": str(torch.device(device))} if on_gpu else {}))
    model.config.use_cache = True
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' own gradient checkpointing on the (first) HF model inside `model` (a policy, a
    PeftModel around one, or the critic's backbone): each decoder layer's activations are recomputed
    in the backward pass. Non-reentrant, so frozen inputs (a LoRA base) need no grad hooks."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            if not module.supports_gradient_checkpointing:
                raise ConfigError(f"gradient checkpointing: {type(module).__name__} does not support it "
                                  f"(set ppo.gradient_checkpointing / rm.gradient_checkpointing = False)")
            kwargs = {"use_reentrant": False}
            if hasattr(module, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
                module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            return
    raise ConfigError(f"gradient checkpointing: no transformers model inside {type(model).__name__}")


# ------------------------------------------------------------------ LoRA (peft)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"


def frozen_base_dtype(device: torch.device) -> torch.dtype:
    """A LoRA base never trains: bf16 on a GPU (half the bytes of fp32), fp32 on the CPU (where bf16
    matmuls are slow and round differently from one CPU to the next)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def add_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules, task_type=None,
             base_path: str | Path | None = None) -> nn.Module:
    """`model` wrapped in a peft `PeftModel` with rank-`rank` adapters on `target_modules` ('all-linear':
    every linear layer except the output head). peft freezes the base and keeps the adapters in fp32
    whatever the base's dtype; the adapters' A matrices are drawn from torch's global generator (seed
    it first), their B matrices are zero, so the wrapped model starts equal to the base."""
    from peft import LoraConfig, get_peft_model
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                        task_type=task_type)
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as err:  # target modules not found in the model
        raise ConfigError(f"ppo.lora_target_modules = {target_modules!r} is invalid: "
                          f"{str(err).splitlines()[0][:200]}") from None
    if base_path is not None:  # where PeftModel.from_pretrained finds the base again
        peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = str(Path(base_path).resolve())
    return peft_model


def is_lora(model: nn.Module) -> bool:
    from peft import PeftModel
    return any(isinstance(m, PeftModel) for m in model.modules())


def lora_scaling(model: nn.Module) -> float:
    """alpha / rank of the model's adapters (peft's `scaling`, rsLoRA off)."""
    from peft import PeftModel
    peft_model = next(m for m in model.modules() if isinstance(m, PeftModel))
    config = peft_model.peft_config[ADAPTER_NAME]
    return config.lora_alpha / config.r


_ADAPTER_KEY = re.compile(r"\.(lora_[AB])\.weight$")


def adapter_file_key(name: str) -> str:
    """A trained parameter's name as peft's adapter file spells it (the adapter name dropped)."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def parameter_name_from_adapter_file(key: str) -> str:
    """The inverse of `adapter_file_key` for LoRA matrices (`...q_proj.lora_A.weight`)."""
    return _ADAPTER_KEY.sub(rf".\1.{ADAPTER_NAME}.weight", key)


def merged_weights(state: Mapping[str, torch.Tensor], scaling: float,
                   prefix: str = "base_model.model.") -> Iterator[Tuple[str, torch.Tensor]]:
    """The HF-named weights of a LoRA model's state dict (`PeftModel.state_dict()` names) with each
    adapter folded into its base weight, W + scaling * B @ A (what peft's `merge_and_unload` computes),
    in fp32 and returned in W's dtype. A generator: one merged matrix exists at a time, so a rollout
    engine can take a 7B policy's weights without a second copy of them."""
    for name, tensor in state.items():
        if "lora_" in name:
            continue
        hf_name = name[len(prefix):] if name.startswith(prefix) else name
        if ".base_layer." in name:
            hf_name = hf_name.replace(".base_layer.", ".")
            module = name[:name.index(".base_layer.")]
            a = state.get(f"{module}.lora_A.{ADAPTER_NAME}.weight")
            if a is not None and name.endswith(".base_layer.weight"):
                b = state[f"{module}.lora_B.{ADAPTER_NAME}.weight"]
                delta = (b.float() @ a.float()) * scaling
                tensor = (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)
        yield hf_name, tensor


def adapter_files(model: nn.Module, state: Dict[str, torch.Tensor] | None = None) -> Dict[str, bytes]:
    """The adapter as peft saves it (adapter_config.json, adapter_model.safetensors), as bytes.
    `state`: the trained parameters (names as in `model.named_parameters()`), e.g. gathered from
    FSDP shards; default: the model's own."""
    import tempfile
    from peft import PeftModel
    peft_model = next(m for m in model.modules() if isinstance(m, PeftModel))
    with tempfile.TemporaryDirectory() as tmp:
        peft_model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file() and p.name != "README.md"}


def read_adapter_rank(adapter_dir: str | Path) -> int:
    import json
    return int(json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())["r"])


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as HF generate computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


class ValueModel(nn.Module):
    """Critic: a causal LM backbone plus a linear value head; `values[b, t]` scores prefix 0..t.
    With LoRA the backbone is a `PeftModel` (frozen base, trained adapters) and the head trains in full."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    @classmethod
    def from_policy_checkpoint(cls, path: str | Path, seed: int, random_init: bool = False,
                               dtype: torch.dtype = torch.float32, lora: dict | None = None,
                               device: torch.device | None = None) -> "ValueModel":
        """`dtype`: the backbone's; the value head is fp32 under LoRA (it trains), else `dtype` too.
        `lora`: keyword arguments of `add_lora` (rank, alpha, dropout, target_modules). `device`: where
        to load the checkpoint's weights (a GPU: straight there)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if random_init:
                config = AutoConfig.from_pretrained(str(path), local_files_only=True)
                lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
            else:
                lm = load_policy(path, dtype, device)
            backbone = lm.base_model
            if lora:
                backbone = add_lora(backbone, **lora, base_path=path)
            model = cls(backbone, lm.config.hidden_size)
            nn.init.normal_(model.value_head.weight, std=1.0 / (lm.config.hidden_size + 1) ** 0.5)
            nn.init.zeros_(model.value_head.bias)
        model.value_head.to(next(backbone.parameters()).device)
        return model if lora else model.to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **packed) -> torch.Tensor:
        """Padded rows (attention_mask), or packed rows: no mask, position ids restarting at 0 for
        each sequence and the sequences' spans in `packed` (rlhf/packing.py `PackedRow.forward_kwargs`)."""
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False, **packed)
        return self.value_head(out.last_hidden_state).squeeze(-1).float()
