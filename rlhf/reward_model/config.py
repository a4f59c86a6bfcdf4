"""Configuration of reward-model training (gin name: `rm`), validated like the engine's scopes:
a bad binding is one line naming it and what is allowed, before any compute."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rlhf.errors import ConfigError
from rlhf.validation import check, choice, number, positive_int


@dataclasses.dataclass(frozen=True)
class RMTrainConfig:
    """Bradley-Terry reward-model training on preference pairs (gin name: `rm`)."""

    train_path: str = ""
    """Preference pairs (JSONL / parquet; TRL / OpenRLHF shapes: chosen / rejected, optional prompt)."""
    eval_path: str = ""
    """Held-out pairs; empty holds out eval_fraction of train_path (a deterministic hash split)."""
    eval_fraction: float = 0.1
    prompt_key: str = "prompt"
    base_model: str = ""
    """The starting checkpoint: a local causal LM (typically the SFT policy; a fresh scalar head is
    added) or an AutoModelForSequenceClassification with num_labels = 1 (its head is kept)."""
    tokenizer_path: str = ""
    """Tokenizer dir; empty means base_model's dir."""
    chat_template: str = "auto"
    """'auto' (the tokenizer's own template when it has one, else raw prompt + response text),
    'none', or a Jinja template file: how a pair's conversations become tokens
    (rlhf/reward_model/score.py `encode_conversation`). The template in use (none for 'none') is
    saved with the tokenizer, so PPO with reward.chat_template = 'auto' encodes each rollout the
    same way (the same function); PPO applies task.system_prompt / task.instruction_suffix, so
    train with the same values in rm.system_prompt / rm.instruction_suffix."""
    system_prompt: str = ""
    instruction_suffix: str = ""

    seed: int = 0
    """Head initialisation and pair order; the same seed gives the same weights."""
    steps: int = 300
    batch_size: int = 32
    """Pairs per optimizer step."""
    micro_batch_size: int = 32
    """Pairs per forward/backward (gradients accumulate over the batch)."""
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    lr_schedule: str = "constant"
    """'constant' or 'cosine' decay after warmup."""
    max_grad_norm: float = 1.0
    use_margin: bool = False
    """Subtract each pair's 'margin' column inside the loss: -log sigmoid(r_chosen - r_rejected - margin)."""
    max_length: int = 0
    """Tokens kept per sequence (the end is kept); 0 keeps all."""
    eval_every: int = 50
    save_every: int = 100
    keep_checkpoints: int = 2
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    dtype: str = "float32"
    """'float32' or 'bfloat16' (autocast on GPU)."""
    torch_threads: int = 0
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass (transformers' gradient
    checkpointing): activation memory of about one layer instead of all, for about a third more compute."""

    def __post_init__(self) -> None:
        s = "rm"
        check(isinstance(self.train_path, str) and bool(self.train_path), "rm.train_path", self.train_path,
              "must name a JSONL or parquet file of preference pairs")
        check(isinstance(self.base_model, str) and bool(self.base_model), "rm.base_model", self.base_model,
              "must name a local checkpoint dir (a causal LM such as the SFT policy, or a sequence classifier)")
        check((Path(self.base_model) / "config.json").is_file(), "rm.base_model", self.base_model,
              "not a local model directory (no config.json)")
        number(s, "eval_fraction", self.eval_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and self.seed >= 0, "rm.seed",
              self.seed, "must be a non-negative integer")
        for name in ("steps", "batch_size", "micro_batch_size", "eval_every", "save_every"):
            positive_int(s, name, getattr(self, name))
        for name in ("warmup_steps", "max_length", "keep_checkpoints", "torch_threads"):
            positive_int(s, name, getattr(self, name), minimum=0)
        check(self.batch_size % self.micro_batch_size == 0, "rm.micro_batch_size", self.micro_batch_size,
              f"must divide rm.batch_size = {self.batch_size}")
        number(s, "learning_rate", self.learning_rate, 0.0, 1.0, lo_open=True)
        number(s, "weight_decay", self.weight_decay, 0.0, 1.0)
        number(s, "max_grad_norm", self.max_grad_norm, 0.0, 1e6)
        choice(s, "lr_schedule", self.lr_schedule, ("constant", "cosine"))
        choice(s, "device", self.device, ("auto", "cpu", "cuda"))
        choice(s, "dtype", self.dtype, ("float32", "bfloat16"))
        for name in ("use_margin", "gradient_checkpointing"):
            check(isinstance(getattr(self, name), bool), f"rm.{name}", getattr(self, name), "must be True or False")
        check(isinstance(self.chat_template, str) and bool(self.chat_template), "rm.chat_template",
              self.chat_template, "must be 'auto', 'none' or the path of a Jinja chat template file")
        if self.chat_template not in ("auto", "none"):
            check(Path(self.chat_template).is_file(), "rm.chat_template", self.chat_template,
                  "no such template file (use 'auto', 'none' or the path of a Jinja chat template)")


def check_rm_only(recipe, bindings=()) -> None:
    """The reward-model CLI reads rm.* bindings only: one for another scope (ppo.*, model.*, ...)
    would be silently ignored, so it is a ConfigError naming it (the -b binding, or file:line)."""
    from gin import config as gin_config
    from gin import config_parser

    from rlhf import configurable

    def statements():
        for text in bindings:
            try:
                for statement in config_parser.ConfigParser(text, gin_config.ParserDelegate(skip_unknown=True)):
                    yield f"-b {text.strip()!r}", statement
            except (ValueError, SyntaxError, TypeError, KeyError):  # gin reports it when it parses
                continue
        if recipe is not None and Path(recipe).is_file():
            for path, statement in configurable.iter_statements(recipe):
                yield f"{path}:{statement.location.line_num}", statement

    for where, statement in statements():
        if isinstance(statement, config_parser.BindingStatement) and statement.arg_name \
                and statement.selector != "rm":
            name = f"{statement.selector}.{statement.arg_name}"
            other = (f"; {statement.selector}.* configures PPO (python -m rlhf.train)"
                     if statement.selector in configurable.SCOPES else "")
            allowed = ", ".join(f.name for f in dataclasses.fields(RMTrainConfig))
            raise ConfigError(f"{name} ({where}) is not a reward-model binding: python -m rlhf.reward_model "
                              f"accepts rm.* bindings only{other}. Allowed: rm.{{{allowed}}}")


def resolve(recipe, bindings=()) -> tuple[RMTrainConfig, str]:
    """The validated RMTrainConfig and gin's operative config for a recipe plus `-b` bindings."""
    import gin

    from rlhf import configurable

    configurable.register_scope("rm", RMTrainConfig)
    bindings = list(bindings)
    check_rm_only(recipe, bindings)
    configurable.parse(recipe, bindings)
    try:
        cfg = gin.get_configurable("rm")()
    except ConfigError as err:
        raise ConfigError(str(err).strip().splitlines()[0]) from None
    except (TypeError, ValueError) as err:
        raise ConfigError(configurable._explain_gin_error(err)) from None
    return cfg, gin.operative_config_str()
