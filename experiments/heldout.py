"""The test split, and the tuning path's models scored on it:

    python -m experiments testsplit --recipe recipes/demo.gin --out data/arithmetic_test
    python -m experiments heldout STUDY.gin... --results results --test data/arithmetic_test --out reports/heldout.json

Every decision of a study reads the task's evaluation rows: the verdicts and the chosen variant
(its final `eval/accuracy`), the best gold checkpoint (the highest `eval/accuracy` over every
saved step). A figure picked as the best of many on those rows is biased upward, so it cannot
also say how good the pick is. The test split is the task's held-out rows that no run evaluates:
the engine evaluates the first `task.eval_size` held-out rows (rlhf/trainer.py), the rest are
read by nothing. It is built with the engine's own reading of the task (`rlhf.data.load_task`),
so it is the same distribution as the evaluation rows, and its prompts are checked against
every train and evaluated prompt (exact match) when it is built and again, against every run's
own configuration, when it is used. Fresh prompts cannot do this for the embedded arithmetic
task: its train and held-out rows are every `a+b=` / `a-b=` with operands up to
task.max_operand, and prompts with larger operands are another task (the demo's SFT warm
start, right on ~30% of the held-out rows, is right on 1 to 6% of those with operands up to 25).
So the split is as large as the task's unread held-out rows (the demo's: 41 of its 169 held-out
rows, past the 128 every run evaluates): a larger one changes the data or task.eval_size, which
every run read, and so means running every stage again (`SPLIT_SIZE`).

`heldout` scores on it, with the engine's gold metric (pass@1 sampled at ppo.eval_temperature
with the run's sampling settings, and greedy, as `PPOTrainer.evaluate` computes eval/accuracy
and eval/greedy_accuracy), the first round's starting model (the warm start), the final
checkpoint of every seed of the last round's chosen variant, and the checkpoint with the best
gold accuracy over all rounds. Sampling is seeded from the run's seed on a stream of its own
(`rlhf.rollout.SeedStream.TEST`), the model runs on the CPU with the numerics profile's pinned threads, so the
record is the same bytes on every run of the command. A value a run logged as NaN (or infinite), and
the scores of a model whose weights are not finite, are missing: null in the record, each said in
its `missing` list and by the command, never a traceback. `heldout_lines` renders it for the summary.

The record (`heldout_record`, strict JSON): `metric`, `studies`, `test` (path, prompts, sha256),
`samples_per_prompt` (null: each run's ppo.eval_samples_per_prompt), `seed_salt`; `warm_start`
(study, path, and per seed: seed, path, accuracy, greedy_accuracy, eval_accuracy), `final_choice`
(study, variant, bindings, `lineages` ({start checkpoint: seeds} when seeds of the last round share
starts), per seed the same fields with step, and `summary` and `vs_warm_start`: t statistics over
the seeds, for machines; the summary's own figures count lineages and prompts), `best_checkpoint`
(study, variant, seed, step, path, eval_accuracy, accuracy, greedy_accuracy) and `missing`. Each
scored model's `per_prompt` holds, per metric, `samples` (responses per prompt) and `correct` (how
many of each prompt's were right, in the test file's order): what the summary's intervals resample
(`split_statistics`). Records written before `per_prompt` was kept still render, with intervals
that say they ignore which prompts were drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from experiments.errors import StudyError
from experiments.paths import output_dir, output_file, portable
from experiments.results import BASELINE, RunStatus, StudyAggregate, aggregate_path, read_aggregate
from experiments.run_records import GOLD_METRIC, iter_metrics, latest_checkpoint, scalar, summary
from rlhf.atomic import write_text

if TYPE_CHECKING:  # annotations only
    from experiments.study import Study

TEST_FILE = "test.jsonl"
ROWS_PER_CALL = 64
"""Generated rows per generation call, as `PPOTrainer.evaluate` splits its calls: the calls and
their seeds are the engine's, so the same rows give the same samples."""
METRICS = ("accuracy", "greedy_accuracy")
"""What is scored per model: `eval/accuracy` and `eval/greedy_accuracy` of the engine, on the test split."""


# ----------------------------------------------------------------------------- the split
def unread_examples(task) -> Tuple[list, int]:
    """(the held-out rows no run of this task configuration evaluates, how many were dropped as
    duplicates of a train or evaluated prompt). The engine evaluates `held[:task.eval_size]`
    (`PPOTrainer.__init__`); the rest of the held-out split is what is left for a test."""
    from rlhf.chat import prompt_key
    from rlhf.data import load_task

    train, held = load_task(task)
    seen = {prompt_key(ex.prompt) for ex in [*train, *held[:task.eval_size]]}
    out, dropped = [], 0
    for ex in held[task.eval_size:]:
        key = prompt_key(ex.prompt)
        if key in seen:
            dropped += 1
            continue
        seen.add(key)
        out.append(ex)
    return out, dropped


