"""The Ray actor of one rank: it joins its group's torch.distributed world and hosts roles.

In colocated placement one host per bundle holds the actor, critic and reference ranks (one
process, one CUDA context, one world per rank index); in split placement each role has hosts of
its own. `call(role, method, ...)` runs a role's method; in colocated placement on GPU the
other roles' models are first moved to CPU, so only the role at work holds device memory.
"""

from __future__ import annotations

import os
import socket
from typing import Dict

import torch
import torch.distributed as dist

ROLE_CLASSES = {
    "actor": ("rlhf.distributed.actor", "ActorRole"),
    "critic": ("rlhf.distributed.critic", "CriticRole"),
    "reference": ("rlhf.distributed.reference", "ReferenceRole"),
    "reward": ("rlhf.workers.reward", "RewardWorker"),
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RankHost:
    def __init__(self, rank: int, world_size: int, device_type: str, threads: int, offload: bool):
        self.rank = rank
        self.world_size = world_size
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so the rank's GPU is the current
        # device (index 0); a caller that placed the process with torch.cuda.set_device keeps it.
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        if threads:
            torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        import transformers
        transformers.utils.logging.disable_progress_bar()
        self.offload = offload and device_type == "cuda"
        self.roles: Dict[str, object] = {}
        self.active = None  # the role whose model is on the device (colocated offloading)
        self.ranks = None

    def where(self) -> dict:
        """Where this rank runs, and a free port (used when it is rank 0 of its world)."""
        import ray
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "port": free_port(),
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "") if self.device.type == "cuda" else "cpu"}

    def init_world(self, master_addr: str, master_port: int) -> None:
        """Joins the world of this rank index (blocks until every rank has joined)."""
        from rlhf.distributed.ranks import ProcessGroupRanks
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size)
        self.ranks = ProcessGroupRanks(self.rank, self.world_size, self.device)

    def add_role(self, name: str, **kwargs) -> None:
        import importlib
        module, cls = ROLE_CLASSES[name]
        role_cls = getattr(importlib.import_module(module), cls)
        if name == "reward":  # a rule function: no model, no ranks
            self.roles[name] = role_cls(**kwargs)
            return
        self.roles[name] = role_cls(self.ranks, self.device, **kwargs)
        self._activate(name)  # the role built last is on the device; the others go to CPU

    def _activate(self, role: str) -> None:
        if not self.offload or not hasattr(self.roles[role], "onload"):
            return
        for name, other in self.roles.items():
            if name != role and hasattr(other, "offload"):
                other.offload()
        self.roles[role].onload()
        self.active = role
        torch.cuda.empty_cache()

    def call(self, role: str, method: str, *args, **kwargs):
        if self.active != role:
            self._activate(role)
        return getattr(self.roles[role], method)(*args, **kwargs)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
