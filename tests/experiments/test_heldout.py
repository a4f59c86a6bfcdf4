"""The test split and the `heldout` stage: the split holds the held-out rows no run evaluates
(disjoint from every train and evaluated prompt, the same bytes on every build); `heldout` scores
the warm start, the last round's choice (per seed) and the path's best gold checkpoint on it with
the engine's own gold metric, the same bytes on every run, strict JSON; bad input is one line.

The path is two rounds over real engine runs (two seeds of one PPO step on the tiny default,
run once for the module); their aggregates are written from the results' own types, so the test
does not wait for Ray."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from experiments.cli import main
from experiments.results import BestCheckpoints, CheckpointScore, RunStatus, aggregate_path
from tests.conftest import REPO
from tests.experiments.conftest import previous_study_aggregate

STEP = 1
RUN_BINDINGS = [f"ppo.total_steps = {STEP}", f"ppo.eval_every = {STEP}", f"ppo.save_every = {STEP}",
                f"ppo.final_window = {STEP}", "task.eval_size = 16"]
STUDY = """
study.name = '{name}'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = {bindings}
study.variants = {variants}
study.seeds = 2
"""


def strict_json(text: str):
    def refuse(token):
        raise AssertionError(f"non-strict JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_the_split_is_the_unread_held_out_rows_disjoint_and_deterministic(tmp_path):
    from rlhf import configurable
    from rlhf.data import load_task

    for out in ("a", "b"):
        assert main(["testsplit", "--recipe", "recipes/tiny.gin", "--out", str(tmp_path / out)]) == 0
    test = (tmp_path / "a" / "test.jsonl").read_bytes()
    assert test == (tmp_path / "b" / "test.jsonl").read_bytes()
    rows = [json.loads(line) for line in test.decode().splitlines()]
    cfg, _ = configurable.resolve("recipes/tiny.gin")
    train, held = load_task(cfg.task)
    read = {ex.prompt for ex in train} | {ex.prompt for ex in held[:cfg.task.eval_size]}
    prompts = [r["prompt"] for r in rows]
    assert len(prompts) == len(set(prompts)) == len(held) - cfg.task.eval_size > 0
    assert not read & set(prompts)
    for row in rows:  # 'a+b=' / 'a-b=' with the right integer
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", row["prompt"]).groups()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["test"] == len(rows) and meta["eval_size"] == cfg.task.eval_size

    # The pipeline's runs read the data stage's files (recipes/demo.gin): the same split from them.
    assert main(["data", "--recipe", "recipes/tiny.gin", "--out", str(tmp_path / "data")]) == 0
    files = [f"task.train_path = '{tmp_path / 'data' / 'train.jsonl'}'",
             f"task.eval_path = '{tmp_path / 'data' / 'eval.jsonl'}'"]
    assert main(["testsplit", "--recipe", "recipes/demo.gin", *sum((["-b", b] for b in files), []),
                 "--out", str(tmp_path / "from_files")]) == 0
    assert (tmp_path / "from_files" / "test.jsonl").read_bytes() == test


def test_a_held_out_row_that_repeats_a_train_or_evaluated_prompt_is_dropped(tmp_path):
    def write(name, prompts):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p, "answer": str(2 * int(p[0]))}) + "\n"
                                             for p in prompts))
    write("train.jsonl", ["1+1=", "2+2="])
    write("eval.jsonl", ["3+3=", "1+1=", "3+3=", "4+4=", "4+4=", "5+5="])  # the runs evaluate the first one
    bindings = [f"task.train_path = '{tmp_path / 'train.jsonl'}'", f"task.eval_path = '{tmp_path / 'eval.jsonl'}'",
                "task.eval_size = 1"]
    assert main(["testsplit", "--recipe", "recipes/demo.gin", *sum((["-b", b] for b in bindings), []),
                 "--out", str(tmp_path / "t")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "t" / "test.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["4+4=", "5+5="]
    assert json.loads((tmp_path / "t" / "meta.json").read_text())["dropped_duplicates"] == 3


def test_no_split_is_left_when_every_held_out_row_is_evaluated(tmp_path, capsys):
    assert main(["testsplit", "--recipe", "recipes/tiny.gin", "-b", "task.eval_size = 1000",
                 "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no test split is left") and "\n" not in err


# ----------------------------------------------------------------------------- a finished path
def _train(out: Path, seed: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", *sum((["-b", b] for b in RUN_BINDINGS), []),
            "-b", f"ppo.seed = {seed}", "-b", "ppo.torch_threads = 1", "--out", str(out)]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _eval_value(run_dir: Path, step: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next(r["eval/accuracy"] for r in rows if r["step"] == step)


@pytest.fixture(scope="module")
def path():
    """Two rounds: r1 (baseline, seeds 0 and 1) and r2, which chose its variant 'kl' (its runs are
    r1's, copied: scoring reads only a run's config and checkpoints). r1 holds the best checkpoint."""
    root = Path(tempfile.mkdtemp(prefix="experiments-heldout-"))
    results = root / "results"
    runs = {seed: results / "r1" / "runs" / "baseline" / f"seed{seed}" for seed in (0, 1)}
    procs = [_train(d, seed) for seed, d in runs.items()]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    for seed, d in runs.items():
        shutil.copytree(d, results / "r2" / "runs" / "kl" / f"seed{seed}")
    bindings = repr(RUN_BINDINGS)
    (root / "r1.gin").write_text(textwrap.dedent(STUDY.format(name="r1", bindings=bindings, variants="{}")))
    (root / "r2.gin").write_text(textwrap.dedent(STUDY.format(name="r2", bindings=bindings,
                                                              variants="{'kl': 'ppo.kl_coef = 0.1'}")))
    done = [(s, RunStatus.COMPLETED, f"runs/{{}}/seed{s}") for s in (0, 1)]
    r1 = previous_study_aggregate("r1", "baseline", {"baseline": [(s, st, d.format("baseline")) for s, st, d in done]})
    best = CheckpointScore("baseline", 1, STEP, _eval_value(runs[1], STEP),
                           f"runs/baseline/seed1/checkpoints/step_{STEP}")
    r1.replace(best_checkpoints=BestCheckpoints("eval/accuracy", (best,), best)).save(aggregate_path(results / "r1"))
    r2 = previous_study_aggregate("r2", "kl", {"baseline": [], "kl": [(s, st, d.format("kl")) for s, st, d in done]})
    low = CheckpointScore("kl", 0, STEP, best.value - 0.5, f"runs/kl/seed0/checkpoints/step_{STEP}")
    r2.replace(best_checkpoints=BestCheckpoints("eval/accuracy", (low,), low)).save(aggregate_path(results / "r2"))
    assert main(["testsplit", "--recipe", "recipes/tiny.gin", "--out", str(root / "test")]) == 0
    yield root
    shutil.rmtree(root, ignore_errors=True)


def heldout(root: Path, out: str, *extra: str) -> int:
    return main(["heldout", str(root / "r1.gin"), str(root / "r2.gin"), "--results", str(root / "results"),
                 "--test", str(root / "test"), "--out", str(root / out), *extra])


def test_heldout_scores_the_warm_start_the_choice_and_the_best_checkpoint(path):
    from experiments.heldout import heldout_lines
    from experiments.paths import portable
    from rlhf import configurable
    from rlhf.trainer import resolve_model_paths

    assert heldout(path, "a.json") == 0 and heldout(path, "b.json") == 0
    text = (path / "a.json").read_text()
    assert text == (path / "b.json").read_text()  # the same bytes on every run
    record = strict_json(text)
    assert record["test"]["prompts"] == len((path / "test" / "test.jsonl").read_text().splitlines())
    assert record["studies"] == ["r1", "r2"] and record["metric"] == "eval/accuracy"

    cfg, _ = configurable.resolve(path / "results" / "r1" / "runs" / "baseline" / "seed0" / "config.gin")
    warm = record["warm_start"]
    assert warm["study"] == "r1" and warm["path"] == portable(resolve_model_paths(cfg, log=lambda _: None)[0])
    assert [row["seed"] for row in warm["seeds"]] == [0, 1]
    for row in warm["seeds"]:  # the step-0 evaluation of that seed's run, beside the test figure
        summary = json.loads((path / "results" / "r1" / "runs" / "baseline" / f"seed{row['seed']}" /
                              "summary.json").read_text())
        assert row["eval_accuracy"] == summary["initial"]["eval/accuracy"]
        assert 0 <= row["accuracy"] <= 1 and 0 <= row["greedy_accuracy"] <= 1
    assert warm["seeds"][0]["greedy_accuracy"] == warm["seeds"][1]["greedy_accuracy"]  # greedy has no seed

    final = record["final_choice"]
    # the bindings are previous_study_aggregate's
    assert final["study"] == "r2" and final["variant"] == "kl" and final["bindings"] == ["ppo.kl_coef = 0.2"]
    for row in final["seeds"]:
        run_dir = path / "results" / "r2" / "runs" / "kl" / f"seed{row['seed']}"
        assert row["path"] == str(run_dir / "checkpoints" / f"step_{STEP}") and row["step"] == STEP
        assert row["eval_accuracy"] == _eval_value(run_dir, STEP)
    values = [row["accuracy"] for row in final["seeds"]]
    s = final["summary"]["accuracy"]
    assert s["n"] == 2 and s["mean"] == pytest.approx(sum(values) / 2)
    if s["std"]:
        assert s["ci95"][0] < s["mean"] < s["ci95"][1]
    diffs = [f["accuracy"] - w["accuracy"] for f, w in zip(final["seeds"], warm["seeds"])]
    assert final["vs_warm_start"]["accuracy"]["difference"] == pytest.approx(sum(diffs) / 2)
    assert final["vs_warm_start"]["accuracy"]["n"] == 2

    best = record["best_checkpoint"]  # r1's (higher eval value than r2's), re-scored on the test split
    assert (best["study"], best["variant"], best["seed"], best["step"]) == ("r1", "baseline", 1, STEP)
    assert best["path"] == str(path / "results" / "r1" / "runs" / "baseline" / "seed1" / "checkpoints" / f"step_{STEP}")
    # The same weights, the same config, the same seed stream: r2's copy of seed 1 scores the same.
    assert best["accuracy"] == final["seeds"][1]["accuracy"]

    lines = heldout_lines(record)
    assert lines[0] == "## Test split (no decision read it)"
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 4 and "warm start (r1)" in table[1] and "`kl`" in table[2] and "best gold" in table[3]
    assert any(line.startswith("Final choice - warm start on the test split (sampled)") for line in lines)


def test_the_record_keeps_each_models_scores_per_prompt(path):
    """Each scored model's right responses per prompt, which the summary's intervals resample: they
    add up to its accuracy, one count per test prompt, each list on one line of the file."""
    from experiments.heldout import SPLIT_SIZE, heldout_lines, share

    assert heldout(path, "per_prompt.json") == 0
    text = (path / "per_prompt.json").read_text()
    record = strict_json(text)
    prompts = record["test"]["prompts"]
    rows = [*record["warm_start"]["seeds"], *record["final_choice"]["seeds"], record["best_checkpoint"]]
    for row in rows:
        for metric in ("accuracy", "greedy_accuracy"):
            got = row["per_prompt"][metric]
            assert len(got["correct"]) == prompts and all(0 <= k <= got["samples"] for k in got["correct"])
            assert share(got) == row[metric]
        assert row["per_prompt"]["greedy_accuracy"]["samples"] == 1
    assert re.search(r'"correct": \[\d+(, \d+)+\]', text)  # one line each
    assert record["final_choice"]["lineages"] == {}

    section = "\n".join(heldout_lines(record))
    assert "two-level bootstrap that resamples the prompts and the units (10,000 replicates" in section
    assert "paired by seed and prompt" in section and "prompts ignored" not in section
    assert "| final choice `kl` (r2) |" in section and "| 2 seeds |" in section
    assert "| 1 model (2 seeds) |" in section  # the warm start: its seeds are sampling streams of one model
    best = next(line for line in section.splitlines() if line.startswith("| best gold"))
    assert best.count("[") == 2  # the best checkpoint's interval, over the prompts alone
    # Two seeds that share a start are one unit.
    assert "| 1 lineage (2 seeds) |" in "\n".join(heldout_lines(record, {"start": [0, 1]}))
    # The power line: the split against a target effect it cannot detect, and why it is the size it is.
    tiny_target = "\n".join(heldout_lines(record, target_effect=1e-4))
    assert "**The test split is too small to detect the target effect 0.0001**" in tiny_target
    assert SPLIT_SIZE in tiny_target
    assert "too small" not in "\n".join(heldout_lines(record, target_effect=10.0))
    # A record written before the per-prompt scores: intervals over the seeds, said to ignore the prompts.
    for row in rows:
        row.pop("per_prompt")
    old = "\n".join(heldout_lines(record, target_effect=1e-4))
    assert "**This record has no per-prompt scores**" in old and "prompts ignored" in old and "Power:" not in old


def test_the_score_is_the_engines_eval_accuracy(path):
    """On the rows and seed stream the engine evaluated with, the scorer gives exactly the run's logged
    eval/accuracy and eval/greedy_accuracy: the test split is scored with the same metric."""
    import torch

    from experiments.heldout import gold_accuracy, run_config, start_of
    from rlhf.data import load_task
    from rlhf.models import load_tokenizer
    from rlhf.roles.actor import build_policy
    from rlhf.rollout import SeedStream
    from rlhf.trainer import resolve_model_paths

    run_dir = path / "results" / "r1" / "runs" / "baseline" / "seed1"
    cfg = run_config(run_dir)
    model_dir, tokenizer_dir = resolve_model_paths(cfg, log=lambda _: None)
    policy = build_policy(cfg.ppo, str(run_dir / "checkpoints" / f"step_{STEP}" / "actor"), str(model_dir),
                          torch.device("cpu"))
    _, held = load_task(cfg.task)
    got = gold_accuracy(policy, load_tokenizer(tokenizer_dir), cfg, held[:cfg.task.eval_size],
                        (cfg.ppo.seed, SeedStream.EVAL, STEP))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = next(r for r in rows if r["step"] == STEP)
    assert got == {"accuracy": logged["eval/accuracy"], "greedy_accuracy": logged["eval/greedy_accuracy"]}
    start = build_policy(cfg.ppo, str(start_of(cfg)), str(model_dir), torch.device("cpu"))  # step 0: the warm start
    got = gold_accuracy(start, load_tokenizer(tokenizer_dir), cfg, held[:cfg.task.eval_size],
                        (cfg.ppo.seed, SeedStream.EVAL, 0))
    assert got == {"accuracy": rows[0]["eval/accuracy"], "greedy_accuracy": rows[0]["eval/greedy_accuracy"]}


def test_bad_input_is_one_line(path, capsys):
    def error(code: int) -> str:
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    assert "--samples-per-prompt -1 is invalid" in error(heldout(path, "x.json", "--samples-per-prompt", "-1"))
    # A missing test split.
    assert "no test split there" in error(main(["heldout", str(path / "r1.gin"), "--results", str(path / "results"),
                                                "--test", str(path / "nowhere"), "--out", str(path / "x.json")]))
    # A test split that holds prompts the runs evaluated.
    evaluated = path / "evaluated.jsonl"
    from rlhf.data import arithmetic_examples, split_examples
    _, held = split_examples(arithmetic_examples(20), 0.2)
    evaluated.write_text("".join(json.dumps({"prompt": ex.prompt, "answer": ex.answer}) + "\n" for ex in held[:3]))
    err = error(main(["heldout", str(path / "r1.gin"), "--results", str(path / "results"), "--test", str(evaluated),
                      "--out", str(path / "x.json")]))
    assert "3 of the test split's 3 prompts" in err and "a decision read them" in err
    # A last round that decided nothing.
    results = path / "results"
    saved = aggregate_path(results / "r2").read_bytes()
    try:
        from experiments.results import Decision, StudyAggregate
        agg = StudyAggregate.load(aggregate_path(results / "r2"))
        agg.replace(decision=Decision(None, "no variant beat the baseline")).save(aggregate_path(results / "r2"))
        assert "r2 has no decision" in error(heldout(path, "x.json"))
    finally:
        aggregate_path(results / "r2").write_bytes(saved)
    assert not (path / "x.json").exists()


def _nan_weights(safetensors_file: Path) -> None:
    """Every float32 tensor of a safetensors file set to NaN in place (the file keeps its size, so
    the checkpoint's manifest still holds)."""
    import struct

    raw = bytearray(safetensors_file.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    for name, meta in header.items():
        if name != "__metadata__" and meta["dtype"] == "F32":
            start, end = (8 + size + offset for offset in meta["data_offsets"])
            raw[start:end] = struct.pack("<f", float("nan")) * ((end - start) // 4)
    safetensors_file.write_bytes(bytes(raw))


def test_a_nan_is_a_missing_value_said_in_one_line_not_a_traceback(path, tmp_path, capsys):
    """A run that logged NaN (its evaluation before training, its final eval row) and a checkpoint
    whose weights are NaN: the record holds null for each, says why in `missing`, stays strict JSON,
    and the summary's section lists them."""
    from experiments.heldout import heldout_lines

    root = tmp_path / "copy"
    shutil.copytree(path, root)
    results = root / "results"
    summary = results / "r1" / "runs" / "baseline" / "seed0" / "summary.json"
    data = json.loads(summary.read_text())
    data["initial"]["eval/accuracy"] = float("nan")
    summary.write_text(json.dumps(data))
    metrics = results / "r2" / "runs" / "kl" / "seed1" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    for row in rows:
        if row["step"] == STEP:
            row["eval/accuracy"] = float("nan")
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _nan_weights(results / "r2" / "runs" / "kl" / "seed0" / "checkpoints" / f"step_{STEP}" / "actor" /
                 "model.safetensors")

    capsys.readouterr()
    assert heldout(root, "nan.json") == 0
    out = capsys.readouterr().out
    record = strict_json((root / "nan.json").read_text())
    assert record["warm_start"]["seeds"][0]["eval_accuracy"] is None
    final = {row["seed"]: row for row in record["final_choice"]["seeds"]}
    assert final[1]["eval_accuracy"] is None and final[0]["accuracy"] is None and final[0]["greedy_accuracy"] is None
    assert final[1]["accuracy"] is not None and record["final_choice"]["summary"]["accuracy"]["n"] == 1
    missing = record["missing"]
    assert len(missing) == 3, missing
    assert any("r1 baseline seed 0's eval/accuracy before training is nan" in m for m in missing)
    assert any("r2 kl seed 1's eval/accuracy at step 1 is nan" in m for m in missing)
    assert any("has non-finite weights" in m for m in missing)
    assert out.count("notice: ") == 3 and "3 missing value(s)" in out
    lines = "\n".join(heldout_lines(record))
    assert "Missing values (shown as -, left out of the means)" in lines and "non-finite weights" in lines