def cmd_testsplit(args) -> int:
    """Writes OUT/test.jsonl (prompt, answer and data_source rows, the data stage's format) and OUT/meta.json."""
    from rlhf import configurable
    from rlhf.data import dataset_hash

    out = output_dir(args.out)
    cfg, _ = configurable.resolve(args.recipe, args.binding)
    rows, dropped = unread_examples(cfg.task)
    if not rows:
        raise StudyError(f"no test split is left: the task's held-out rows are all evaluated (task.eval_size = "
                         f"{cfg.task.eval_size} of {args.recipe}) or repeat a train or evaluated prompt; lower "
                         f"task.eval_size or give the task more held-out rows")
    write_text(out / TEST_FILE, "".join(json.dumps({"prompt": ex.prompt, "answer": ex.answer,
                                                    **({"data_source": ex.data_source} if ex.data_source else {})})
                                        + "\n" for ex in rows))
    write_text(out / "meta.json", json.dumps({"test": len(rows), "dropped_duplicates": dropped,
                                              "eval_size": cfg.task.eval_size, "sha256": dataset_hash(rows)}, indent=1))
    print(f"wrote {len(rows)} test examples to {out / TEST_FILE} (held-out rows past task.eval_size = "
          f"{cfg.task.eval_size}; {dropped} dropped as duplicates of a train or evaluated prompt)")
    return 0


def read_test(path: str | Path) -> Tuple[Path, list]:
    """(the file, its examples): `path` is a test JSONL file or a directory holding test.jsonl."""
    from rlhf.data import read_records, records_to_examples

    path = Path(path)
    file = path / TEST_FILE if path.is_dir() else path
    if not file.is_file():
        raise StudyError(f"--test {str(path)!r}: no test split there (expected a JSONL file or a directory with "
                         f"{TEST_FILE}); build it with `python -m experiments testsplit`")
    return file, records_to_examples(read_records(file), "prompt", "answer", str(file))


def check_unread(examples: Sequence, task, where: str) -> None:
    """StudyError when a test prompt is one the task configuration trains on or evaluates: then a
    decision read it, and the split is no test."""
    from rlhf.chat import prompt_key
    from rlhf.data import load_task

    train, held = load_task(task)
    read = {prompt_key(ex.prompt) for ex in [*train, *held[:task.eval_size]]}
    shared = [prompt_key(ex.prompt) for ex in examples if prompt_key(ex.prompt) in read]
    if shared:
        raise StudyError(f"{len(shared)} of the test split's {len(examples)} prompts (e.g. {shared[0]!r}) are train "
                         f"or evaluated prompts of {where} (task.eval_size = {task.eval_size}): a decision read "
                         f"them; rebuild the split with `python -m experiments testsplit` from the runs' recipe")


# ----------------------------------------------------------------------------- scoring
def run_config(run_dir: Path):
    """The run's operative configuration (its config.gin, what the engine ran with)."""
    from rlhf import configurable

    path = Path(run_dir) / "config.gin"
    if not path.is_file():
        raise StudyError(f"{run_dir}: no config.gin; the run never started, so it has nothing to score")
    cfg, _ = configurable.resolve(path)
    return cfg


def gold_accuracy(policy, tokenizer, cfg, examples: Sequence, seed_parts: Tuple[int, ...],
                  samples_per_prompt: int = 0) -> Dict[str, Optional[float]]:
    """{'accuracy', 'greedy_accuracy'} of `policy` on `examples`: `PPOTrainer.evaluate`'s gold
    metric, the share of right responses over every prompt's (`gold_scores`)."""
    return {key: share(got) for key, got in
            gold_scores(policy, tokenizer, cfg, examples, seed_parts, samples_per_prompt).items()}


def share(got: Optional[dict]) -> Optional[float]:
    """The share of right responses over every prompt's of a `gold_scores` entry (None for None)."""
    return None if got is None else sum(got["correct"]) / (got["samples"] * len(got["correct"]))


def gold_scores(policy, tokenizer, cfg, examples: Sequence, seed_parts: Tuple[int, ...],
                samples_per_prompt: int = 0) -> Dict[str, Optional[dict]]:
    """{'accuracy', 'greedy_accuracy'} of `policy` on `examples`, per prompt: {'samples': responses
    per prompt, 'correct': how many of each prompt's were right, in the examples' order}, scored
    with `PPOTrainer.evaluate`'s gold metric and the run config `cfg`'s sampling settings (pass@1
    sampled at ppo.eval_temperature, ppo.eval_samples_per_prompt per prompt unless
    `samples_per_prompt` says more; greedy as well when that temperature is above 0, else None),
    its generation calls and their seeds (`derive_seed(*seed_parts, call)`), the rule reward's
    `correct`."""
    import torch

    from rlhf.chat import PromptRenderer
    from rlhf.rewards import rule_results
    from rlhf.rollout import SamplingParams, decode_responses, derive_seed
    from rlhf.rollout.hf import HFRollout

    ppo, task = cfg.ppo, cfg.task
    renderer = PromptRenderer.from_task(tokenizer, task)
    rollout = HFRollout(policy, tokenizer, torch.device("cpu"))
    modes = [("accuracy", ppo.eval_temperature, samples_per_prompt or ppo.eval_samples_per_prompt)]
    if ppo.eval_temperature > 0:
        modes.append(("greedy_accuracy", 0.0, 1))
    out: Dict[str, Optional[dict]] = dict.fromkeys(METRICS)
    for key, temperature, n in modes:
        sampling = SamplingParams.from_ppo(ppo, temperature)
        calls = math.ceil(len(examples) * n / ROWS_PER_CALL)
        per_call = math.ceil(len(examples) / calls)
        correct: List[bool] = []
        for call in range(calls):
            rows = [ex for ex in examples[call * per_call:(call + 1) * per_call] for _ in range(n)]
            if not rows:
                continue
            # Token ids as prompts: generate hands them to encode_prompts, which takes text or ids.
            batch = rollout.generate([renderer.ids(ex.prompt) for ex in rows],  # pyright: ignore[reportArgumentType]
                                     sampling, derive_seed(*seed_parts, call))
            results = rule_results(task.reward_fn, decode_responses(tokenizer, batch), [ex.answer for ex in rows],
                                   batch["finished"].tolist(), [ex.data_source for ex in rows],
                                   format_reward=task.format_reward, missing_eos_penalty=task.missing_eos_penalty)
            correct += [r.correct for r in results]
        # The rows are each prompt's n responses in turn, prompt after prompt.
        out[key] = {"samples": n, "correct": [sum(correct[i * n:(i + 1) * n]) for i in range(len(examples))]}
    return out


