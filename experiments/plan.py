"""Plan: a study expanded into run specs, each content-hashed, before anything runs.

A run's hash covers what decides its result: the operative config (gin's resolved text, which
includes the seed and the starting checkpoint path, less the placement bindings), the starting checkpoint's content, the
engine's code and the task data. A rerun skips a run whose hash matches a finished run dir and
reruns only what changed. The code version hashes the engine's files (`rlhf/`), committed or
not, so a commit that touches only docs or the manager does not invalidate finished runs; the
git SHA and dirty flag are recorded for provenance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from rlhf.checkpoint import latest_checkpoint as engine_latest_checkpoint
from rlhf.config import ConfigError, flat_dict
from rlhf.configurable import resolve
from rlhf.data import dataset_hash, load_task
from rlhf.provenance import run_git  # the engine's one git runner (its provenance uses it too)
from rlhf.provenance import hash_directory
from rlhf.train import without_placement

from experiments.paths import portable
from experiments.results import StudyAggregate
from experiments.study import BASELINE, Study, StudyError, split_binding

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_PATHS = ("rlhf",)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One (variant, seed) run: what to execute and the hash that identifies its result."""

    study: str
    variant: str
    seed: int
    recipe: str
    bindings: tuple
    """Engine `-b` bindings in order: baseline, variant, then the managed ones."""
    changes: dict
    """{binding name: value} where this run's config differs from the baseline's."""
    run_dir: str
    run_hash: str
    config_hash: str
    code_version: dict
    data_hash: str
    init_from: str
    init_from_hash: Optional[str]
    cpus: int
    gpus: float
    placement: str
    """The engine's resolved placement: 'local' (one process) or 'colocated'/'split' (the engine
    places its ranks in a Ray placement group of its own, on the manager's cluster)."""
    total_steps: int
    operative_config: str
    final_window: int
    """The run's `ppo.final_window`: steps a guardrail averages when summary.json lacks its metric."""

    @property
    def key(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def record(self) -> dict:
        """The spec as plan.json and run.json record it (`spec_record`)."""
        return spec_record(self.to_json())


def spec_record(spec: dict) -> dict:
    """A spec (`RunSpec.to_json`) as files record it: the run dir relative to its study's results
    dir, the recipe relative to the working directory (experiments/paths.py). What the files hold
    is then the same in every checkout; `load_plan` resolves them again."""
    run_dir = Path(spec["run_dir"])
    return {**spec, "run_dir": portable(run_dir, run_dir.parent.parent.parent), "recipe": portable(spec["recipe"])}


def _engine_files() -> List[Path]:
    listed = run_git("ls-files", "-co", "--exclude-standard", "--", *ENGINE_PATHS)
    if listed is not None:
        return sorted(REPO_ROOT / p for p in listed.split("\n") if p and (REPO_ROOT / p).is_file())
    return sorted(p for d in ENGINE_PATHS for p in (REPO_ROOT / d).rglob("*.py"))


def code_version() -> dict:
    """The engine code a run executes: `engine_sha256` (the content of the engine's files,
    committed or not: it enters the run hash), and `engine_dirty` / `engine_diff_sha256`
    (uncommitted changes under rlhf/ only; the engine's own provenance `git.dirty` covers the
    whole repository). The commit itself is `git_commit()`: a machine record, since the same
    code is committed again with every change elsewhere (the committed results included)."""
    h = hashlib.sha256()
    for p in _engine_files():
        h.update(str(p.relative_to(REPO_ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    sha = git_commit()
    diff = run_git("diff", "HEAD", "--", *ENGINE_PATHS) if sha else None
    untracked = run_git("ls-files", "--others", "--exclude-standard", "--", *ENGINE_PATHS) if sha else None
    return {"engine_dirty": bool((diff and diff.strip()) or (untracked and untracked.strip())) if sha else None,
            "engine_diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
            "engine_sha256": h.hexdigest()}


def git_commit() -> Optional[str]:
    """HEAD's SHA, or None outside a git checkout."""
    sha = run_git("rev-parse", "HEAD")
    return sha.strip() if sha else None


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The newest intact `run_dir/checkpoints/step_N`, or None: the engine's rule
    (rlhf.checkpoint.latest_checkpoint, sizes checked against each checkpoint's manifest), so a
    damaged checkpoint is never what a study resumes from or starts the next round with."""
    return engine_latest_checkpoint(Path(run_dir) / "checkpoints", full=False)


def resume_checkpoints(study: Study) -> Dict[int, str]:
    """{seed: checkpoint dir} that starts each run, from `study.resume_from`; {} when unset.

    `resume_from` is a checkpoint dir (every seed starts from it) or a previous study's results
    dir: the variant it chose (or `study.resume_variant`) gives each seed the latest checkpoint
    of the same seed, or of its first seed when the previous study lacked that seed.
    """
    if not study.resume_from:
        return {}
    root = Path(study.resume_from)
    if not root.is_dir():
        raise StudyError(f"study.resume_from = {study.resume_from!r} does not exist: run the previous study "
                         f"first, or give a checkpoint dir")
    if is_checkpoint_dir(root):
        return {s: portable(root) for s in study.seeds}
    previous = _previous_aggregate(study)
    variant = _resumed_variant(study, previous)
    by_seed = {}
    for run in previous.variants[variant].runs:
        ckpt = latest_checkpoint(root / run.run_dir) if run.status == "completed" else None
        if ckpt is not None:
            by_seed[run.seed] = portable(ckpt)  # the engine's `ppo.init_from`: the same in every checkout
    if not by_seed:
        raise StudyError(f"study.resume_from: variant {variant!r} of {study.resume_from} has no completed "
                         f"run with a checkpoint")
    first = by_seed[min(by_seed)]
    return {s: by_seed.get(s, first) for s in study.seeds}


def resumed_setting(study: Study) -> tuple:
    """The bindings of the variant `study.resume_from` chose (or `resume_variant`), when the study
    sets `resume_setting`; () otherwise. The baseline's own bindings come after them and win."""
    root = Path(study.resume_from) if study.resume_from else None
    if not study.resume_setting or root is None or not (root / "aggregate.json").is_file():
        return ()
    previous = _previous_aggregate(study)
    return tuple(previous.variants[_resumed_variant(study, previous)].bindings)


def is_checkpoint_dir(root: Path) -> bool:
    """A checkpoint dir (`.../checkpoints/step_N`, or a model dir) rather than a study's results dir."""
    return (root / "model.safetensors").exists() or root.name.startswith("step_")


def previous_aggregate(root: Path, binding: str, otherwise: str = "") -> StudyAggregate:
    """The aggregate of the finished study whose results dir is `root`, named by `binding` (e.g.
    "study.resume_from = '...'"), or a StudyError saying what to do (`otherwise`: the alternative)."""
    path = Path(root) / "aggregate.json"
    if not path.is_file():
        raise StudyError(f"{binding}: no aggregate.json there; run `python -m experiments report` on that "
                         f"study first{otherwise}")
    try:
        return StudyAggregate.load(path)
    except ValueError as err:
        raise StudyError(f"{binding.partition(' = ')[0]}: {err}") from None


def _previous_aggregate(study: Study) -> StudyAggregate:
    """The aggregate of the study `study.resume_from` names, or a StudyError saying what to do."""
    return previous_aggregate(Path(study.resume_from), f"study.resume_from = {study.resume_from!r}",
                              ", or give a checkpoint dir")


def _resumed_variant(study: Study, previous: StudyAggregate) -> str:
    variant = study.resume_variant or previous.decision.chosen
    if variant is None:
        raise StudyError(f"study.resume_from = {study.resume_from!r}: that study decided nothing "
                         f"({previous.decision.reason}); set study.resume_variant or rerun it")
    if variant not in previous.variants:
        raise StudyError(f"study.resume_variant = {variant!r} is not a variant of {study.resume_from}; "
                         f"allowed: {', '.join(previous.variants)}")
    return variant


def resolve_config(recipe: str, bindings: Sequence[str], where: str):
    """The engine's resolve(), its one-line ConfigError reported as a StudyError saying where."""
    try:
        return resolve(recipe, list(bindings))
    except ConfigError as err:
        raise StudyError(f"{where}: {err}") from None


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
    """A run whose predicted memory (rlhf/placement/memory.py: every role's weights, gradients,
    optimizer states, activations and the vLLM engine) cannot fit in its GPU, or its share of one
    (study.gpus_per_run < 1), is refused at planning with the bindings that would make it fit.
    Checked when this machine has a GPU (taken as the runs' kind) and the run computes on one; the
    engine checks again when the run starts."""
    memory_gib = _gpu_memory_gib() if memory_gib is None else memory_gib
    on_gpu = study.gpus_per_run > 0 or cfg.ppo.resolved_placement != "local"  # Ray ranks hold their own GPUs
    if memory_gib is None or cfg.ppo.device == "cpu" or not on_gpu:
        return
    from rlhf.placement import memory
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


def config_changes(base: dict, other: dict) -> dict:
    return {k: other[k] for k in sorted(other) if other[k] != base.get(k)}


def expand(study: Study, results_dir: str | Path) -> List[RunSpec]:
    """Every (variant, seed) run of the study, baseline first, in seed order within a variant.

    Pure apart from reading the engine's files and data to hash them; runs nothing. Raises
    StudyError when a binding is invalid or a single-binding variant changes no parameter.
    """
    study_dir = Path(results_dir).resolve() / study.name
    code = code_version()
    starts = resume_checkpoints(study)
    inherited = resumed_setting(study)
    if inherited:
        study = dataclasses.replace(study, baseline_bindings=(*inherited, *study.baseline_bindings))
    start_hashes = {p: hash_directory(p) for p in set(starts.values())}
    checkpoint_hashes: dict = {}

    def checkpoints_of(cfg) -> dict:
        """Hashes of the local checkpoints a run reads besides its start (the policy, the reward
        model): retraining one of them reruns the runs that use it."""
        paths = {"model": cfg.model.name_or_path if cfg.model.name_or_path != "tiny" else "",
                 "reward_model": cfg.reward.model_path if cfg.reward.uses_model else ""}
        for path in paths.values():
            if path and path not in checkpoint_hashes:
                checkpoint_hashes[path] = hash_directory(path)
        return {k: checkpoint_hashes[p] for k, p in paths.items() if p}
    base_cfg, _ = resolve_config(study.baseline_recipe, study.baseline_bindings, "study.baseline_bindings")
    base_flat = flat_dict(base_cfg)
    train, held_out = load_task(base_cfg.task)
    data_hashes = {json.dumps(dataclasses.asdict(base_cfg.task), sort_keys=True):
                   dataset_hash(train + held_out)}
    specs = []
    variant_of_hash: Dict[str, str] = {}
    for variant in study.all_variants:
        where = f"study.variants[{variant.name!r}]"
        var_cfg, _ = resolve_config(study.baseline_recipe, [*study.baseline_bindings, *variant.bindings], where)
        changes = config_changes(base_flat, flat_dict(var_cfg))
        if variant.name != BASELINE:
            if not changes:
                raise StudyError(f"{where} = {list(variant.bindings)}: changes nothing from the baseline")
            if not variant.coupled:
                key, _ = split_binding(variant.bindings[0], where)
                if set(changes) != {key}:
                    raise StudyError(f"{where} changes {sorted(changes)}; a single-binding variant must "
                                     f"change only {key}")
        check_gpu_share(study, var_cfg, where)
        check_gpu_memory(study, var_cfg, where)
        task_key = json.dumps(dataclasses.asdict(var_cfg.task), sort_keys=True)
        if task_key not in data_hashes:
            tr, ho = load_task(var_cfg.task)
            data_hashes[task_key] = dataset_hash(tr + ho)
        for seed in study.seeds:
            init_from = starts.get(seed, "")
            managed = [f"ppo.seed = {seed}", f"ppo.torch_threads = {study.cpus_per_run}"]
            if init_from:
                managed.append(f"ppo.init_from = {init_from!r}")
            bindings = (*study.baseline_bindings, *variant.bindings, *managed)
            cfg, operative = resolve_config(study.baseline_recipe, bindings, where)
            # Less the bindings that say where a run executes (the engine guarantees they do not
            # change results): moving a study to more ranks does not rerun it.
            config_hash = _sha(without_placement(operative))
            init_hash = start_hashes.get(init_from) if init_from else None
            run_hash = _sha(json.dumps({"config": config_hash, "code": code["engine_sha256"],
                                        "data": data_hashes[task_key], "init_from": init_hash,
                                        **checkpoints_of(cfg)}, sort_keys=True))
            twin = variant_of_hash.setdefault(run_hash, variant.name)
            if twin != variant.name:
                raise StudyError(f"{where} and study.variants[{twin!r}] run the same configuration "
                                 f"({', '.join(f'{k} = {v!r}' for k, v in changes.items())}: one run hash); "
                                 f"remove one of them or make them differ")
            specs.append(RunSpec(
                study=study.name, variant=variant.name, seed=seed, recipe=study.baseline_recipe,
                bindings=bindings, changes=changes, run_dir=str(study_dir / "runs" / variant.name / f"seed{seed}"),
                run_hash=run_hash, config_hash=config_hash, code_version=code,
                data_hash=data_hashes[task_key], init_from=init_from, init_from_hash=init_hash,
                cpus=study.cpus_per_run, gpus=study.gpus_per_run, placement=cfg.ppo.resolved_placement,
                total_steps=cfg.ppo.total_steps, operative_config=operative,
                final_window=cfg.ppo.final_window))
    return specs


def study_dir(study: Study, results_dir: str | Path) -> Path:
    return Path(results_dir).resolve() / study.name
