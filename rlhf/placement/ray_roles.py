"""Roles on Ray ranks: reserve the run's placement group, start the hosts (shared by every role in
colocated placement, one set per role in split placement), build each role from its spec on its
hosts, and hand the trainer a proxy per role (rlhf/placement/proxy.py)."""

from __future__ import annotations

from typing import List, Optional

from rlhf.config import RunConfig
from rlhf.gpu_monitor import merge_device_reports
from rlhf.roles import ActorRole, Roles, RoleSpec


def build_ray_roles(cfg: RunConfig, specs: List[RoleSpec], *, ray_address: Optional[str], log=print,
                    memory_plan=None) -> Roles:
    import ray

    from rlhf import memory
    from rlhf.placement import cluster
    from rlhf.placement.proxy import as_role, proxied_roles, ray_proxy

    ppo = cfg.ppo
    cluster.connect(ray_address)
    device = cluster.device_type(ppo)
    names = [s.name for s in specs]
    bundles = cluster.plan_bundles(ppo, names, device)
    num_bundles = 1 + max(max(b) for b in bundles.values())
    pg = cluster.reserve(ppo, num_bundles, device)
    colocated = ppo.resolved_placement == "colocated"
    log(f"placing {len(names)} roles x {ppo.world_size} ranks ({ppo.resolved_placement}, {device}) "
        f"on {num_bundles} bundles")

    hosts, where = {}, {}
    if colocated:
        shared, shared_where = cluster.start_hosts(pg, bundles[names[0]], ppo, device)
        for name in names:
            hosts[name], where[name] = shared, shared_where
        # Build with offloading on, so the roles never have to fit together while they are built.
        ray.get([h.set_offload.remote(device == "cuda") for h in shared])
    else:
        for name in names:
            hosts[name], where[name] = cluster.start_hosts(pg, bundles[name], ppo, device)

    built = {}
    pending = []
    for spec in specs:  # roles on different hosts build in parallel
        pending.append((spec.name, [h.add_role.remote(spec) for h in hosts[spec.name]]))
        if colocated:  # one process per rank: its roles build one after another anyway
            built[spec.name] = ray.get(pending[-1][1])
    for name, refs in pending:
        built.setdefault(name, ray.get(refs))

    proxies = {spec.name: ray_proxy(spec.name, spec.role_class(), hosts[spec.name]) for spec in specs}
    plan = None
    if device == "cuda":
        info: dict = ray.get(hosts["actor"][0].where.remote())  # pyright: ignore[reportAssignmentType]
        # The actor's process: in colocated placement every role, in split placement the actor alone.
        local_names = names if colocated else ["actor"]
        role_bytes = {name: built[name][0]["bytes"] for name in local_names}

        def set_offload(enabled: bool) -> None:
            ray.get([h.set_offload.remote(enabled) for h in shared])

        plan = memory.apply_runtime_plan(ppo, as_role(proxies["actor"], ActorRole), role_bytes, info,
                                         offload_mode=ppo.offload_idle_models, can_offload=colocated,
                                         predicted=memory_plan,
                                         set_offload=set_offload if colocated else None, log=log)

    every = list({id(h): h for hs in hosts.values() for h in hs}.values())

    def device_report() -> dict:
        return merge_device_reports(ray.get([h.device_report.remote() for h in every]))

    def freeze_heap() -> None:
        ray.get([h.freeze_heap.remote() for h in every])

    def close() -> None:
        try:
            ray.get([h.shutdown.remote() for h in every], timeout=60)
        except Exception:  # a rank that already died has nothing left to shut down
            pass
        for h in every:
            ray.kill(h)
        ray.util.remove_placement_group(pg)

    record = {"placement": ppo.resolved_placement, "world_size": ppo.world_size, "device": device,
              "roles": {name: where[name] for name in names},
              "role_bytes": {name: [b["bytes"] for b in built[name]] for name in names}}
    if plan is not None:
        record["memory"] = plan
    return proxied_roles(proxies, placement=record, device_report=device_report, close=close,
                         freeze_heap=freeze_heap)
