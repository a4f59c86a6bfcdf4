"""Model building: policies are ordinary `AutoModelForCausalLM` checkpoints; the critic is the
same backbone with a scalar value head. Weights are read and written as safetensors only.

LoRA (`ppo.lora_rank > 0`) is peft's: `add_lora` wraps a model in a `PeftModel` whose base is
frozen and whose adapters train; `merged_weights` folds the adapters into the base for a rollout
engine; adapters are saved in peft's own format (`PeftModel.from_pretrained` loads them).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterable, Iterator, Mapping, Tuple, cast

import torch
from torch import nn

from rlhf.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
# transformers' model classes are imported where a model or tokenizer is built: importing them costs
# seconds, and a study's planning (the shape and config checks here) needs only transformers' configs.


def adamw(params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """The engine's AdamW, for every model it trains (policy, critic, SFT warm start, reward model):
    torch's fused kernel on CPU and GPU. On a GPU it is one launch for all parameters instead of ~10
    per tensor; on the CPU it is faster than the per-tensor loop and, unlike it, gives the same bits
    on every x86-64 CPU: the loop's `sqrt` goes to MKL's vector maths, whose result differs between
    Intel and AMD CPUs by an ulp whatever MKL_CBWR says (bench/results/cpu_probe_*/, from
    `bench/cpu_numerics.py probe`), while the fused kernel uses the ISA's exact square root."""
    return torch.optim.AdamW(list(params), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model", "tekken.json")
"""What a saved tokenizer leaves in its directory (one of them at least)."""


SHAPE_FIELDS = (("hidden_size", ("hidden_size", "n_embd", "d_model"), True),
                ("num_hidden_layers", ("num_hidden_layers", "n_layer", "num_layers"), True),
                ("num_attention_heads", ("num_attention_heads", "n_head"), True),
                ("vocab_size", ("vocab_size",), True),
                ("num_key_value_heads", ("num_key_value_heads",), False),
                ("head_dim", ("head_dim",), False),
                ("intermediate_size", ("intermediate_size", "n_inner", "ffn_dim"), False))
"""(field, the keys config.json may spell it with, required) of a model's shape."""


class ShapeError(ValueError):
    """A model config that is not a shape the engine can take; `predicate` says why, after the
    config's name ('says hidden_size = 0; allowed: a positive integer')."""

    def __init__(self, predicate: str):
        super().__init__(f"the model config {predicate}")
        self.predicate = predicate


def text_config(config: dict) -> tuple:
    """(the language model's config, the prefix naming its fields): a multimodal config's `text_config`."""
    if isinstance(config.get("text_config"), dict) and config["text_config"]:
        return config["text_config"], "text_config."
    return config, ""


def shape_fields(config) -> dict:
    """The shape fields of a model config (a dict; a multimodal config's `text_config` is the
    language model), each a positive integer, with the heads dividing the width: {field: value}
    (None for an optional field it leaves out). A ShapeError naming the field and what is allowed
    otherwise: every config.json the memory plan (rlhf/memory/shapes.py) reads and the policy
    check (`check_policy_dir`) takes goes through here."""
    if not isinstance(config, dict):
        raise ShapeError(f"is not a JSON object (it holds a {type(config).__name__}); allowed: a model config "
                         f"object with model_type, hidden_size, num_hidden_layers, num_attention_heads, vocab_size")
    c, prefix = text_config(config)
    values, missing = {}, []
    for field, keys, required in SHAPE_FIELDS:
        key = next((k for k in keys if c.get(k) is not None), None)
        if key is None:
            values[field] = None
            if required:
                missing.append(prefix + field)
            continue
        value = c[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ShapeError(f"says {prefix}{key} = {value!r}; allowed: a positive integer")
        values[field] = value
    if missing:
        raise ShapeError(f"has no {', '.join(missing)}; allowed: each a positive integer (the model's shape)")
    h, heads, kv = values["hidden_size"], values["num_attention_heads"], values["num_key_value_heads"]
    if values["head_dim"] is None and h % heads:
        raise ShapeError(f"says {prefix}hidden_size = {h}, not a multiple of {prefix}num_attention_heads = {heads}; "
                         f"allowed: a hidden_size that num_attention_heads divides (each head is hidden_size / "
                         f"num_attention_heads wide), or an explicit head_dim")
    if kv is not None and heads % kv:
        raise ShapeError(f"says {prefix}num_attention_heads = {heads}, not a multiple of {prefix}num_key_value_heads "
                         f"= {kv}; allowed: a num_key_value_heads that divides num_attention_heads (grouped-query "
                         f"attention shares each key/value head among a whole number of query heads)")
    return values


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""tokenizer_config.json's class of a tokenizer that is its tokenizer.json and nothing else."""


def _generic_tokenizer_class(path: Path) -> bool:
    """Whether `path` holds a tokenizer saved as the generic class with its tokenizer.json. Beside a
    model's config.json, AutoTokenizer builds such a tokenizer as the model type's own class (a
    character tokenizer beside a qwen2 config becomes a Qwen2Tokenizer, which drops spaces and
    newlines); loaded as the generic class it encodes exactly as it did when it was saved."""
    import json
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
            and (path / "tokenizer.json").is_file())


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
        if _generic_tokenizer_class(path):  # as saved: AutoTokenizer would rebuild it as the model type's class
            from transformers import PreTrainedTokenizerFast
            tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        else:
            from transformers import AutoTokenizer
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


def config_architectures(config: Mapping) -> Tuple[str, ...]:
    """config.json's `architectures` as model class names: the list transformers writes, or a lone
    string read as one name (a hand-written config.json), or none when absent or of another type."""
    archs = config.get("architectures") if isinstance(config, Mapping) else None
    if isinstance(archs, str):
        return (archs,)
    return tuple(str(a) for a in archs) if isinstance(archs, (list, tuple)) else ()


def config_num_labels(config: Mapping) -> int:
    """How many outputs a sequence classifier's config.json gives it: its `id2label`'s size, else
    `num_labels`, else transformers' default of 2."""
    return len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels", 2)


def read_model_config(path: str | Path, binding: str, expected: str):
    """The parsed config.json of model dir `path` (named by `binding`), or a one-line ConfigError:
    no such file (`expected` says what to give instead), or not JSON."""
    import json
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: not a local model directory (no config.json); "
                          f"{expected}")
    try:
        return json.loads(cfg_file.read_text())
    except ValueError as err:
        raise ConfigError(f"{binding} = {str(path)!r}: {cfg_file} is not valid JSON ({err}); allowed: the "
                          f"config.json transformers saved with the model") from None


