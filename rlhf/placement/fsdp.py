"""FSDP2 for the engine's models: sharding and full state dicts (moving idle roles off the device
between phases is `memory.Offloader`'s, which moves FSDP2 modules with their own `.to()`).

Everything here runs on every rank of a group at once (the gathers are collectives).
Checkpoints stay in the single-process format: full state dicts keyed like the unsharded model,
optimizer state keyed by parameter index in `model.parameters()` order (what
`torch.optim.Optimizer.state_dict()` gives in one process), so `--resume` and `ppo.init_from`
work across world sizes.
"""

from __future__ import annotations

from typing import Any, Dict, List, cast

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def layer_class_names(model: torch.nn.Module) -> set:
    """The transformer block classes, as HF models name them in `_no_split_modules`."""
    names = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or [])
    return names


def shard(model: torch.nn.Module, device_type: str, world_size: int) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, heads).

    Per-layer units bound peak memory to one gathered layer at a time during forward/backward."""
    mesh = init_device_mesh(device_type, (world_size,))
    blocks = layer_class_names(model)
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_model_state(model: torch.nn.Module, rank0_cpu: bool) -> Dict[str, torch.Tensor]:
    """The unsharded state dict. rank0_cpu: only rank 0 gets it, on CPU (checkpoints); otherwise
    every rank gets it on its device (weight sync into the rollout replica)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_cpu))
    return cast(Dict[str, torch.Tensor], state)


def load_full_model_state(model: torch.nn.Module, state: Dict[str, torch.Tensor], strict: bool):
    """Loads an unsharded state dict (given to every rank); returns (missing, unexpected) keys."""
    return set_model_state_dict(model, cast(Dict[str, Any], state),
                                options=StateDictOptions(full_state_dict=True, strict=strict))


def parameter_names(model: torch.nn.Module) -> List[str]:
    """Names of the trained parameters in `model.parameters()` order: the index order of a
    one-process optimizer state (a LoRA model's frozen base is not in its optimizer)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The unsharded optimizer state in the one-process layout (on rank 0; {} elsewhere)."""
    sd = cast(dict, get_optimizer_state_dict(model, optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if not sd:
        return {}
    index = {name: i for i, name in enumerate(parameter_names(model))}
    return {"state": {index[name]: dict(state) for name, state in sd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]}


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Loads a one-process optimizer state (given to every rank), sharding it like the parameters."""
    names = parameter_names(model)
    keyed = {"state": {names[int(i)]: state for i, state in sd["state"].items()},
             "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in sd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, keyed, options=StateDictOptions(full_state_dict=True))

