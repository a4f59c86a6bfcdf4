"""Whether a study's runs fit their GPU, checked at planning rather than found out by a run.

Runs that share a GPU (`study.gpus_per_run` < 1) with vLLM rollouts must fit their vLLM engines
in their shares, and a run's predicted memory (rlhf/memory/) must fit its GPU or its
share of one. Both are refused with one line giving the numbers and the bindings that would make
the run fit. The GPU is this machine's, read through torch (imported only when a check needs it),
taken as the kind the runs get; without one only the share arithmetic applies, and the engine
checks again when a run starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from experiments.errors import StudyError
from experiments.study import Study
from rlhf.errors import ConfigError


def _weights_gib(model_path: str) -> Optional[float]:
    """The size of a local checkpoint's weight files (what vLLM loads), None when unknown."""
    root = Path(model_path)
    if not root.is_dir():
        return None
    files = list(root.glob("*.safetensors")) or list(root.glob("*.bin"))
    return sum(f.stat().st_size for f in files) / 2**30 if files else None


def _gpu_memory_gib() -> Optional[float]:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30
    except Exception:  # noqa: BLE001 - no GPU here: the share check alone applies
        pass
    return None


VLLM_SHARED_BUDGET = 0.9
"""The fraction of a GPU's memory the vLLM engines of the runs sharing it may reserve together."""


def check_gpu_share(study: Study, cfg, where: str) -> None:
    """Runs that share a GPU (study.gpus_per_run < 1) with vLLM rollouts must fit their vLLM
    engine in their share: vLLM takes `ppo.vllm_gpu_memory_utilization` of the whole GPU's
    memory per engine, so k runs on one GPU need k times that (at most `VLLM_SHARED_BUDGET`),
    plus their trainers' memory. Refused at planning with the numbers, rather than one run losing
    the race for memory."""
    share = study.gpus_per_run
    if not 0 < share < 1 or cfg.ppo.rollout_backend != "vllm":
        return
    runs_per_gpu = int(1 // share)
    util = cfg.ppo.vllm_gpu_memory_utilization
    if util >= share or runs_per_gpu * util > VLLM_SHARED_BUDGET:
        most = min(VLLM_SHARED_BUDGET / runs_per_gpu, share)
        raise StudyError(
            f"{where}: ppo.vllm_gpu_memory_utilization = {util:g} does not fit study.gpus_per_run = {share:g}: "
            f"{runs_per_gpu} runs share each GPU and each vLLM engine reserves {util:g} of the GPU's memory "
            f"({runs_per_gpu} x {util:g} = {runs_per_gpu * util:.2f}; the engines of one GPU may take "
            f"{VLLM_SHARED_BUDGET:g} together, the trainers need the rest of their share); set "
            f"ppo.vllm_gpu_memory_utilization {'below' if most == share else 'at most'} {most:.3g} or "
            f"raise study.gpus_per_run")
    weights, memory = _weights_gib(cfg.model.name_or_path), _gpu_memory_gib()
    if weights is not None and memory is not None and util * memory < 1.2 * weights:
        raise StudyError(
            f"{where}: each run's vLLM budget, ppo.vllm_gpu_memory_utilization = {util:g} of {memory:.0f} GiB "
            f"= {util * memory:.1f} GiB, cannot hold the model's weights ({weights:.1f} GiB) and a KV cache; "
            f"raise study.gpus_per_run and ppo.vllm_gpu_memory_utilization together")


def check_gpu_memory(study: Study, cfg, where: str, memory_gib: Optional[float] = None) -> None:
    """A run whose predicted memory (rlhf/memory/: every role's weights, gradients,
    optimizer states, activations and the vLLM engine) cannot fit in its GPU, or its share of one
    (study.gpus_per_run < 1), is refused at planning with the bindings that would make it fit.
    Checked when this machine has a GPU (taken as the runs' kind) and the run computes on one; the
    engine checks again when the run starts."""
    memory_gib = _gpu_memory_gib() if memory_gib is None else memory_gib
    on_gpu = study.gpus_per_run > 0 or cfg.ppo.resolved_placement != "local"  # Ray ranks hold their own GPUs
    if memory_gib is None or cfg.ppo.device == "cpu" or not on_gpu:
        return
    from rlhf import memory
    try:
        policy, reward_model = memory.run_shapes(cfg)
    except (ConfigError, ValueError):  # an unreadable model is the run's own one-line error
        return
    total = int(memory_gib * memory.GIB)
    share = study.gpus_per_run if 0 < study.gpus_per_run < 1 else 1.0
    try:
        memory.check(cfg, policy, reward_model, available=int(share * total), device_total=total)
    except ConfigError as err:
        raise StudyError(f"{where}: {err}") from None