class Scorer:
    """Loads each model as its run loads it (`rlhf.roles.actor.build_policy`: a full checkpoint, or
    LoRA adapters on their base) with the run's tokenizer, and scores it on the test split."""

    def __init__(self, examples: Sequence, samples_per_prompt: int = 0):
        self.examples = list(examples)
        self.samples_per_prompt = samples_per_prompt
        self._unread: set = set()
        self._fit: set = set()
        self.missing: List[str] = []
        """What the record holds as missing (null) and why, one line each: a value a run logged as
        NaN or infinite, a model whose weights are not finite."""

    def finite(self, value: Optional[float], what: str) -> Optional[float]:
        """`value`, or None when it is NaN or infinite (said in `missing` as `what` and the value):
        the record is strict JSON, and a run that logged NaN has no value to show."""
        if value is None or math.isfinite(value):
            return value
        self.missing.append(f"{what} is {value} (logged by the run): recorded as missing")
        return None

    def check_unread(self, cfg, where: str) -> None:
        """`check_unread` once per task configuration."""
        if repr(cfg.task) not in self._unread:
            check_unread(self.examples, cfg.task, where)
            self._unread.add(repr(cfg.task))

    def check_fits(self, cfg, tokenizer) -> None:
        """The split's prompts fit as the trainer checks its own splits before any compute
        (ppo.max_prompt_length, ppo.prompt_truncation): a ConfigError in one line when not."""
        from rlhf.chat import PromptRenderer, check_rows
        from rlhf.data import check_prompt_lengths

        key = (repr(cfg.task), cfg.ppo.max_prompt_length, cfg.ppo.prompt_truncation)
        if key in self._fit:
            return
        lengths = check_rows(self.examples, PromptRenderer.from_task(tokenizer, cfg.task).ids, "task.chat_template")
        check_prompt_lengths({"test": (self.examples, lengths)}, cfg.ppo.max_prompt_length,
                             cfg.ppo.prompt_truncation, log=lambda _: None)
        self._fit.add(key)

    def score(self, cfg, start_dir: Path, seed: int, where: str) -> dict:
        """The policy at `start_dir` under run config `cfg`, sampled on `seed`'s test stream:
        {'accuracy', 'greedy_accuracy'} (`gold_accuracy`) and 'per_prompt', the same per prompt
        (`gold_scores`); every metric None (said in `missing`) when the policy's weights are not all
        finite: such a model generates nothing to score."""
        import torch
        import transformers

        from rlhf import numerics
        from rlhf.determinism import deterministic_algorithms
        from rlhf.roles.actor import build_policy
        from rlhf.rollout import SeedStream
        from rlhf.trainer import policy_tokenizer

        model_dir, _, tokenizer = policy_tokenizer(cfg, log=lambda _: None)
        self.check_unread(cfg, where)
        self.check_fits(cfg, tokenizer)
        deterministic_algorithms("cpu")  # as the trainer's process computes
        transformers.utils.logging.disable_progress_bar()
        with numerics.fixed_threads():
            policy = build_policy(cfg.ppo, str(start_dir), str(model_dir), torch.device("cpu")).eval()
            bad = next((name for name, p in policy.named_parameters() if not bool(torch.isfinite(p).all())), None)
            if bad is not None:
                self.missing.append(f"{portable(start_dir)} (seed {seed}) has non-finite weights ({bad}): its "
                                    f"test scores are recorded as missing")
                return {**dict.fromkeys(METRICS), "per_prompt": None}
            scores = gold_scores(policy, tokenizer, cfg, self.examples, (seed, SeedStream.TEST),
                                 self.samples_per_prompt)
        return {**{key: share(got) for key, got in scores.items()}, "per_prompt": scores}


def start_of(cfg) -> Path:
    """Where a run's policy starts: its ppo.init_from checkpoint's actor, else its model (the
    tiny default's cached SFT warm start for model.name_or_path = 'tiny'), as the trainer picks it."""
    from rlhf.trainer import resolve_model_paths

    if cfg.ppo.init_from:
        return Path(cfg.ppo.init_from) / "actor"
    return Path(resolve_model_paths(cfg, log=lambda _: None)[0])


def eval_value_at(run_dir: Path, step: int) -> Optional[float]:
    """The run's eval/accuracy at `step` (the eval row that scored exactly that checkpoint's weights)."""
    for row in iter_metrics(run_dir):
        if int(row.get("step", -1)) == step:
            value = scalar(row.get(GOLD_METRIC))
            if value is not None:
                return value
    return None