def check_policy_dir(path: str | Path, binding: str = "model.name_or_path", ppo=None, config=None) -> None:
    """The one check of a policy model before anything loads, made alike by the trainer's start
    (rlhf/memory/plan.py `check_policy`, called by rlhf/trainer.py), `python -m rlhf.memory`
    and `load_policy`; a one-line ConfigError naming `binding`, the file and what is allowed:

    - config.json present and a JSON object;
    - its `architectures` (when it names them) a model with a language-model head: a sequence
      classifier or a masked LM would load into AutoModelForCausalLM with a freshly initialised head;
    - its shape (`shape_fields`, what the memory plan reads): positive
      integer sizes, the attention heads dividing hidden_size and the key/value heads dividing them;
    - a `model_type` transformers has a causal LM for, and a config transformers accepts;
    - with `ppo` (a PPOConfig) and LoRA on, `ppo.lora_target_modules` and the ranks against the
      layers of the policy and of the critic (`check_lora_targets`), on a weightless (meta) copy.

    `config`: the config dict to check instead of reading `path`/config.json (the tiny default's or a
    published shape's, which have no directory; `path` then only names it)."""
    if config is None:
        config = read_model_config(path, binding, "use 'tiny' or a saved AutoModelForCausalLM checkpoint")
        where = f"{binding} = {str(path)!r}: {Path(path) / 'config.json'}"
    else:
        where = f"{binding} = {str(path)!r}: its model config"
    try:
        _check_architectures(config_architectures(config), path, binding)
        shape_fields(config)
    except ShapeError as err:
        raise ConfigError(f"{where} {err.predicate}") from None
    transformers_config = _transformers_config(config, where)
    if ppo is not None:
        _check_run_lora(transformers_config, ppo, where)


def _check_architectures(archs: Tuple[str, ...], path, binding: str) -> None:
    if archs and not any(a.endswith(CAUSAL_LM_ARCHITECTURES) for a in archs):
        kind = "a sequence classifier (a reward model?)" if any(a.endswith("ForSequenceClassification")
                                                                for a in archs) else "not a causal LM"
        raise ConfigError(f"{binding} = {str(path)!r} is invalid: its config.json says architectures = {list(archs)}, "
                          f"{kind}; loading it as the policy would start from an untrained LM head. Use a "
                          f"causal LM checkpoint (architectures ending in ForCausalLM)")


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(err).__name__


