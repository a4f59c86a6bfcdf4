"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

Layout of `checkpoints/step_N/`:
  actor/            an ordinary HF checkpoint (config, model.safetensors, tokenizer) - loadable on its own
  critic.safetensors
  actor_optim.safetensors, critic_optim.safetensors   optimizer tensors
  rng.safetensors   torch CPU (and CUDA) generator states
  state.json        step, optimizer param groups and scalars, schedulers, sampler, KL controller, python RNG
A checkpoint is written to a temporary folder and renamed into place, so a kill never leaves a
half-written `step_N`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors.torch import load_file, save_file

STEP_DIR = re.compile(r"^step_(\d+)$")


def optimizer_to_flat(sd: dict) -> tuple[Dict[str, torch.Tensor], dict]:
    """An optimizer state dict as safetensors tensors and JSON scalars."""
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{key}"] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_flat(tensors: Dict[str, torch.Tensor], meta: dict) -> dict:
    state: Dict[int, dict] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def rng_state() -> tuple[Dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def restore_rng(tensors: Dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))


def list_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_root: str | Path) -> Optional[Path]:
    found = list_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def save_checkpoint(ckpt_root: str | Path, step: int, *, actor, critic, tokenizer, trainer_state: dict,
                    keep: int) -> Path:
    """`actor` / `critic` (None without a critic): trained roles, in this process or proxies of Ray
    ranks (rlhf/roles/__init__.py `TrainedState`); their states arrive in the one-process layout."""
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    (tmp / "actor").mkdir()
    for name, data in actor.model_files().items():
        (tmp / "actor" / name).write_bytes(data)
    tokenizer.save_pretrained(str(tmp / "actor"))
    state = {"step": step, "trainer": trainer_state}
    if critic is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in critic.model_state().items()},
                  str(tmp / "critic.safetensors"))
    for name, role in (("actor", actor), ("critic", critic)):
        if role is None:
            continue
        tensors, meta = optimizer_to_flat(role.optimizer_state())
        save_file(tensors, str(tmp / f"{name}_optim.safetensors"))
        state[f"{name}_optim"] = meta
        state[f"{name}_scheduler"] = {k: v for k, v in role.scheduler_state().items() if k != "lr_lambdas"}
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    state["rng"] = rng_meta
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if keep > 0:
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(ckpt: str | Path) -> dict:
    return json.loads((Path(ckpt) / "state.json").read_text())


def load_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Loads safetensors weights strictly (names and shapes must match)."""
    module.load_state_dict(load_file(str(path)), strict=True)


def restore_training(ckpt: str | Path, *, actor, critic) -> dict:
    """Loads every piece of a checkpoint into the trained roles; returns the trainer state."""
    ckpt = Path(ckpt)
    state = load_state(ckpt)
    actor_file = ckpt / "actor" / "model.safetensors"
    actor_sd = load_file(str(actor_file))
    missing, unexpected = actor.load_model_state(actor_sd, strict=False)
    # Tied weights may be stored once; anything else missing is an error.
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"checkpoint {actor_file} does not match the actor: missing {missing}, unexpected {unexpected}")
    if critic is not None:
        critic_file = ckpt / "critic.safetensors"
        missing, unexpected = critic.load_model_state(load_file(str(critic_file)), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {critic_file} does not match the critic: missing {missing}, "
                               f"unexpected {unexpected}")
    for name, role in (("actor", actor), ("critic", critic)):
        if role is None:
            continue
        role.load_optimizer_state(optimizer_from_flat(load_file(str(ckpt / f"{name}_optim.safetensors")),
                                                      state[f"{name}_optim"]))
        sched_state = role.scheduler_state()
        sched_state.update(state[f"{name}_scheduler"])
        role.load_scheduler_state(sched_state)
    restore_rng(load_file(str(ckpt / "rng.safetensors")), state["rng"])
    return state["trainer"]