# ----------------------------------------------------------------------------- statistics
def summarize(values: Sequence[Optional[float]]) -> dict:
    """n, mean, std (ddof 1) and the mean's 95% t interval of the values given (`stats.summarize`,
    as every report shows a variant's seeds)."""
    from experiments import stats
    s = stats.summarize([v for v in values if v is not None])
    return {key: s[key] for key in ("n", "mean", "std", "ci95")}


def paired_difference(a: Sequence[dict], b: Sequence[dict], metric: str) -> dict:
    """`a` - `b` per seed (both scored with that seed's sampling stream), summarised as `summarize` does."""
    by_seed = {row["seed"]: row[metric] for row in b if row.get(metric) is not None}
    diffs = [row[metric] - by_seed[row["seed"]] for row in a
             if row.get(metric) is not None and row["seed"] in by_seed]
    s = summarize(diffs)
    return {"n": s["n"], "difference": s["mean"], "std": s["std"], "ci95": s["ci95"]}


# ----------------------------------------------------------------------------- the command
def read_rounds(args) -> List[Tuple[Study, Path, StudyAggregate]]:
    """(study, results dir, aggregate) of `args.studies` in round order (`heldout`, `confirm`,
    `summary`); every study file is read, and a study listed twice refused, before any aggregate."""
    from experiments.study import load_study

    studies, files = [], {}
    for path in args.studies:
        study = load_study(path, args.binding)
        if study.name in files:
            raise StudyError(f"study {study.name!r} is listed twice ({files[study.name]} and {path}): list each "
                             f"round once, in round order")
        files[study.name] = path
        studies.append((path, study))
    rounds = []
    for path, study in studies:
        study_dir = Path(args.results) / study.name
        rounds.append((study, study_dir, read_aggregate(
            study_dir, f"{aggregate_path(study_dir)} not found: run `python -m experiments run {path}` first")))
    return rounds


def _completed(agg: StudyAggregate, variant: str):
    return [r for r in agg.variants[variant].runs if r.status == RunStatus.COMPLETED] if variant in agg.variants else []


def _warm_start(scorer: Scorer, first: tuple, seeds: Sequence[int]) -> dict:
    """The first round's start, scored once per final seed on that seed's stream (the difference
    from it is then paired), each time under the config of the first round's baseline run of that
    seed (or of its first run, for a seed it did not run)."""
    study, study_dir, agg = first
    starts = {r.seed: r for r in _completed(agg, BASELINE)}
    if not starts:
        raise StudyError(f"{study.name}: its baseline has no completed run, so where the path starts is unknown")
    rows = []
    for seed in seeds:
        run = starts.get(seed) or next(iter(starts.values()))
        cfg = run_config(study_dir / run.run_dir)
        start = start_of(cfg)
        initial = (summary(study_dir / run.run_dir) or {}).get("initial") or {}
        value = scalar(initial.get(GOLD_METRIC)) if run.seed == seed else None
        rows.append({"seed": seed, "path": portable(start), **scorer.score(cfg, start, seed, study.name),
                     "eval_accuracy": scorer.finite(value, f"{study.name} baseline seed {seed}'s {GOLD_METRIC} "
                                                           f"before training")})
    paths = {row["path"] for row in rows}
    return {"study": study.name, "path": paths.pop() if len(paths) == 1 else None, "seeds": rows}


def _final_checkpoints(last: tuple) -> list:
    """(run, its newest intact checkpoint) of each completed seed of the last round's chosen variant."""
    study, study_dir, agg = last
    chosen = agg.decision.chosen
    if not chosen:
        raise StudyError(f"{study.name} has no decision ({agg.decision.reason}): there is no final choice to "
                         f"score on the test split")
    finals = [(r, latest_checkpoint(study_dir / r.run_dir)) for r in _completed(agg, chosen)]
    finals = [(r, ckpt) for r, ckpt in finals if ckpt is not None]
    if not finals:
        raise StudyError(f"{study.name}: the chosen variant {chosen!r} has no completed run with an intact "
                         f"checkpoint to score")
    return finals


def _final_choice(scorer: Scorer, last: tuple, finals: list, warm: dict) -> dict:
    """Each final checkpoint scored on its seed's stream under its run's config, with the eval row
    of its step beside it; their mean, std and t interval, and the paired difference from `warm`."""
    study, study_dir, agg = last
    rows = []
    for run, ckpt in finals:
        step = int(ckpt.name.rsplit("_", 1)[-1])
        value = eval_value_at(study_dir / run.run_dir, step)
        rows.append({"seed": run.seed, "path": portable(ckpt), "step": step,
                     **scorer.score(run_config(study_dir / run.run_dir), ckpt / "actor", run.seed, study.name),
                     "eval_accuracy": scorer.finite(value, f"{study.name} {agg.decision.chosen} seed {run.seed}'s "
                                                           f"{GOLD_METRIC} at step {step}")})
    chosen = agg.decision.chosen
    return {"study": study.name, "variant": chosen, "bindings": list(agg.variants[chosen].bindings),
            "lineages": {start: list(seeds) for start, seeds in agg.lineages.items()}, "seeds": rows,
            "summary": {m: summarize([row[m] for row in rows]) for m in (*METRICS, "eval_accuracy")},
            "vs_warm_start": {m: paired_difference(rows, warm["seeds"], m) for m in METRICS}}