def _transformers_config(config: dict, where: str):
    """The transformers config of a config.json dict, as AutoModelForCausalLM would build it: a
    ConfigError for a model_type it does not know or has no causal LM for, and for a config its own
    validation refuses."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    model_type = config.get("model_type")
    allowed = "allowed: a model type with a causal LM in transformers, such as 'llama', 'qwen2' or 'mistral'"
    if model_type is None:
        raise ConfigError(f"{where} has no model_type; {allowed}")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{where} says model_type = {model_type!r}, which this transformers does not know; {allowed}")
    try:
        built = CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as err:  # transformers' own validation (huggingface_hub's strict dataclasses) or a bad value
        raise ConfigError(f"{where} is not a {model_type} config transformers accepts ({_last_line(err)})") from None
    if type(built) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"{where} says model_type = {model_type!r}, which has no causal LM in transformers; "
                          f"{allowed}")
    return built


def _check_run_lora(transformers_config, ppo, where: str) -> None:
    """`check_lora_targets` for the policy (`ppo.lora_rank`) and the critic (its backbone,
    `ppo.critic_lora_rank`) where they have adapters, on a weightless copy of the model."""
    policy_rank = ppo.lora_rank
    critic_rank = ppo.resolved_critic_lora_rank if ppo.uses_critic else 0
    if not policy_rank and not critic_rank:
        return
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):  # the modules and their shapes, no memory
            lm = AutoModelForCausalLM.from_config(transformers_config)
    except (ValueError, TypeError, KeyError) as err:
        raise ConfigError(f"{where}: transformers cannot build a causal LM from it ({_last_line(err)})") from None
    if policy_rank:
        check_lora_targets(lm, "policy", policy_rank, "ppo.lora_rank", ppo.lora_target_modules)
    if critic_rank:
        check_lora_targets(lm.base_model, "critic", critic_rank,
                           "ppo.critic_lora_rank" if ppo.critic_lora_rank > 0 else "ppo.lora_rank",
                           ppo.lora_target_modules, policy=lm)


def _lora_layer_types() -> tuple:
    from transformers.pytorch_utils import Conv1D
    return nn.Linear, nn.Embedding, Conv1D, nn.Conv1d, nn.Conv2d, nn.Conv3d


def _features(module: nn.Module) -> Tuple[int, int]:
    """(in, out) features of a layer LoRA adapts."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, nn.Embedding):
        return module.num_embeddings, module.embedding_dim
    if isinstance(module, nn.modules.conv._ConvNd):
        return module.in_channels, module.out_channels
    in_features, out_features = cast(torch.Tensor, module.weight).shape[:2]  # transformers' Conv1D: [in, out]
    return in_features, out_features


