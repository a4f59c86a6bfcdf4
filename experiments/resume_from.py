"""Where a round starts: `study.resume_from` resolved to the checkpoints, the setting and the
finished study it names.

`resume_from` is a checkpoint dir (every seed starts from it) or a previous study's results dir,
whose chosen variant (or `study.resume_variant`) gives each seed its latest intact checkpoint
and, with `study.resume_setting`, its bindings. Read at planning (experiments/plan.py) and by the
`params` pipeline stage (experiments/stages.py), both once the previous round has run; the seed
plan reads the same study as its default pilot (experiments/seed_plan.py). Every problem is a
StudyError naming the binding and what to do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from experiments.errors import StudyError
from experiments.paths import portable
from experiments.results import AGGREGATE, RunStatus, StudyAggregate, aggregate_path, read_aggregate
from experiments.run_records import latest_checkpoint
from experiments.study import Study


def resume_checkpoints(study: Study) -> Dict[int, str]:
    """{seed: checkpoint dir} that starts each run, from `study.resume_from`; {} when unset.

    `resume_from` is a checkpoint dir (every seed starts from it) or a previous study's results
    dir: the variant it chose (or `study.resume_variant`) gives each seed the latest checkpoint
    of the same seed. Seeds the previous study lacked share its checkpoints, spread over them in
    turn (the first missing seed starts from its first seed's, the next from its second's): the
    round then has fewer independent lineages than seeds, which the aggregate accounts for
    (`aggregate.lineage_units`).
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
        ckpt = latest_checkpoint(root / run.run_dir) if run.status == RunStatus.COMPLETED else None
        if ckpt is not None:
            by_seed[run.seed] = portable(ckpt)  # the engine's `ppo.init_from`: the same in every checkout
    if not by_seed:
        raise StudyError(f"study.resume_from: variant {variant!r} of {study.resume_from} has no completed "
                         f"run with a checkpoint")
    lineages = [by_seed[s] for s in sorted(by_seed)]
    missing = [s for s in study.seeds if s not in by_seed]
    spread = {s: lineages[i % len(lineages)] for i, s in enumerate(missing)}
    return {s: by_seed.get(s) or spread[s] for s in study.seeds}


def shared_starts(starts: Mapping[int, str]) -> Dict[str, Tuple[int, ...]]:
    """{start checkpoint: its seeds} when some seeds share one (a round resumed from a study with
    fewer seeds than it runs), {} when every seed starts apart: seeds from one start share its
    luck, so the aggregate tests their mean as one unit (`aggregate.lineage_units`)."""
    groups: Dict[str, List[int]] = {}
    for seed in sorted(starts):
        groups.setdefault(starts[seed], []).append(seed)
    if all(len(g) < 2 for g in groups.values()):
        return {}
    return {start: tuple(seeds) for start, seeds in groups.items()}


def lineage_notice(starts: Mapping[int, str]) -> Optional[str]:
    """What `plan` and `run` say when seeds share starts: the round has fewer independent units."""
    groups = shared_starts(starts)
    if not groups:
        return None
    shared = "; ".join(", ".join(map(str, seeds)) for seeds in groups.values() if len(seeds) > 1)
    return (f"notice: seeds {shared} share their start checkpoints (study.resume_from has {len(groups)} seeds with "
            f"checkpoints): the verdicts compare {len(groups)} lineage means per variant, not {len(starts)} seeds; "
            f"resume from a round with as many seeds to make every seed its own unit")


def resumed_setting(study: Study) -> tuple:
    """The bindings of the variant `study.resume_from` chose (or `resume_variant`), when the study
    sets `resume_setting`; () otherwise. The baseline's own bindings come after them and win."""
    root = Path(study.resume_from) if study.resume_from else None
    if not study.resume_setting or root is None or not aggregate_path(root).is_file():
        return ()
    previous = _previous_aggregate(study)
    return tuple(previous.variants[_resumed_variant(study, previous)].bindings)


def resumed_study(study: Study) -> Study:
    """The study as its runs are planned: the resumed setting's bindings (`resumed_setting`) before
    the baseline's own, which win. The planner and the params DVC reads both take it from here, so
    the params show the setting the runs really get."""
    inherited = resumed_setting(study)
    return dataclasses.replace(study, baseline_bindings=(*inherited, *study.baseline_bindings)) if inherited else study


def is_checkpoint_dir(root: Path) -> bool:
    """A checkpoint dir (`.../checkpoints/step_N`, or a model dir) rather than a study's results dir."""
    return (root / "model.safetensors").exists() or root.name.startswith("step_")


def previous_aggregate(root: Path, binding: str, otherwise: str = "") -> StudyAggregate:
    """The aggregate of the finished study whose results dir is `root`, named by `binding` (e.g.
    "study.resume_from = '...'"), or a StudyError saying what to do (`otherwise`: the alternative)."""
    return read_aggregate(root, f"{binding}: no {AGGREGATE} there; run `python -m experiments report` on that "
                                f"study first{otherwise}", where=binding.partition(" = ")[0])


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
