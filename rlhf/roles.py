"""The role factory: the trainer's actor, critic, reference, reward and rollout, built either in
this process (`ppo.placement = 'local'`) or as groups of ranks on Ray (`rlhf/distributed/`).

Both kinds answer the same methods (compute_logprobs, compute_values, update, score, generate,
sync_weights), so the PPO loop is the same loop either way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from rlhf import checkpoint
from rlhf.batch import Batch
from rlhf.config import RunConfig
from rlhf.models import ValueModel, load_policy
from rlhf.rollout import SamplingParams, build_rollout, derive_seed, rollout_options
from rlhf.workers.actor import ActorWorker
from rlhf.workers.critic import CriticWorker
from rlhf.workers.reference import ReferenceWorker
from rlhf.workers.reward import RewardWorker


@dataclasses.dataclass
class Roles:
    actor: object
    critic: Optional[object]
    reference: object
    reward: object
    rollout: object
    placement: dict
    """Where each role runs (recorded in provenance.json)."""
    close: Callable[[], None] = lambda: None


def build_roles(cfg: RunConfig, *, model_dir: Path, tokenizer_dir: Path, tokenizer, start_dir: Path,
                device: torch.device, autocast_dtype, ray_address: Optional[str] = None, log=print) -> Roles:
    ppo = cfg.ppo
    updates_per_step = ppo.ppo_epochs * (ppo.rollout_batch_size // ppo.mini_batch_size)
    total_updates = ppo.total_steps * updates_per_step
    if ppo.resolved_placement != "local":
        from rlhf.distributed.build import build_distributed_roles
        return build_distributed_roles(cfg, model_dir=str(model_dir), tokenizer_dir=str(tokenizer_dir),
                                       start_dir=str(start_dir), total_updates=total_updates,
                                       autocast=ppo.dtype == "bfloat16", ray_address=ray_address, log=log)
    torch.manual_seed(ppo.seed)
    actor_model = load_policy(start_dir).to(device)
    ref_model = load_policy(model_dir).to(device)
    actor = ActorWorker(actor_model, ppo, device, total_updates, autocast_dtype)
    reference = ReferenceWorker(ref_model, device, ppo.temperature, ppo.micro_batch_size, autocast_dtype)
    critic = None
    if ppo.adv_estimator == "gae":
        critic_model = ValueModel.from_policy_checkpoint(
            model_dir, seed=derive_seed(ppo.seed, 1), random_init=cfg.model.critic_init == "random")
        if ppo.init_from and (Path(ppo.init_from) / "critic.safetensors").is_file():
            checkpoint.load_weights(critic_model, Path(ppo.init_from) / "critic.safetensors")
        critic = CriticWorker(critic_model.to(device), ppo, device, total_updates, autocast_dtype)
    rollout = build_rollout(ppo.rollout_backend, actor_model, tokenizer, device, model_dir=str(start_dir),
                            seed=ppo.seed, max_model_len=ppo.max_prompt_length + ppo.max_response_length,
                            **rollout_options(ppo, device))
    return Roles(actor=actor, critic=critic, reference=reference, reward=RewardWorker(cfg.task), rollout=rollout,
                 placement={"placement": "local", "world_size": 1, "device": device.type})


def generate_calls(rollout, requests: Sequence[Tuple[List[str], int]], sampling: SamplingParams) -> List[Batch]:
    """One generation call per (prompts, seed), in order; a rollout group runs them on its ranks at once."""
    if hasattr(rollout, "generate_calls"):
        return rollout.generate_calls(requests, sampling)
    return [rollout.generate(prompts, sampling, seed) for prompts, seed in requests]