def _matches(target: str, names) -> list:
    """The module names peft's `target_modules = [target]` matches (its own rule: the name, or a
    dotted suffix of it)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    config = LoraConfig(target_modules=[target])
    return [n for n in names if n and check_target_module_exists(config, n)]


def check_lora_targets(model: nn.Module, role: str, rank: int, rank_binding: str, target_modules,
                       policy: nn.Module | None = None) -> list:
    """The names of the layers `add_lora(model, rank, ..., target_modules)` would adapt, checked: every name of
    `target_modules` names at least one layer of `model` LoRA can adapt (peft drops a name that matches
    nothing as long as another one matches), and `rank` is at most the narrowest targeted layer's width
    (min(in, out): the adapter's update B @ A has no higher rank). A one-line ConfigError naming the
    binding, the model (`role`: 'policy' or 'critic') and its layer names otherwise. `policy`: for the
    critic (the policy's backbone), the policy itself, to say when only the critic lacks a name."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers
    modules = dict(model.named_modules())
    adaptable = {n: m for n, m in modules.items() if n and isinstance(m, _lora_layer_types())}
    known = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in adaptable}))
    binding = f"ppo.lora_target_modules = {target_modules!r} is invalid"
    which = ("the critic (the policy's backbone with a value head, without the LM head)" if role == "critic"
             else f"the {role}")
    if isinstance(target_modules, str):  # 'all-linear': peft's own choice (every linear layer but the output head)
        resolved = cast(LoraConfig, _maybe_include_all_linear_layers(LoraConfig(target_modules=target_modules), model))
        targeted = sorted(cast(Iterable[str], resolved.target_modules))  # the names peft resolved 'all-linear' to
    else:
        targeted = []
        for target in target_modules:
            hits = _matches(target, modules)
            if not hits:
                fix = ""
                if policy is not None and _matches(target, dict(policy.named_modules())):
                    fix = (f"; the policy has it, the critic does not: drop {target!r} or set ppo.critic_lora_rank "
                           f"= 0 (the critic trains in full)")
                raise ConfigError(f"{binding}: {which} has no module named {target!r}{fix}; its module names: "
                                  f"{known}")
            other = [n for n in hits if n not in adaptable]
            if other:
                raise ConfigError(f"{binding}: {target!r} names {other[0]} of {which}, a "
                                  f"{type(modules[other[0]]).__name__}, which LoRA cannot adapt (linear and embedding "
                                  f"layers only); its module names: {known}")
            targeted += hits
    if not targeted:
        raise ConfigError(f"{binding}: {which} has no linear layer for it to adapt; its module names: {known}")
    narrowest = min(targeted, key=lambda n: sorted(_features(adaptable[n])))  # the narrowest, then the smallest
    fan_in, fan_out = _features(adaptable[narrowest])
    width = min(fan_in, fan_out)
    if rank > width:
        raise ConfigError(f"{rank_binding} = {rank} is invalid: above the width of the {role}'s narrowest adapted "
                          f"layer ({narrowest}: {fan_in} in, {fan_out} out features), where a rank above {width} "
                          f"adds nothing; allowed: a rank from 1 to {width} (or fewer target modules, "
                          f"ppo.lora_target_modules)")
    return sorted(targeted)


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> nn.Module:
    """`device`: a GPU to load the weights straight onto (a frozen 7B base: no pass through host memory)."""
    from transformers import AutoModelForCausalLM
    check_policy_dir(path)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True, use_safetensors=True,
                                                 **({"device_map": str(torch.device(device))}
                                                    if device is not None and on_gpu else {}))
    model.config.use_cache = True
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """transformers' own gradient checkpointing on the (first) HF model inside `model` (a policy, a
    PeftModel around one, or the critic's backbone): each decoder layer's activations are recomputed
    in the backward pass. Non-reentrant, so frozen inputs (a LoRA base) need no grad hooks."""
    from transformers import PreTrainedModel
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
    config = LoraConfig(r=rank, lora_alpha=alpha,  # pyright: ignore[reportArgumentType]  # peft says int; floats work
                        lora_dropout=dropout, target_modules=targets, bias="none", task_type=task_type)
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as err:  # target modules not found in the model
        raise ConfigError(f"ppo.lora_target_modules = {target_modules!r} is invalid: "
                          f"{str(err).splitlines()[0][:200]}") from None
    if base_path is not None:  # where PeftModel.from_pretrained finds the base again
        peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = str(Path(base_path).resolve())
    return peft_model


def is_lora(model: nn.Module) -> bool:
    if "peft" not in sys.modules:  # no model is a PeftModel before peft is imported (importing it costs a second)
        return False
    from peft import PeftModel
    return any(isinstance(m, PeftModel) for m in model.modules())


def lora_scaling(model: nn.Module) -> float:
    """alpha / rank of the model's adapters (peft's `scaling`, rsLoRA off)."""
    from peft import LoraConfig, PeftModel
    peft_model = next(m for m in model.modules() if isinstance(m, PeftModel))
    config = cast(LoraConfig, peft_model.peft_config[ADAPTER_NAME])
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
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file() and p.name != "README.md"}
    files[ADAPTER_CONFIG] = _sorted_adapter_config(files[ADAPTER_CONFIG])
    return files


def _sorted_adapter_config(raw: bytes) -> bytes:
    """peft keeps `target_modules` as a set, so its saved order follows the process's string
    hashing: sorted, the same run writes the same bytes (peft's own format: indent 2, sorted keys)."""
    import json
    config = json.loads(raw)
    for key in ("target_modules", "modules_to_save", "exclude_modules"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    return json.dumps(config, indent=2, sort_keys=True).encode()


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
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if random_init:
                config = AutoConfig.from_pretrained(str(path), local_files_only=True)
                lm = cast(PreTrainedModel, AutoModelForCausalLM.from_config(config, dtype=dtype))
            else:
                lm = cast(PreTrainedModel, load_policy(path, dtype, device))
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
            assert attention_mask is not None, "padded rows need attention_mask; packed rows pass position_ids"
            position_ids = position_ids_from_mask(attention_mask)
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False, **packed)
        return self.value_head(out.last_hidden_state).squeeze(-1).float()
