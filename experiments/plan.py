"""Plan: a study expanded into run specs, each content-hashed, before anything runs.

A run's hash covers what decides its result: the operative config (gin's resolved text, which
includes the seed and the starting checkpoint path, less the placement bindings), the starting checkpoint's content, the
engine's code and the task data. A rerun skips a run whose hash matches a finished run dir and
reruns only what changed. The code version hashes the engine's files (`rlhf/`), committed or
not, so a commit that touches only docs or the manager does not invalidate finished runs; the
git SHA and dirty flag are recorded for provenance.

What a run starts from (`study.resume_from`) is resolved by experiments/resume_from.py, and
whether each run fits its GPU is checked by experiments/gpu_fit.py; this module turns their answers
into specs and hashes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from experiments.errors import StudyError
from experiments.gpu_fit import check_gpu_memory, check_gpu_share
from experiments.paths import spec_record
from experiments.resume_from import resume_checkpoints, resumed_study
from experiments.study import BASELINE, Study, Variant, split_binding
from rlhf.config import without_placement
from rlhf.configurable import flat_dict, resolve
from rlhf.data import dataset_hash, load_task
from rlhf.errors import ConfigError
from rlhf.provenance import (
    hash_directory,
    run_git,  # the engine's one git runner (its provenance uses it too)
)

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


def resolve_config(recipe: str, bindings: Sequence[str], where: str):
    """The engine's resolve(), its one-line ConfigError reported as a StudyError saying where."""
    try:
        return resolve(recipe, list(bindings))
    except ConfigError as err:
        raise StudyError(f"{where}: {err}") from None


def config_changes(base: dict, other: dict) -> dict:
    return {k: other[k] for k in sorted(other) if other[k] != base.get(k)}


def expand(study: Study, results_dir: str | Path) -> List[RunSpec]:
    """Every (variant, seed) run of the study, baseline first, in seed order within a variant.

    Pure apart from reading the engine's files and data to hash them; runs nothing. Raises
    StudyError when a binding is invalid or a single-binding variant changes no parameter.
    """
    root = study_dir(study, results_dir)
    code = code_version()
    starts = resume_checkpoints(study)
    study = resumed_study(study)
    start_hashes = {p: hash_directory(p) for p in set(starts.values())}
    data_hashes: Dict[str, str] = {}
    checkpoint_hashes: Dict[str, Optional[str]] = {}
    base_cfg, _ = resolve_config(study.baseline_recipe, study.baseline_bindings, "study.baseline_bindings")
    base_flat = flat_dict(base_cfg)
    _data_hash(base_cfg.task, data_hashes)
    specs = []
    variant_of_hash: Dict[str, str] = {}
    for variant in study.all_variants:
        where = f"study.variants[{variant.name!r}]"
        var_cfg, changes = _variant_changes(study, variant, base_flat, where)
        check_policy(var_cfg, where)
        check_gpu_share(study, var_cfg, where)
        check_gpu_memory(study, var_cfg, where)
        data_hash = _data_hash(var_cfg.task, data_hashes)
        resolved = _SeedResolver(study, variant, where)
        for seed in study.seeds:
            init_from = starts.get(seed, "")
            bindings = _run_bindings(study, variant, seed, init_from)
            cfg, operative = resolved(seed, init_from, bindings)
            # Less the bindings that say where a run executes (the engine guarantees they do not
            # change results): moving a study to more ranks does not rerun it.
            config_hash = _sha(without_placement(operative))
            init_hash = start_hashes.get(init_from) if init_from else None
            run_hash = _sha(json.dumps({"config": config_hash, "code": code["engine_sha256"], "data": data_hash,
                                        "init_from": init_hash, **_checkpoint_hashes(cfg, checkpoint_hashes)},
                                       sort_keys=True))
            twin = variant_of_hash.setdefault(run_hash, variant.name)
            if twin != variant.name:
                raise StudyError(f"{where} and study.variants[{twin!r}] run the same configuration "
                                 f"({', '.join(f'{k} = {v!r}' for k, v in changes.items())}: one run hash); "
                                 f"remove one of them or make them differ")
            specs.append(RunSpec(
                study=study.name, variant=variant.name, seed=seed, recipe=study.baseline_recipe,
                bindings=bindings, changes=changes, run_dir=str(root / "runs" / variant.name / f"seed{seed}"),
                run_hash=run_hash, config_hash=config_hash, code_version=code,
                data_hash=data_hash, init_from=init_from, init_from_hash=init_hash,
                cpus=study.cpus_per_run, gpus=study.gpus_per_run, placement=cfg.ppo.resolved_placement,
                total_steps=cfg.ppo.total_steps, operative_config=operative,
                final_window=cfg.ppo.final_window))
    return specs


