"""The Ray actor of one rank: it joins its group's torch.distributed world and hosts roles.

In colocated placement one host per bundle holds the rank of every model role (one process, one
CUDA context, one world per rank index); in split placement each role has hosts of its own.
`call(role, method, ...)` runs a role's method; what it returns leaves the rank on the host
(`to_host`), so the controller, which holds no device, never rebuilds a tensor on the GPU. With
offloading on (rlhf/memory/runtime.py decides), the other roles' device state is first moved to
pinned host memory, so only the role at work holds device memory.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from rlhf import memory
from rlhf.batch import Batch
from rlhf.determinism import deterministic_algorithms
from rlhf.metrics import PHASE_KEYS
from rlhf.placement.context import ProcessGroupRanks, context_for
from rlhf.profiling import PhaseClock
from rlhf.roles import PlacedRole


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def to_host(value: Any) -> Any:
    """`value` with every tensor in it on the host: a role's result on its way back through Ray.
    Ray rebuilds a CUDA tensor on the receiver's GPU, so a device tensor in a result (a one-rank
    optimizer state is one: `optimizer.state_dict()` holds the live moments) would give the
    controller a CUDA context of its own and the tensors' bytes on the device the ranks plan for,
    kept by its caching allocator for the rest of the run. Host tensors come back as they are."""
    if isinstance(value, (torch.Tensor, Batch)):
        return value.to("cpu")
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(to_host(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_host(v) for v in value)
    return value


class RankHost:
    def __init__(self, rank: int, world_size: int, device_type: str, threads: int, bf16: bool):
        self.rank = rank
        self.world_size = world_size
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES, so the rank's GPU is the current
        # device (index 0); a caller that placed the process with torch.cuda.set_device keeps it.
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        if threads:
            torch.set_num_threads(threads)
        deterministic_algorithms(device_type)
        import transformers
        transformers.utils.logging.disable_progress_bar()
        self.autocast_dtype = torch.bfloat16 if bf16 and device_type == "cuda" else None
        self.roles: Dict[str, PlacedRole] = {}
        self.offloader: Optional[memory.Offloader] = None
        self.ranks = None
        from rlhf.gpu_monitor import DeviceMonitor, PhaseMemory
        self.monitor = DeviceMonitor(self.device).start()
        self.phase_memory = PhaseMemory(self.device, off_device=self._rollout_asleep_bytes)
        self.phase_clock = PhaseClock()

    def where(self) -> dict:
        """Where this rank runs, and a free port (used when it is rank 0 of its world)."""
        import ray
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "port": free_port(),
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "") if self.device.type == "cuda" else "cpu",
                **memory.device_memory(self.device)}

    def init_world(self, master_addr: str, master_port: int) -> None:
        """Joins the world of this rank index (blocks until every rank has joined)."""
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
                                world_size=self.world_size)
        self.ranks = ProcessGroupRanks(self.rank, self.world_size, self.device)

    def add_role(self, spec) -> dict:
        """Builds a role (a `RoleSpec`) on this rank; returns the bytes its device state takes."""
        ctx = context_for(self.device, self.autocast_dtype, self.ranks)
        role = spec.role_class()(ctx, **spec.kwargs)
        self.roles[spec.name] = role
        if self.offloader is not None:
            self.offloader.activate(spec.name)  # the role built last is on the device
        return {"role": spec.name, "bytes": memory.state_bytes(role)}

    def set_offload(self, enabled: bool) -> None:
        """Offload idle roles between phases from now on (or keep every role resident)."""
        if enabled and self.device.type == "cuda":
            self.offloader = memory.Offloader(self.roles, self.device)
        elif self.offloader is not None:
            self.offloader.restore_all()
            self.offloader = None

    def call(self, role: str, method: str, *args, **kwargs):
        return self.call_in_phase(None, role, method, *args, **kwargs)

    def call_in_phase(self, phase: Optional[str], role: str, method: str, *args, **kwargs):
        """`role.method(*args, **kwargs)`, its time and memory measured as the controller's phase
        `phase` (None: outside any phase), and the cache it leaves given back, as the local placement
        does. The result comes back on the host (`to_host`)."""
        with self.phase_clock.measure(phase), self.phase_memory.measure(phase):
            if self.offloader is not None:
                self.offloader.activate(role)
            return to_host(getattr(self.roles[role], method)(*args, **kwargs))

    def _rollout_asleep_bytes(self) -> int:
        """What torch counts of this rank's sleeping rollout engine but the device does not hold."""
        actor = self.roles.get("actor")
        asleep = getattr(actor, "rollout_asleep_bytes", None)  # the actor's rank, where this host holds one
        return asleep() if asleep is not None else 0

    def device_report(self) -> dict:
        """The step's utilisation and peak memory here, each phase's (`PhaseMemory.take`: the peaks
        are reset at each call, so the step's is the largest phase's) and the time each phase's calls
        ran here and kept this host busy (`PhaseClock.take`)."""
        report = self.monitor.take()
        phases = self.phase_memory.take()
        if phases:
            peak = max(v for k, v in phases.items() if k.startswith(PHASE_KEYS[0]))
            report["perf/max_memory_allocated_gb"] = max(report.get("perf/max_memory_allocated_gb", 0.0), peak)
        report.update(phases)
        report.update(self.phase_clock.take())
        return report

    def freeze_heap(self) -> int:
        """This rank's long-lived heap out of the collector's passes (rlhf/heap.py)."""
        from rlhf import heap
        return heap.freeze()

    def shutdown(self) -> None:
        self.monitor.close()
        if dist.is_initialized():
            dist.destroy_process_group()
