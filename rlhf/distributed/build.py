"""Builds a run's role groups on Ray: reserve the placement group, start the hosts, build the roles."""

from __future__ import annotations

from typing import Optional

from rlhf.config import RunConfig


def build_distributed_roles(cfg: RunConfig, *, model_dir: str, tokenizer_dir: str, start_dir: str,
                            total_updates: int, autocast: bool, ray_address: Optional[str], log=print):
    import ray

    from rlhf.distributed import placement
    from rlhf.distributed.group import ActorGroup, CriticGroup, ReferenceGroup, RewardClient, RolloutGroup
    from rlhf.roles import Roles

    ppo = cfg.ppo
    placement.connect(ray_address)
    device = placement.device_type(ppo)
    model_roles = ["actor"] + (["critic"] if ppo.adv_estimator == "gae" else []) + ["reference"]
    bundles = placement.plan_bundles(ppo, model_roles, device)
    num_bundles = 1 + max(max(b) for b in bundles.values())
    pg = placement.reserve(ppo, num_bundles, device)
    colocated = ppo.resolved_placement == "colocated"
    log(f"placing {len(model_roles)} roles x {ppo.world_size} ranks ({ppo.resolved_placement}, {device}) "
        f"on {num_bundles} bundles")

    hosts, where = {}, {}
    if colocated:
        shared, shared_where = placement.start_hosts(pg, bundles["actor"], ppo, device,
                                                              offload=ppo.offload_idle_models)
        for role in model_roles:
            hosts[role], where[role] = shared, shared_where
    else:
        for role in model_roles:
            hosts[role], where[role] = placement.start_hosts(pg, bundles[role], ppo, device, offload=False)

    autocast_dtype = None
    if autocast and device == "cuda":  # as in one process: bf16 autocast on GPU only
        import torch
        autocast_dtype = torch.bfloat16
    common = dict(ppo=ppo, autocast_dtype=autocast_dtype)
    steps = []
    for role in model_roles:  # roles on different hosts build in parallel
        if role == "actor":
            kwargs = dict(start_dir=start_dir, tokenizer_dir=tokenizer_dir, total_updates=total_updates, **common)
        elif role == "critic":
            kwargs = dict(model_dir=model_dir, random_init=cfg.model.critic_init == "random",
                          total_updates=total_updates, **common)
        else:
            kwargs = dict(model_dir=model_dir, **common)
        steps.append([h.add_role.remote(role, **kwargs) for h in hosts[role]])
        if colocated:  # one process per rank: its roles build one after another anyway
            ray.get(steps[-1])
    ray.get([ref for step in steps for ref in step])
    ray.get(hosts["actor"][0].add_role.remote("reward", task=cfg.task))

    def close() -> None:
        every = {id(h): h for hs in hosts.values() for h in hs}.values()
        try:
            ray.get([h.shutdown.remote() for h in every], timeout=60)
        except Exception:  # a rank that already died has nothing left to shut down
            pass
        for h in every:
            ray.kill(h)
        ray.util.remove_placement_group(pg)

    placement_record = {
        "placement": ppo.resolved_placement, "world_size": ppo.world_size, "device": device,
        "roles": {role: where[role] for role in model_roles},
    }
    return Roles(actor=ActorGroup(hosts["actor"]),
                 critic=CriticGroup(hosts["critic"]) if "critic" in hosts else None,
                 reference=ReferenceGroup(hosts["reference"]), reward=RewardClient(hosts["actor"][0]),
                 rollout=RolloutGroup(hosts["actor"]), placement=placement_record, close=close)
