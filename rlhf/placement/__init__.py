"""Placement is a strategy that takes any role (rlhf/roles/): the same `RoleSpec`s are built

    in this process  (`ppo.placement = 'local'`, rlhf/placement/local.py), or
    on Ray ranks     (`'colocated'`: every role's rank r shares one process; `'split'`: each role
                      has processes of its own; rlhf/placement/ray_roles.py), sharded with FSDP2
                      over gloo (CPU) or NCCL (GPU) when there is more than one rank.

Either way the trainer calls each device role through a proxy built from its `@dispatch`
declarations (rlhf/placement/proxy.py), which spreads and collects a call the same way in both,
typed as the role's protocol (rlhf/roles/__init__.py), so the type checker checks each call.
Roles without a model (the rule reward) run in the controller's process in every placement.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import torch

from rlhf.config import RunConfig
from rlhf.placement.context import DeviceContext
from rlhf.roles import Roles, RoleSpec


def role_specs(cfg: RunConfig, *, model_dir: Path, tokenizer_dir: Path, start_dir: Path, tokenizer=None,
               log=print) -> List[RoleSpec]:
    """The run's device roles in build order (actor, reference, critic: the single-process seeding order)."""
    ppo = cfg.ppo
    updates_per_step = ppo.ppo_epochs * (ppo.rollout_batch_size // ppo.mini_batch_size)
    total_updates = ppo.total_steps * updates_per_step
    specs = [
        RoleSpec("actor", "rlhf.roles.actor:Actor",
                 dict(ppo=ppo, start_dir=str(start_dir), tokenizer_dir=str(tokenizer_dir), total_updates=total_updates,
                      model_dir=str(model_dir)),
                 extra=dict(tokenizer=tokenizer, log=log) if tokenizer is not None else {}),
    ]
    if not ppo.lora_rank:  # with LoRA the reference is the actor's base, its adapter off (AdapterOffReference)
        specs.append(RoleSpec("reference", "rlhf.roles.reference:Reference", dict(ppo=ppo, model_dir=str(model_dir))))
    if ppo.uses_critic:
        specs.append(RoleSpec("critic", "rlhf.roles.critic:Critic",
                              dict(ppo=ppo, model_dir=str(model_dir), random_init=cfg.model.critic_init == "random",
                                   total_updates=total_updates)))
    if cfg.reward.uses_model:
        from rlhf.roles.reward_model import check_reward_model
        # In this process: a bad checkpoint is one line, before any rank starts.
        check_reward_model(cfg.reward, cfg.task)
        specs.append(RoleSpec("reward_model", "rlhf.roles.reward_model:RewardModel",
                              dict(reward=cfg.reward, task=cfg.task, policy_tokenizer_dir=str(tokenizer_dir)),
                              extra=dict(policy_tokenizer=tokenizer, log=log) if tokenizer is not None else {}))
    return specs


def build_roles(cfg: RunConfig, *, model_dir: Path, tokenizer_dir: Path, tokenizer, start_dir: Path,
                device: torch.device, autocast_dtype, ray_address: Optional[str] = None, log=print,
                memory_plan=None) -> Roles:
    """`memory_plan`: the run's predicted plan (rlhf/memory/plan.py), whose activations the
    offload / sleep decision keeps room for."""
    from rlhf.roles.reward import Reward
    controller = DeviceContext(torch.device("cpu"))
    if cfg.ppo.resolved_placement == "local":
        from rlhf.placement.local import build_local_roles
        specs = role_specs(cfg, model_dir=model_dir, tokenizer_dir=tokenizer_dir, start_dir=start_dir,
                           tokenizer=tokenizer, log=log)
        roles = build_local_roles(specs, device=device, autocast_dtype=autocast_dtype, log=log, memory_plan=memory_plan)
    else:
        from rlhf.placement.ray_roles import build_ray_roles
        specs = role_specs(cfg, model_dir=model_dir, tokenizer_dir=tokenizer_dir, start_dir=start_dir)
        roles = build_ray_roles(cfg, specs, ray_address=ray_address, log=log, memory_plan=memory_plan)
    # The reward phase runs in the controller (normalisation sees the whole batch); the reward
    # model it calls is a device role like the reference.
    roles.reward = Reward(controller, cfg.task, cfg.reward, roles.reward_model)
    return roles
