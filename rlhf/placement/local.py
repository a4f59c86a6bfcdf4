"""Every role in this process, on one device: the specs' classes built directly, each called through
a proxy of one rank (rlhf/placement/proxy.py `local_proxy`), so a call is spread and collected as
its `@dispatch` declaration says, exactly as on Ray ranks."""

from __future__ import annotations

from typing import List

import torch

from rlhf import memory
from rlhf.gpu_monitor import DeviceMonitor
from rlhf.placement.context import DeviceContext
from rlhf.placement.proxy import as_role, local_proxy, proxied_roles
from rlhf.roles import ActorRole, Roles, RoleSpec


def build_local_roles(specs: List[RoleSpec], *, device: torch.device, autocast_dtype, log=print,
                      memory_plan=None) -> Roles:
    ctx = DeviceContext(device, autocast_dtype)
    built = {spec.name: spec.role_class()(ctx, **spec.kwargs, **spec.extra) for spec in specs}
    roles = {name: local_proxy(name, [role]) for name, role in built.items()}
    record = {"placement": "local", "world_size": 1, "device": device.type}
    if device.type == "cuda":
        role_bytes = {name: memory.state_bytes(role) for name, role in built.items()}
        record["memory"] = memory.apply_runtime_plan(specs[0].kwargs["ppo"], as_role(roles["actor"], ActorRole),
                                                     role_bytes, memory.device_memory(device), offload_mode=False,
                                                     can_offload=False, predicted=memory_plan, log=log)
    monitor = DeviceMonitor(device).start()
    return proxied_roles(roles, placement=record, device_report=monitor.take, close=monitor.close)
