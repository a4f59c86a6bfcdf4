"""What a run starts from, checked from its files before any weights load: the adapters of a LoRA
start (`ppo.init_from`) and the policy's position limit (its config.json). `RunConfig` runs both
when it is built (passing itself, or its `ppo`), so a bad start is one line naming the binding,
before any compute."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf.errors import ConfigError


def check_adapter_starts(ppo) -> None:
    """A LoRA start (`ppo.init_from` holding adapters) continues each adapter only at the rank and
    lora_alpha it was trained with: another alpha rescales the saved update (lora_alpha / rank), so
    the starting model would not be the checkpoint's. Read from adapter_config.json, before any model loads."""
    roles = [("actor", ppo.lora_rank, "ppo.lora_rank")]
    if ppo.uses_critic:
        roles.append(("critic", ppo.resolved_critic_lora_rank, "ppo.critic_lora_rank"))
    for role, rank, binding in roles:
        path = Path(ppo.init_from) / role / "adapter_config.json"
        if not rank or not path.is_file():
            continue  # full fine-tuning merges a LoRA start; a full start under LoRA is refused when it loads
        try:
            saved = json.loads(path.read_text())
            saved_rank, saved_alpha = int(saved["r"]), float(saved["lora_alpha"])
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ConfigError(f"ppo.init_from = {ppo.init_from!r} is invalid: {path} is not a readable peft adapter "
                              f"config ({err}); start from an intact LoRA checkpoint") from None
        if saved_rank != rank:
            raise ConfigError(f"{binding} = {rank} is invalid: ppo.init_from's adapter {path.parent} has rank "
                              f"{saved_rank}; set {binding} = {saved_rank}")
        if saved_alpha != float(ppo.lora_alpha):
            raise ConfigError(f"ppo.lora_alpha = {ppo.lora_alpha:g} is invalid: ppo.init_from's adapter {path.parent} "
                              f"was trained with lora_alpha {saved_alpha:g} (its update is scaled by lora_alpha / "
                              f"rank); set ppo.lora_alpha = {saved_alpha:g}")


TINY_MAX_POSITIONS = 256
"""max_position_embeddings of the embedded default (rlhf/tiny.py)."""
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def model_position_limit(cfg) -> tuple:
    """(the policy's longest sequence, where that number comes from), or (None, None) when its
    config does not say; read from the start checkpoint's config.json without loading the model."""
    if cfg.ppo.init_from and (Path(cfg.ppo.init_from) / "actor" / "config.json").is_file():
        path = Path(cfg.ppo.init_from) / "actor" / "config.json"
    elif cfg.model.name_or_path == "tiny":
        return TINY_MAX_POSITIONS, "the tiny default's max_position_embeddings"
    else:
        path = Path(cfg.model.name_or_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    for key in POSITION_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key], f"{key} in {path}"
    return None, None


def check_machine(device: str, rollout_backend: str = "hf", vllm_own_process: bool = False,
                  vllm_model_runner: str = "auto") -> None:
    """What a run asks of the machine it computes on, before anything loads: a visible CUDA device
    for `ppo.device = 'cuda'`, the vllm package for `ppo.rollout_backend = 'vllm'`, and an environment
    that does not contradict `ppo.vllm_own_process` or `ppo.vllm_model_runner`. A ConfigError of one line
    naming the binding and the alternative."""
    import importlib.util

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("ppo.device = 'cuda' needs a GPU and this machine shows none (torch.cuda.is_available() is "
                          "False); run it on a GPU machine, or on the CPU with ppo.device = 'cpu', "
                          "ppo.rollout_backend = 'hf', ppo.dtype = 'float32'")
    if rollout_backend == "vllm":
        from rlhf.rollout.vllm import environment_conflict
        conflict = environment_conflict(vllm_own_process, vllm_model_runner)
        if conflict is not None:
            raise ConfigError(conflict)
    if rollout_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("ppo.rollout_backend = 'vllm' needs the vllm package, which is not installed here "
                          "(`pip install -e '.[vllm]'` on a GPU machine); or use ppo.rollout_backend = 'hf'")