def _best_checkpoint(scorer: Scorer, rounds: Sequence[tuple]) -> Optional[dict]:
    """The checkpoint with the highest eval/accuracy over the rounds (the first on a tie, as the
    summary names it), scored on its run's seed stream; None when no round recorded one."""
    from rlhf.checkpoint import verify_checkpoint

    best = None
    for study, study_dir, agg in rounds:
        record = agg.best_checkpoints
        if record is not None and record.best is not None and (best is None or record.best.rank > best[3].rank):
            best = (study, study_dir, agg, record.best)
    if best is None:
        return None
    study, study_dir, agg, point = best
    ckpt = study_dir / point.path
    problem = verify_checkpoint(ckpt, full=False) if ckpt.is_dir() else "it is missing"
    if problem:
        raise StudyError(f"{study.name}: the best gold checkpoint {ckpt} cannot be scored: {problem}")
    run = next((r for r in _completed(agg, point.variant) if r.seed == point.seed), None)
    cfg = run_config(study_dir / run.run_dir if run is not None else ckpt.parent.parent)
    return {"study": study.name, "variant": point.variant, "seed": point.seed, "step": point.step,
            "path": portable(ckpt), "eval_accuracy": point.value,
            **scorer.score(cfg, ckpt / "actor", point.seed, study.name)}


def heldout_record(rounds: Sequence[Tuple[Study, Path, StudyAggregate]], test_file: Path, examples: Sequence,
                   samples_per_prompt: int = 0) -> dict:
    """The record `heldout` writes (see the module docstring); `rounds`: (study, study dir,
    aggregate) in round order."""
    from rlhf.data import dataset_hash
    from rlhf.rollout import SeedStream

    scorer = Scorer(examples, samples_per_prompt)
    finals = _final_checkpoints(rounds[-1])
    for study, study_dir, agg in rounds:  # no run of the path trained on or evaluated a test prompt
        for variant in agg.variants.values():
            for run in variant.runs:
                if (study_dir / run.run_dir / "config.gin").is_file():
                    scorer.check_unread(run_config(study_dir / run.run_dir), f"{study.name}'s runs")
    warm = _warm_start(scorer, rounds[0], [run.seed for run, _ in finals])
    return {"metric": GOLD_METRIC, "studies": [s.name for s, _, _ in rounds],
            "test": {"path": portable(test_file), "prompts": len(examples), "sha256": dataset_hash(list(examples))},
            "samples_per_prompt": samples_per_prompt or None, "seed_salt": int(SeedStream.TEST),
            "warm_start": warm, "final_choice": _final_choice(scorer, rounds[-1], finals, warm),
            "best_checkpoint": _best_checkpoint(scorer, rounds), "missing": scorer.missing}


def record_text(record: dict) -> str:
    """The record as strict JSON (None, never NaN), indented, each list of integers (a model's
    right responses per prompt, a lineage's seeds) on one line."""
    text = json.dumps(record, indent=2, allow_nan=False)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]", lambda m: "[" + ", ".join(re.split(r",\s*", m.group(1))) + "]",
                  text) + "\n"


def read_heldout(path: str | Path, studies: Sequence[str]) -> dict:
    """The `heldout` stage's record at `path` (`--heldout`), for the rounds `studies`: a StudyError of one
    line when it is not valid strict JSON (a bare NaN or Infinity is no value `heldout` writes: it
    writes null), not a JSON object, or a record of other studies than these."""
    def bare(token: str):
        raise ValueError(f"it holds a bare {token}; `heldout` writes a missing value as null")
    fix = "run `python -m experiments heldout` with the same studies first"
    try:
        record = json.loads(Path(path).read_text(), parse_constant=bare)
    except (OSError, ValueError) as err:
        raise StudyError(f"--heldout {str(path)!r}: not a record of the `heldout` stage ({err}); {fix}") from None
    if not isinstance(record, dict) or not isinstance(record.get("final_choice"), dict):
        raise StudyError(f"--heldout {str(path)!r}: not a record of the `heldout` stage (a JSON object with "
                         f"'studies' and 'final_choice'; it holds a {type(record).__name__}); {fix}")
    if record.get("studies") != list(studies):
        raise StudyError(f"--heldout {str(path)!r} is a record of the studies {record.get('studies')}, not of these "
                         f"rounds {list(studies)}; {fix}")
    return record


MAX_SAMPLES_PER_PROMPT = 256
"""The most responses `heldout` samples per test prompt and model: a bound on its cost, far past the
point where more samples of the same prompts change an interval that counts prompts."""


def check_samples_per_prompt(samples: int) -> None:
    """`--samples-per-prompt` of `heldout` and `confirm`: 0 (the run's own) to MAX_SAMPLES_PER_PROMPT."""
    if not 0 <= samples <= MAX_SAMPLES_PER_PROMPT:
        raise StudyError(f"--samples-per-prompt {samples} is invalid: 0 (the run's ppo.eval_samples_per_prompt) to "
                         f"{MAX_SAMPLES_PER_PROMPT}; every model scored samples that many responses per test prompt, "
                         f"and the intervals narrow with prompts, not with samples of the same prompts")


