"""Checkpoints without pickle: tensors in safetensors, everything else in JSON.

Layout of `checkpoints/step_N/`:
  actor/            an ordinary HF checkpoint (config, model.safetensors, tokenizer) - loadable on its own;
                    with LoRA, peft's adapter (adapter_config.json, adapter_model.safetensors, tokenizer),
                    loadable with `PeftModel.from_pretrained(base, 'actor')`
  critic.safetensors, or with LoRA critic/ (peft's adapter of the backbone, value_head.safetensors)
  actor_optim.safetensors, critic_optim.safetensors   optimizer tensors
  rng.safetensors   torch CPU (and CUDA) generator states, numpy's global generator keys
  state.json        step, optimizer param groups and scalars, schedulers, sampler, KL controller, python and numpy RNG
  manifest.json     size and sha256 of every other file, written last
A checkpoint is written to a temporary folder and renamed into place, so a kill never leaves a
half-written `step_N`. A checkpoint damaged later (a truncated copy, a full disk, bit rot) fails
`verify_checkpoint` against its manifest; `latest_checkpoint` then skips it, saying why, and
returns the newest intact one, and a resume moves the damaged ones aside (`corrupt-step_N`) so
no retry trusts them again. A write that fails (a full disk) removes its temporary folder and
raises `DiskFull`, one line naming the newest intact checkpoint that `--resume` continues from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, Optional

from rlhf.atomic import unwritten_path
from rlhf.errors import is_disk_full

if TYPE_CHECKING:  # annotations only
    import torch

    from rlhf.roles import TrainedState

# torch and safetensors load inside the functions that need them: verifying and listing checkpoints
# (the experiment manager does it for every run of a study) stays light.


STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
CORRUPT_PREFIX = "corrupt-"


def optimizer_to_flat(sd: dict) -> tuple[Dict[str, torch.Tensor], dict]:
    """An optimizer state dict as safetensors tensors and JSON scalars."""
    import torch
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
    """The process's random generators: torch's CPU (and CUDA) states and numpy's global MT19937 keys
    as tensors; Python's state and the rest of numpy's as JSON."""
    import numpy as np
    import torch
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    tensors["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))  # int64 holds the uint32 keys exactly
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss],
                     "numpy": [kind, int(pos), int(has_gauss), float(cached_gaussian)]}


def restore_rng(tensors: Dict[str, torch.Tensor], meta: dict) -> None:
    import numpy as np
    import torch
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    kind, pos, has_gauss, cached_gaussian = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(ckpt: str | Path) -> dict:
    """Records the size and sha256 of every file of a checkpoint dir in its manifest.json."""
    root = Path(ckpt)
    files = {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
    manifest = {"format": 1, "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify_checkpoint(ckpt: str | Path, full: bool = True, only: Optional[str] = None) -> Optional[str]:
    """None when the checkpoint is intact, else why not (one line). Checks every file of the
    manifest: present, of the recorded size and (`full`) of the recorded sha256; sizes alone catch
    a truncated or partly copied file in a few stat calls. The engine writes the manifest with every
    checkpoint, so one without it is damaged. `only`: a subdirectory ('actor'): only its files are
    checked (what an export reads)."""
    root = Path(ckpt)
    if not (root / "state.json").is_file():
        return "no state.json"
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return f"no {MANIFEST}"
    try:
        files = json.loads(manifest_path.read_text())["files"]
        if only is not None:
            files = {rel: meta for rel, meta in files.items() if rel.startswith(f"{only}/")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"unreadable {MANIFEST} ({type(err).__name__})"
    for rel, meta in files.items():
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{rel} has {size} bytes, the manifest says {meta['size']}"
    if full:
        for rel, meta in files.items():
            if _sha256(root / rel) != meta["sha256"]:
                return f"{rel} does not match its sha256 in the manifest"
    return None


def unreadable_safetensors(paths, what: Callable[[Path], str]) -> Optional[str]:
    """'`what(path)` (safetensors' reason)' for the first of `paths` whose header does not read (a
    truncated or damaged file), else None. Reads headers only."""
    from safetensors import SafetensorError, safe_open
    for path in paths:
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError, ValueError) as err:
            return f"{what(path)} ({str(err).splitlines()[0][:120]})"
    return None


def latest_checkpoint(ckpt_root: str | Path, full: bool = True,
                      log: Optional[Callable[[str], None]] = None,
                      skipped: Optional[list] = None) -> Optional[Path]:
    """The newest intact `step_N` under `ckpt_root`, or None. A damaged one is skipped, logged
    (`log`) with the reason, and appended to `skipped` as (path, reason). `full=False` checks the
    manifest's sizes only (fast enough to ask for every run of a study)."""
    for _, path in reversed(list_checkpoints(ckpt_root)):
        reason = verify_checkpoint(path, full=full)
        if reason is None:
            return path
        if log is not None:
            log(f"checkpoint {path} is damaged ({reason}): skipped")
        if skipped is not None:
            skipped.append((path, reason))
    return None


