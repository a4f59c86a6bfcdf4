"""Every role in this process, on one device: the specs' classes built directly."""

from __future__ import annotations

from typing import List

import torch

from rlhf.gpu_monitor import DeviceMonitor
from rlhf.placement import memory
from rlhf.placement.context import DeviceContext
from rlhf.roles import RoleSpec, Roles


def build_local_roles(specs: List[RoleSpec], *, device: torch.device, autocast_dtype, controller_roles: dict,
                      log=print, memory_plan=None) -> Roles:
    ctx = DeviceContext(device, autocast_dtype)
    roles = dict(controller_roles)
    for spec in specs:
        roles[spec.name] = spec.role_class()(ctx, **spec.kwargs, **spec.extra)
    record = {"placement": "local", "world_size": 1, "device": device.type}
    if device.type == "cuda":
        role_bytes = {spec.name: memory.state_bytes(roles[spec.name]) for spec in specs}
        plan = memory.runtime_plan(specs[0].kwargs["ppo"], role_bytes, memory.device_memory(device),
                                   offload_mode=False, can_offload=False, predicted=memory_plan)
        roles["actor"].set_rollout_sleep(plan["rollout_sleep"])
        log(memory.describe(plan))
        record["memory"] = plan
    monitor = DeviceMonitor(device).start()
    return Roles(actor=roles["actor"], critic=roles.get("critic"), reference=roles.get("reference"),
                 reward=roles.get("reward"), reward_model=roles.get("reward_model"), placement=record,
                 device_report=monitor.take, close=monitor.close)