def cmd_heldout(args) -> int:
    from rlhf import numerics
    numerics.apply()  # before torch loads: the same samples on every x86-64 CPU

    check_samples_per_prompt(args.samples_per_prompt)
    out = output_file(args.out)
    rounds = read_rounds(args)
    test_file, examples = read_test(args.test)
    record = heldout_record(rounds, test_file, examples, args.samples_per_prompt)
    write_text(out, record_text(record))
    final = record["final_choice"]["summary"]["accuracy"]
    for line in record["missing"]:
        print(f"notice: {line}")
    print(f"wrote {args.out}: final choice {record['final_choice']['variant']!r} of {record['final_choice']['study']} "
          f"{_fmt(final['mean'])} on {len(examples)} test prompts ({final['n']} seeds"
          + (f"; {len(record['missing'])} missing value(s), listed above and in the record" if record["missing"]
             else "") + ")")
    return 0


# ----------------------------------------------------------------------------- the summary's statistics
SPLIT_SIZE = ("The split is every held-out row no run evaluates (`python -m experiments testsplit` takes all of "
              "them), so it cannot grow without retraining: more prompts need more held-out rows (a larger "
              "task.eval_fraction or task.max_operand for the arithmetic task, more rows in a task's eval file) or a "
              "smaller task.eval_size, and either changes what every run trained on or evaluated, so every stage from "
              "the data on reruns. More samples per prompt (`heldout --samples-per-prompt`) lower the noise within "
              "each prompt, not which prompts were drawn.")
"""Why the test split is the size it is (`heldout_lines` says it when the split is too small)."""


def _fractions(row: dict, metric: str) -> Optional[np.ndarray]:
    """The row's per-prompt share of right responses, or None when the record has no per-prompt scores."""
    got = (row.get("per_prompt") or {}).get(metric)
    return None if not got else np.asarray(got["correct"], float) / got["samples"]


def split_statistics(rows: Sequence[dict], metric: str, units: Sequence[Sequence[int]],
                    against: Optional[Sequence[dict]] = None) -> Optional[dict]:
    """The test-split mean of `metric` over `rows` (one per seed), or with `against` (the warm
    start's rows) the mean difference, seed s against seed s; over independent `units` (the mean of
    their seeds, per prompt). With per-prompt scores: `stats.two_level_interval` (prompts and units
    resampled; the same prompts for both sides of the difference). Without (a record written before
    they were kept): the t interval over the units' means, which ignores which prompts were drawn
    (`two_level` False). None when no unit has a value. Keys: mean, ci95, p_value (differences),
    units, seeds, prompts, two_level, per_prompt (the units' mean per prompt, or None)."""
    from experiments import stats

    by_seed = {row["seed"]: row for row in rows if row.get(metric) is not None}
    other = {row["seed"]: row for row in against or () if row.get(metric) is not None}
    keep = [[s for s in unit if s in by_seed and (against is None or s in other)] for unit in units]
    keep = [unit for unit in keep if unit]
    if not keep:
        return None
    seeds = sum(len(unit) for unit in keep)

    def per_prompt(seed: int) -> Optional[np.ndarray]:
        """The seed's per-prompt values (less the warm start's, with `against`); None without them."""
        mine = _fractions(by_seed[seed], metric)
        if mine is None or against is None:
            return mine
        theirs = _fractions(other[seed], metric)
        return None if theirs is None else mine - theirs

    tables = [[per_prompt(s) for s in unit] for unit in keep]
    complete = [[t for t in unit if t is not None and len(t) > 1] for unit in tables]
    if all(len(whole) == len(unit) for whole, unit in zip(complete, tables)):
        table = np.array([np.mean(np.stack(unit), axis=0) for unit in complete])
        got = stats.two_level_interval(table, null=0.0 if against is not None else None)
        return {"mean": got["mean"], "ci95": got["ci95"], "p_value": got["p_value"], "units": len(keep),
                "seeds": seeds, "prompts": table.shape[1], "two_level": True, "per_prompt": table.mean(axis=0)}
    value = [float(np.mean([by_seed[s][metric] - (other[s][metric] if against is not None else 0.0) for s in unit]))
             for unit in keep]
    lo, hi = stats.mean_ci(value) if len(value) > 1 else (None, None)
    p = stats.paired_p(value, [0.0] * len(value)) if against is not None and len(value) > 1 else None
    return {"mean": float(np.mean(value)), "ci95": (lo, hi), "p_value": p, "units": len(keep), "seeds": seeds,
            "prompts": None, "two_level": False, "per_prompt": None}


def split_power(difference: Optional[dict], alpha: float = 0.05,
                target: Optional[float] = None) -> Optional[dict]:
    """What the split's prompts can detect, from the spread of a difference's per-prompt values
    (`split_statistics(...)['per_prompt']`): the smallest true difference the paired t over the
    prompts detects with 80% power at `alpha` (`stats.min_detectable_effect`), and with a `target`
    the prompts that would detect it (`stats.seeds_needed`, counting prompts; None beyond its cap).
    More seeds shrink only the sampling noise in that spread, not how differently the prompts
    respond to training, so this is close to the most the split can detect. None without
    per-prompt values."""
    from experiments import stats

    if difference is None or difference.get("per_prompt") is None:
        return None
    per_prompt = np.asarray(difference["per_prompt"], float)
    sd = float(np.std(per_prompt, ddof=1))
    mde = stats.min_detectable_effect(math.nan, len(per_prompt), len(per_prompt), alpha, paired=True,
                                      sd_difference=sd)
    needed = (stats.seeds_needed(target, math.nan, alpha, paired=True, sd_difference=sd) if target else None)
    return {"prompts": len(per_prompt), "sd": sd, "mde": mde if math.isfinite(mde) else None,
            "target": target, "prompts_needed": needed, "alpha": alpha}