def quarantine(ckpt: str | Path) -> Path:
    """Moves a damaged checkpoint aside (`corrupt-step_N`): no later lookup or retry trusts it,
    and it stays on disk to be looked at."""
    ckpt = Path(ckpt)
    target = ckpt.with_name(CORRUPT_PREFIX + ckpt.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(ckpt, target)
    return target


def resume_checkpoint(ckpt_root: str | Path, log: Callable[[str], None]) -> Optional[Path]:
    """`--resume`: the newest intact checkpoint under `ckpt_root`, or None. Damaged newer ones are
    reported (`log`) and moved aside, so that no later retry resumes into them."""
    skipped: list = []
    found = latest_checkpoint(ckpt_root, full=True, skipped=skipped)
    for path, reason in skipped:
        moved = quarantine(path)
        log(f"--resume: skipped damaged checkpoint {path} ({reason}); moved to {moved}")
    if skipped and found is not None:
        log(f"--resume: resuming from {found}, the newest intact checkpoint")
    return found


def damaged_weights(model_dir: str | Path) -> Optional[str]:
    """None when every safetensors file of a model directory reads (header present and the file as
    long as the header says; the shards an index names present), else which one does not (one line).
    Reads headers only."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{index.name} is unreadable ({type(err).__name__})"
        for name in shards:
            if not (root / name).is_file():
                return f"{name} is missing (named by {index.name})"
    return unreadable_safetensors(sorted(root.glob("*.safetensors")), lambda p: f"{p} is truncated or damaged")


def check_weights(model_dir: str | Path, binding: str) -> None:
    """A ConfigError naming the file when a model directory's weights are damaged (a truncated copy)."""
    from rlhf.errors import ConfigError
    reason = damaged_weights(model_dir)
    if reason is not None:
        raise ConfigError(f"{binding} = {str(model_dir)!r}: {reason}; copy or write the checkpoint again")


START_FIX = "start from an intact checkpoint (another step_N, or the run's --resume)"


def check_start_checkpoint(ckpt: str | Path, binding: str = "ppo.init_from", *, only: Optional[str] = None,
                           fix: str = START_FIX) -> None:
    """A start checkpoint is verified as `--resume` verifies one: against its manifest (sizes and
    sha256), or, without one, by reading its safetensors headers. A ConfigError naming the damaged
    file (`binding`: what named `ckpt`; `fix`: what to do instead). `only`: a subdirectory ('actor')
    whose files alone are read later, so alone verified (an export of the policy)."""
    from rlhf.errors import ConfigError
    ckpt = Path(ckpt)
    if (ckpt / MANIFEST).is_file():
        reason = verify_checkpoint(ckpt, full=True, only=only)
        if reason is not None:
            raise ConfigError(f"{binding} = {str(ckpt)!r} is damaged: {reason}; {fix}")
        return
    for sub in ((ckpt / only,) if only is not None else (ckpt / "actor", ckpt / "critic", ckpt)):
        reason = damaged_weights(sub) if sub.is_dir() else None
        if reason is not None:
            raise ConfigError(f"{binding} = {str(ckpt)!r}: {reason}; {fix}")


# ------------------------------------------------------------------ a full disk
class DiskFull(RuntimeError):
    """A write ran out of space; its temporary files are gone and finished checkpoints are untouched."""


def disk_full_message(err: BaseException, out: str | Path) -> Optional[str]:
    """The one line a CLI prints for a full disk under run dir `out` (None for any other error)."""
    if isinstance(err, DiskFull):
        return str(err)
    if not is_disk_full(err):
        return None
    path = unwritten_path(err)
    where = f" writing {path}" if path else ""
    latest = latest_checkpoint(Path(out) / "checkpoints", full=False)
    return (f"disk full{where} under --out {str(out)!r} (No space left on device): free space, then --resume "
            f"continues from {latest if latest is not None else 'step 0 (no checkpoint was written)'}")


@contextlib.contextmanager
def writing(tmp: Path, what: str) -> Iterator[Path]:
    """A checkpoint written into the temporary folder `tmp`: if the write fails, `tmp` is removed; a
    full disk becomes `DiskFull`, naming the newest intact checkpoint beside it."""
    try:
        yield tmp
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(err):
            latest = latest_checkpoint(tmp.parent, full=False)
            raise DiskFull(f"disk full: cannot write {what} (No space left on device; nothing half-written is "
                           f"left); free space, then --resume continues from "
                           f"{latest if latest is not None else 'step 0 (no checkpoint was written)'}") from None
        raise


def save_checkpoint(ckpt_root: str | Path, step: int, *, actor: TrainedState, critic: Optional[TrainedState], tokenizer,
                    trainer_state: dict, keep: int) -> Path:
    """`actor` / `critic` (None without a critic): trained roles, in this process or proxies of Ray
    ranks (rlhf/roles/__init__.py `TrainedState`); their states arrive in the one-process layout."""
    from safetensors.torch import save_file
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(tmp, f"checkpoint {final}"):
        tmp.mkdir()
        for role in (actor, critic):
            for rel, data in (role.model_files().items() if role is not None else ()):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(data)
        tokenizer.save_pretrained(str(tmp / "actor"))
        state = {"step": step, "trainer": trainer_state}
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
        write_manifest(tmp)
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
    from safetensors.torch import load_file
    module.load_state_dict(load_file(str(path)), strict=True)


def has_critic(ckpt: str | Path) -> bool:
    return (Path(ckpt) / "critic.safetensors").is_file() or (Path(ckpt) / "critic" / "value_head.safetensors").is_file()


def read_trained_state(ckpt: str | Path, role: str) -> Dict[str, "torch.Tensor"]:
    """The trained weights of `role` ('actor' or 'critic') in a checkpoint, keyed like the role's
    model parameters: the full model, or of a LoRA model its adapters (peft's file names mapped back
    to the model's) and the critic's value head."""
    from safetensors.torch import load_file

    from rlhf.models import ADAPTER_WEIGHTS, parameter_name_from_adapter_file
    ckpt = Path(ckpt)
    adapter = ckpt / role / ADAPTER_WEIGHTS
    if not adapter.is_file():
        return load_file(str(ckpt / "actor" / "model.safetensors" if role == "actor" else ckpt / "critic.safetensors"))
    prefix = "backbone." if role == "critic" else ""
    state = {prefix + parameter_name_from_adapter_file(k): v for k, v in load_file(str(adapter)).items()}
    if role == "critic":
        state.update(load_file(str(ckpt / "critic" / "value_head.safetensors")))
    return state


def restore_training(ckpt: str | Path, *, actor: TrainedState, critic: Optional[TrainedState]) -> dict:
    """Loads every piece of a checkpoint into the trained roles; returns the trainer state."""
    from safetensors.torch import load_file
    ckpt = Path(ckpt)
    state = load_state(ckpt)
    missing, unexpected = actor.load_model_state(read_trained_state(ckpt, "actor"), strict=False)
    # Tied weights may be stored once; anything else missing is an error.
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"checkpoint {ckpt / 'actor'} does not match the actor: missing {missing}, "
                           f"unexpected {unexpected}")
    if critic is not None:
        missing, unexpected = critic.load_model_state(read_trained_state(ckpt, "critic"), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"the critic of checkpoint {ckpt} does not match the critic: missing {missing}, "
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
