"""The shape of a decoder-only transformer, read from its config.json alone (no weights): what the
memory plan (rlhf/memory/formulas.py) computes bytes from. Published shapes (`KNOWN_SHAPES`) plan a
run without a checkpoint; the tiny default's shape comes from its `tiny_model` bindings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Mapping, Sequence, Tuple

from rlhf.errors import ConfigError
from rlhf.models import ShapeError, config_architectures, shape_fields, text_config

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_LINEARS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_vl", "qwen2_5_vl")
"""Architectures whose q/k/v projections carry a bias without saying so in config.json."""


def _first(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a decoder-only transformer (Llama, Qwen2/3, Mistral, Phi-3:
    RMSNorm, rotary attention with grouped-query heads, a gated MLP), read from its config."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    name: str = ""
    architectures: Tuple[str, ...] = ()
    """config.json's `architectures` (the model classes vLLM and transformers load it as), when read from one."""

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        """From a transformers config (object or dict; a multimodal config's `text_config` is the
        language model). Raises a ShapeError (a ValueError) for a config that is not a shape
        (`shape_fields`) and for what it cannot model (mixture-of-experts)."""
        c = config.to_dict() if hasattr(config, "to_dict") else dict(config) if isinstance(config, Mapping) else config
        f = shape_fields(c)  # a ShapeError naming the field and what is allowed
        architectures = config_architectures(c)  # the whole model's, multimodal too
        c, _ = text_config(c)
        experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts", default=0)
        if isinstance(experts, int) and experts > 1:
            raise ShapeError("is a mixture-of-experts model, which the memory plan does not model")
        h, heads = f["hidden_size"], f["num_attention_heads"]
        model_type = str(c.get("model_type") or "")
        attention_bias = c.get("attention_bias")
        return cls(hidden_size=h, num_layers=f["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=f["num_key_value_heads"] or heads, head_dim=f["head_dim"] or h // heads,
                   intermediate_size=f["intermediate_size"] or 4 * h,
                   vocab_size=f["vocab_size"], tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                   qkv_bias=bool(attention_bias) if attention_bias is not None else model_type in QKV_BIAS_MODEL_TYPES,
                   o_bias=bool(attention_bias), mlp_bias=bool(c.get("mlp_bias", False)),
                   qk_norm=model_type.startswith("qwen3"), name=name or model_type, architectures=architectures)

    @classmethod
    def from_dir(cls, path: str | Path, binding: str = "model.name_or_path") -> "ModelShape":
        """From `path/config.json`; a one-line ConfigError naming `binding` and the file when there is
        none or it is not a model shape (`shape_fields`)."""
        file = Path(path) / "config.json"
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError):
            raise ConfigError(f"{binding} = {str(path)!r}: no readable config.json to take the model's shape "
                              f"from") from None
        try:
            return cls.from_config(config, name=Path(path).name)
        except ShapeError as err:
            raise ConfigError(f"{binding} = {str(path)!r}: {file} {err.predicate}") from None

    def config_dict(self) -> dict:
        """A transformers config of this shape (what `from_config` reads back): a Qwen2 when the q/k/v
        projections alone carry a bias, else a Llama; for a shape without a config.json (the tiny
        default, the published shapes) to be checked as the trainer checks a policy's."""
        qwen2 = self.qkv_bias and not self.o_bias
        return {"model_type": "qwen2" if qwen2 else "llama",
                "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
                "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
                **({} if qwen2 else {"attention_bias": self.o_bias, "mlp_bias": self.mlp_bias})}

    @property
    def architecture_names(self) -> Tuple[str, ...]:
        """The model classes it loads as: config.json's `architectures`, or for a shape without one (the tiny
        default, the published shapes) the class `config_dict` writes."""
        return self.architectures or tuple(self.config_dict()["architectures"])

    def linears(self) -> Dict[str, tuple]:
        """(in, out) features of each linear layer of one block."""
        h, q, kv, f = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    @property
    def layer_params(self) -> int:
        """One block: its seven projections, their biases, two RMSNorms (and Qwen3's q/k norms)."""
        lin = self.linears()
        weights = sum(i * o for i, o in lin.values())
        bias = (lin["q_proj"][1] + 2 * lin["k_proj"][1] if self.qkv_bias else 0) + \
            (self.hidden_size if self.o_bias else 0) + \
            (2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0)
        return weights + bias + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def parameter_count(self, lm_head: bool = True) -> int:
        """Parameters of the causal LM (tied embeddings counted once); `lm_head=False`: the backbone
        alone (what the critic and a reward model keep), which loses only an untied head."""
        head = self.embedding_params if lm_head and not self.tie_word_embeddings else 0
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + head

    def matmul_params(self, lm_head: bool = True) -> int:
        """Weights that go through matmuls (the projections, and the LM head): what bf16 autocast copies."""
        return self.num_layers * sum(i * o for i, o in self.linears().values()) + \
            (self.embedding_params if lm_head else 0)

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        """Adapter parameters: rank x (in + out) for every targeted projection of every block."""
        lin = self.linears()
        return self.num_layers * rank * sum(lin[t][0] + lin[t][1] for t in targets)


def parameter_count(config) -> int:
    """Parameters of a causal LM from its config alone (a transformers config or a dict)."""
    return ModelShape.from_config(config).parameter_count()


KNOWN_SHAPES = {
    # Qwen2.5 base/instruct config.json files (Hugging Face, 2024): hidden, layers, heads, KV heads,
    # intermediate, vocab, tied embeddings.
    "qwen2.5-0.5b": ModelShape(896, 24, 14, 2, 64, 4864, 151936, True, True, name="Qwen2.5-0.5B"),
    "qwen2.5-1.5b": ModelShape(1536, 28, 12, 2, 128, 8960, 151936, True, True, name="Qwen2.5-1.5B"),
    "qwen2.5-3b": ModelShape(2048, 36, 16, 2, 128, 11008, 151936, True, True, name="Qwen2.5-3B"),
    "qwen2.5-7b": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, False, True, name="Qwen2.5-7B"),
}
"""Published shapes, for planning without a checkpoint (`python -m rlhf.memory --shape`)."""


def tiny_shape(tiny) -> ModelShape:
    """The embedded default (rlhf/tiny.py): a Llama of `tiny_model`'s shape over the character vocabulary."""
    from rlhf.tiny import CHARACTERS, SPECIAL_TOKENS
    return ModelShape(tiny.hidden_size, tiny.num_layers, tiny.num_heads, tiny.num_heads,
                      tiny.hidden_size // tiny.num_heads, tiny.intermediate_size,
                      len(SPECIAL_TOKENS) + len(CHARACTERS), name="tiny")


def lora_targets(target_modules) -> tuple:
    """The block projections `ppo.lora_target_modules` adapts ('all-linear': all seven)."""
    if target_modules == "all-linear":
        return LINEARS
    names = []
    for t in target_modules:
        names.extend(FUSED_LINEARS.get(t, (t,)))
    return tuple(n for n in LINEARS if n in names)