# ----------------------------------------------------------------------------- markdown
def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _ci(ci) -> str:
    return "-" if not ci or ci[0] is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def _signed(x) -> str:
    return "-" if x is None else f"{x:+.4f}"


def _units_text(got: Optional[dict], one_model: bool = False) -> str:
    """'3 lineages (5 seeds)', '5 seeds', '1 seed', '1 model (5 seeds)'."""
    if got is None:
        return "0"
    if one_model and got["seeds"] > 1:
        return f"1 model ({got['seeds']} seeds)"
    if got["units"] == got["seeds"] or one_model:
        return f"{got['seeds']} seed{'s' if got['seeds'] != 1 else ''}"
    return f"{got['units']} lineage{'s' if got['units'] != 1 else ''} ({got['seeds']} seeds)"


def _mean(got: Optional[dict]) -> str:
    return _fmt(got["mean"] if got else None)


def _eval_mean(rows: Sequence[dict], units: Sequence[Sequence[int]]) -> Optional[float]:
    """The eval split's value over the same units as the test split's (None when no seed has one)."""
    by_seed = {row["seed"]: row["eval_accuracy"] for row in rows if row.get("eval_accuracy") is not None}
    means = [float(np.mean([by_seed[s] for s in unit if s in by_seed])) for unit in units
             if any(s in by_seed for s in unit)]
    return float(np.mean(means)) if means else None


def heldout_lines(record: dict, lineages: Optional[Mapping[str, Sequence[int]]] = None,
                  target_effect: Optional[float] = None, alpha: float = 0.05) -> List[str]:
    """The summary's section for a `heldout` record: each model's gold accuracy on the evaluation
    rows (which the decisions read) beside the test split's (which none read), the final choice's
    difference from the warm start on the test split, and what the split's prompts can detect.

    Every figure counts independent units: the final choice's seeds that share a start checkpoint
    (`lineages`, the last round's `StudyAggregate.lineages`, else the record's own) are one unit,
    their mean; the warm start is one model, its seeds only sampling streams, so with per-prompt
    scores it is one unit (over seeds without them). Intervals are
    `stats.two_level_interval`'s (prompts and units resampled), from the per-prompt scores the record
    keeps; a record written before it kept them gets t intervals over the units and a line saying
    they ignore which prompts were drawn. `target_effect` (the rounds' study.target_effect): the
    power line says whether the split can detect it, and why it is the size it is when not."""
    from experiments.stats import BOOTSTRAP_REPLICATES, seed_units

    test = record.get("test") or {}
    samples = record.get("samples_per_prompt")
    per_prompt = f"{samples} samples per prompt" if samples else "ppo.eval_samples_per_prompt per prompt"
    warm, final, best = record.get("warm_start"), record.get("final_choice"), record.get("best_checkpoint")
    lineages = lineages if lineages is not None else (final or {}).get("lineages") or {}
    warm_rows = warm["seeds"] if warm else []
    final_rows = final["seeds"] if final else []
    final_units = seed_units([row["seed"] for row in final_rows], lineages)
    best_rows = [best] if best else []
    rows_with_scores = [row for row in (*warm_rows, *final_rows, *best_rows) if row.get("accuracy") is not None]
    two_level = bool(rows_with_scores) and all(row.get("per_prompt") for row in rows_with_scores)
    # The warm start is one model: its seeds are sampling streams, whose noise each prompt's score
    # already holds, so with per-prompt scores it is one unit and its interval is over the prompts.
    warm_seeds = [row["seed"] for row in warm_rows]
    warm_units = [warm_seeds] if two_level and warm_seeds else seed_units(warm_seeds)
    if two_level:
        method = ("Means over independent units (the seeds of a lineage, which share a start checkpoint, count "
                  "once); 95% intervals from a two-level bootstrap that resamples the prompts and the units "
                  f"({BOOTSTRAP_REPLICATES:,} replicates, a fixed seed), never narrower than the t interval over the "
                  "units: they count both which runs training gave and which prompts the split drew.")
    else:
        method = (f"Means over independent units (the seeds of a lineage, which share a start checkpoint, count "
                  f"once); 95% t intervals over the units. **This record has no per-prompt scores** (it was "
                  f"written before they were kept), so its intervals ignore which {test.get('prompts', '?')} "
                  f"prompts were drawn and are too narrow; `python -m experiments heldout` (the pipeline's "
                  f"`heldout` stage) writes them.")
    lines = ["## Test split (no decision read it)", "",
             f"{test.get('prompts', '?')} held-out prompts no run evaluates (`{test.get('path', '?')}`), scored "
             f"with the engine's gold metric: pass@1 sampled at ppo.eval_temperature ({per_prompt}) and greedy, "
             f"each model with its run's sampling settings. {method} The evaluation split's figures are those the "
             f"decisions were made on.", "",
             "| model | path | units | eval split | test split (sampled) | 95% CI | test split (greedy) | 95% CI |",
             "|---|---|---|---|---|---|---|---|"]
    if warm:
        s, g = (split_statistics(warm_rows, m, warm_units) for m in METRICS)
        lines.append(f"| warm start ({warm['study']}) | `{warm.get('path') or 'per seed'}` | "
                     f"{_units_text(s, one_model=True)} | {_fmt(_eval_mean(warm_rows, warm_units))} | {_mean(s)} | "
                     f"{_ci(s and s['ci95'])} | {_mean(g)} | {_ci(g and g['ci95'])} |")
    if final:
        s, g = (split_statistics(final_rows, m, final_units) for m in METRICS)
        paths = sorted({re.sub(r"/seed\d+/", "/seed*/", row["path"]) for row in final_rows})
        lines.append(f"| final choice `{final['variant']}` ({final['study']}) | {', '.join(f'`{p}`' for p in paths)} | "
                     f"{_units_text(s)} | {_fmt(_eval_mean(final_rows, final_units))} | {_mean(s)} | "
                     f"{_ci(s and s['ci95'])} | {_mean(g)} | {_ci(g and g['ci95'])} |")
    if best:
        s, g = (split_statistics(best_rows, m, [[best["seed"]]]) for m in METRICS)
        lines.append(f"| best gold checkpoint ({best['study']} {best['variant']}/seed{best['seed']} step "
                     f"{best['step']}) | `{best['path']}` | 1 seed | {_fmt(best['eval_accuracy'])} | "
                     f"{_fmt(best['accuracy'])} | {_ci(s and s['ci95']) if two_level else '-'} | "
                     f"{_fmt(best.get('greedy_accuracy'))} | {_ci(g and g['ci95']) if two_level else '-'} |")
    sampled = None
    if final and warm:
        lines.append("")
        for metric, name in (("accuracy", "sampled"), ("greedy_accuracy", "greedy")):
            d = split_statistics(final_rows, metric, final_units, against=warm_rows)
            if metric == "accuracy":
                sampled = d
            if d is None:
                continue
            p = f", p = {d['p_value']:.2g}" if d["p_value"] is not None else ""
            over = (f"{_units_text(d)} and {d['prompts']} prompts, paired by seed and prompt" if d["two_level"]
                    else f"{_units_text(d)}, paired by seed; prompts ignored")
            lines.append(f"Final choice - warm start on the test split ({name}): {_signed(d['mean'])}, 95% CI "
                         f"{_ci(d['ci95'])}{p} (over {over}).")
    if best:
        lines += ["", f"The best gold checkpoint was picked as the highest of many on the evaluation split "
                      f"({_fmt(best['eval_accuracy'])}); on the test split it scores {_fmt(best['accuracy'])}"
                      + (" (its interval is over the prompts alone: one model)." if two_level else ".")]
    lines += power_lines(split_power(sampled, alpha, target_effect))
    if record.get("missing"):
        lines += ["", "Missing values (shown as -, left out of the means): " + "; ".join(record["missing"]) + "."]
    return lines + [""]