def check_policy(cfg, where: str) -> None:
    """The variant's policy and LoRA bindings, refused at planning exactly as the trainer's start
    refuses them (one check: rlhf/memory/plan.py `check_policy`), before any run launches. A
    policy dir that does not exist yet (an earlier DVC stage writes it) is checked when its runs start."""
    from rlhf import memory
    name = cfg.model.name_or_path
    if name != "tiny" and not (Path(name) / "config.json").is_file():
        return
    try:
        memory.check_policy(cfg)
    except ConfigError as err:
        raise StudyError(f"{where}: {err}") from None


class _SeedResolver:
    """A variant's runs' (config, operative config text), seed by seed. The seeds of a variant (with
    one start) differ only in the managed `ppo.seed = N`, so gin resolves the first seed and a
    second one in full, and, when their texts differ in that one line alone, every further seed's
    text is the first's with its seed written in: the text gin would give (the hashes are those
    of a full resolve), without gin's parse of the recipe per seed (about 20 ms a run, minutes for
    thousands of seeds). Where the texts differ elsewhere, every seed is resolved in full."""

    def __init__(self, study: Study, variant: Variant, where: str):
        self.study, self.variant, self.where = study, variant, where
        self.first: Dict[str, tuple] = {}
        """{init_from: (seed, cfg, operative)} of the first seed resolved from each start."""
        self.checked: Dict[str, bool] = {}
        """{init_from: whether a seed's text is the first's with its seed written in}."""

    def __call__(self, seed: int, init_from: str, bindings: tuple) -> tuple:
        first = self.first.get(init_from)
        if first is not None and self.checked.get(init_from):
            cfg = first[1]
            return (dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, seed=seed)),
                    _with_seed(first[2], first[0], seed))
        cfg, operative = resolve_config(self.study.baseline_recipe, bindings, self.where)
        if first is None:
            self.first[init_from] = (seed, cfg, operative)
        elif init_from not in self.checked:
            self.checked[init_from] = _with_seed(first[2], first[0], seed) == operative
        return cfg, operative


def _with_seed(operative: str, seed: int, other: int) -> Optional[str]:
    """The operative config text of seed `seed` with `other` in its `ppo.seed = N` line; None when
    that line is not there exactly once."""
    line = re.compile(rf"^ppo\.seed = {seed}$", re.M)
    text, n = line.subn(f"ppo.seed = {other}", operative)
    return text if n == 1 else None


def _variant_changes(study: Study, variant: Variant, base: dict, where: str) -> tuple:
    """(the variant's config, {binding: value} where it differs from the baseline `base`); a
    variant must change something, and a single-binding one only its own parameter."""
    cfg, _ = resolve_config(study.baseline_recipe, [*study.baseline_bindings, *variant.bindings], where)
    changes = config_changes(base, flat_dict(cfg))
    if variant.name != BASELINE:
        if not changes:
            raise StudyError(f"{where} = {list(variant.bindings)}: changes nothing from the baseline")
        if not variant.coupled:
            key, _ = split_binding(variant.bindings[0], where)
            if set(changes) != {key}:
                raise StudyError(f"{where} changes {sorted(changes)}; a single-binding variant must "
                                 f"change only {key}")
    return cfg, changes


def _run_bindings(study: Study, variant: Variant, seed: int, init_from: str) -> tuple:
    """A run's engine bindings: the baseline's, the variant's, then the managed ones (its seed, its
    threads, where it starts)."""
    managed = [f"ppo.seed = {seed}", f"ppo.torch_threads = {study.cpus_per_run}"]
    if init_from:
        managed.append(f"ppo.init_from = {init_from!r}")
    return (*study.baseline_bindings, *variant.bindings, *managed)


def _data_hash(task, known: Dict[str, str]) -> str:
    """The hash of a task config's data (train and held-out), read once per distinct config."""
    key = json.dumps(dataclasses.asdict(task), sort_keys=True)
    if key not in known:
        train, held_out = load_task(task)
        known[key] = dataset_hash(train + held_out)
    return known[key]


def _checkpoint_hashes(cfg, known: Dict[str, Optional[str]]) -> dict:
    """Hashes of the local checkpoints a run reads besides its start (the policy, the reward
    model), each read once: retraining one of them reruns the runs that use it."""
    paths: Dict[str, Optional[str]] = {"model": cfg.model.name_or_path if cfg.model.name_or_path != "tiny" else "",
             "reward_model": cfg.reward.model_path if cfg.reward.uses_model else ""}
    for path in paths.values():
        if path and path not in known:
            known[path] = hash_directory(path)
    return {k: known[p] for k, p in paths.items() if p}


def study_dir(study: Study, results_dir: str | Path) -> Path:
    return Path(results_dir).resolve() / study.name


def plan_path(study_dir: str | Path) -> Path:
    """The plan a study last launched (written by `launch`, read by `collect.load_plan`)."""
    return Path(study_dir) / "plan.json"