def power_lines(power: Optional[dict]) -> List[str]:
    """What the test split's prompts can detect (`split_power`), and when that is more than the
    target effect, that the split is too small for it and why it is the size it is."""
    if power is None or power["mde"] is None:
        return []
    text = (f"Power: from the spread of the sampled difference over the {power['prompts']} prompts (sd "
            f"{power['sd']:.3g} from prompt to prompt), the test split detects a difference of {power['mde']:.3g} "
            f"at 80% power (alpha {power['alpha']:g}); more seeds shrink only the sampling noise in that spread, not "
            f"how differently the prompts respond")
    target = power["target"]
    if target is None:
        return ["", text + "."]
    if power["mde"] <= target:
        return ["", text + f": enough for the target effect {target:g} (study.target_effect)."]
    needed = (f"about {power['prompts_needed']} prompts would detect it" if power["prompts_needed"]
              else "no split of a feasible size would detect it")
    return ["", text + f". **The test split is too small to detect the target effect {target:g}** "
                       f"(study.target_effect): {needed}. {SPLIT_SIZE}"]


# ----------------------------------------------------------------------------- arguments
def add_testsplit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="recipes/demo.gin",
                        help="the runs' engine recipe: its task and task.eval_size (default: %(default)s)")
    parser.add_argument("-b", "--binding", action="append", default=[], help="a gin binding (repeatable)")
    parser.add_argument("--out", required=True, help="the output directory (test.jsonl, meta.json)")


def add_heldout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("studies", nargs="+", help="study recipes, in round order")
    parser.add_argument("-b", "--binding", action="append", default=[], help="a gin binding (repeatable)")
    parser.add_argument("--results", default="results", help="results root (default: %(default)s)")
    parser.add_argument("--test", required=True, help="the test split: a JSONL file, or the `testsplit` directory")
    parser.add_argument("--samples-per-prompt", type=int, default=0,
                        help="sampled responses per test prompt (default 0: the run's ppo.eval_samples_per_prompt); "
                             "more lowers the sampling noise of the same pass@1")
    parser.add_argument("--out", default="reports/heldout.json", help="output (default: %(default)s)")
