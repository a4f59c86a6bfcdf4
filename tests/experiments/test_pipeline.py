"""The DVC pipeline in a temporary clone: `dvc repro` runs every stage, a second repro does
nothing, a one-binding change in round 2 reruns exactly round 2 onward (and inside round 2 only
the runs whose hash changed), DVC's params/metrics/plots views work, and push/pull round-trip
through a local remote added to a clone (none is configured). Without the engine, on synthetic
run dirs: what the `params` and `export` stages write (a resumed round's params as its runs get
them; the exported report and per-seed values, the same bytes in every checkout).
tests/experiments/test_dvc_*.py check DVC's experiment workflow (overrides, a hand edit refused,
the params stage's dependencies, plots, metrics keys, pull)."""

import argparse
import csv
import dataclasses
import io
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from experiments.errors import StudyError
from experiments.plan import expand
from experiments.report import write_report
from experiments.results import aggregate_path, read_aggregate
from experiments.stages import cmd_export, cmd_params, study_params
from experiments.study import BASELINE, load_study
from tests.conftest import REPO
from tests.experiments.conftest import fake_checkpoint, fake_run, previous_study_aggregate

SMALL = {
    "round1.gin": """
study.name = 'round1'
study.baseline_recipe = 'demo.gin'
study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2', 'ppo.final_window = 2',
                           'task.eval_size = 16']
study.variants = {}
study.seeds = 2
""",
    "round2.gin": """
study.name = 'round2'
study.baseline_recipe = 'demo.gin'
study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2', 'ppo.final_window = 2',
                           'task.eval_size = 16']
study.variants = {'clip_range_up': 'ppo.clip_range = 0.24'}  # one variant: its change reruns it, not the baseline
study.seeds = 2
study.resume_from = 'results/round1'
""",
    "round3.gin": """
study.name = 'round3'
study.baseline_recipe = 'demo.gin'
study.baseline_bindings = ['ppo.total_steps = 2', 'ppo.eval_every = 2', 'ppo.save_every = 2', 'ppo.final_window = 2',
                           'task.eval_size = 16']
study.variants = {'kl_coef_down': 'ppo.kl_coef = 0.04'}
study.seeds = 2
study.resume_from = 'results/round2'
study.resume_setting = True
""",
}


def sh(cmd, cwd, env=None, check=True, timeout=1200):
    proc = subprocess.run(cmd, cwd=cwd, env=env, shell=True, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def ran_stages(output: str) -> set:
    return set(re.findall(r"Running stage '(\w+)'", output))


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    root = tmp_path_factory.mktemp("dvc")
    repo = root / "repo"
    sh(f"git clone -q {REPO} {repo}", root)
    for name, text in SMALL.items():
        (repo / "recipes" / "studies" / name).write_text(text.lstrip())
    tiny = repo / "recipes" / "models" / "tiny_llama.gin"
    tiny.write_text(tiny.read_text()
                    + "sft.steps = 40  # a short warm start: the test checks the pipeline, not learning\n")
    rm = repo / "recipes" / "rm" / "tiny_reward_model.gin"  # a short reward model, for the same reason
    assert "rm.steps = 1500" in rm.read_text()
    rm.write_text(rm.read_text().replace("rm.steps = 1500", "rm.steps = 20"))
    sh(f"dvc remote add --local -d shared {root / 'remote'}", repo)  # README: no remote is configured
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm small", repo)
    env = dict(os.environ, WANDB_MODE="disabled", RLHF_CACHE=str(root / "cache"))
    return repo, root, env


@pytest.mark.slow
def test_repro_rerun_and_views(clone):
    repo, root, env = clone
    first = sh("dvc repro", repo, env)
    stages = set(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"])
    assert {"data", "sft", "params_round1", "params_round2", "params_round3", "round1", "round2", "round3",
            "report"} <= stages
    assert ran_stages(first) == stages
    for n in (1, 2, 3):
        metrics = json.loads((repo / "reports" / f"round{n}" / "metrics.json").read_text())
        assert metrics["decision"]["chosen"] and metrics["decision"]["baseline_value"] is not None
        assert list((repo / "reports" / f"round{n}" / "plots").glob("*.png"))
        assert "## Per-seed values" in (repo / "reports" / f"round{n}" / "report.md").read_text()
        seeds = list(csv.DictReader((repo / "reports" / f"round{n}" / "seeds.csv").open()))
        assert len(seeds) == 2 * (1 + len(metrics["variants"]))  # two seeds per variant, the baseline's too
    # Round 3's params are what its runs got: round 2's chosen setting and round 2's checkpoints.
    params = yaml.safe_load((repo / "params" / "round3.yaml").read_text())
    round2 = json.loads((repo / "results" / "round2" / "aggregate.json").read_text())
    chosen = round2["decision"]["chosen"]
    assert params["study"]["resumed_setting"] == round2["variants"][chosen]["bindings"]
    for run in json.loads((repo / "results" / "round3" / "plan.json").read_text())["runs"]:
        assert run["init_from"] == params["baseline"]["ppo"]["init_from"][run["seed"]]
        assert run["init_from"].startswith(f"results/round2/runs/{chosen}/seed{run['seed']}/checkpoints/")
    summary = (repo / "reports" / "summary.md").read_text()
    # The first line is a verdict with its evidence; without a confirmation run the setting is unconfirmed.
    verdict = r"# Tuning path\n\n\*\*(Not confirmed|No tuned change|Nothing to deploy):\*\* "
    assert "round3" in summary and re.match(verdict, summary)
    assert "Model to ship:** `results/round3/runs/" in summary or "No model to ship" in summary
    assert "## Test split (no decision read it)" in summary and "**Next round" in summary

    # Nothing changed: nothing runs.
    assert ran_stages(sh("dvc repro", repo, env)) == set()
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm first", repo)

    # One binding of round 2 changes: round 2 onward reruns, and in round 2 only that variant's runs.
    round2 = repo / "recipes" / "studies" / "round2.gin"
    round2.write_text(round2.read_text().replace("ppo.clip_range = 0.24", "ppo.clip_range = 0.3"))
    before = {p: json.loads(p.read_text())["attempts"][-1]["start"]
              for p in (repo / "results" / "round2" / "runs").rglob("attempts.json")}
    second = sh("dvc repro", repo, env)
    assert ran_stages(second) == {"params_round2", "round2", "params_round3", "round3", "heldout", "confirm",
                                  "report"}
    after = {p: json.loads(p.read_text())["attempts"][-1]["start"]
             for p in (repo / "results" / "round2" / "runs").rglob("attempts.json")}
    rerun = sorted(p.parent.parent.name for p in after if before.get(p) != after[p])
    assert rerun == ["clip_range_up", "clip_range_up"], rerun

    # The generated params file holds the recipe's change; DVC's params views hold only what the
    # runs get that the recipes do not say (params.yaml's overrides, round N's `changed`): none here.
    assert "+      clip_range: 0.3" in sh("git diff -- params/round2.yaml", repo, env)
    assert "clip_range" not in sh("dvc params diff", repo, env)
    assert "round2" in sh("dvc metrics show", repo, env)
    sh(f"dvc plots show -o {root / 'plots'}", repo, env)
    assert (root / "plots" / "index.html").exists()
    shown = sh("dvc exp show --no-pager --csv", repo, env)
    assert "decision.effect" in shown and "variants.clip_range_up.difference" in shown


@pytest.mark.slow
def test_push_then_pull_in_a_fresh_clone(clone):
    repo, root, env = clone
    sh("dvc repro", repo, env)  # the lock of this clone's recipes (a no-op after the test above)
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm lock --allow-empty", repo)
    sh("dvc push", repo, env)
    fresh = root / "fresh"
    sh(f"git clone -q {repo} {fresh}", root)
    sh(f"dvc remote add --local -d shared {root / 'remote'}", fresh)
    sh("dvc pull", fresh, env)
    for path in ("data/arithmetic/train.jsonl", "models/sft/model/model.safetensors", "results/round1/aggregate.json"):
        assert (fresh / path).read_bytes() == (repo / path).read_bytes(), path
    status = sh("dvc status", fresh, env)
    assert "changed" not in status


@pytest.mark.slow
def test_a_fresh_clone_reproduces_the_committed_lock(clone):
    """`dvc repro` in another clone, at another path, leaves `git status` clean: every stage output, the
    rounds' results included, hashes as committed (their machine records, which .dvcignore names, are not
    hashed). The clone pulls what the stages up to round 1 made (data, sft, rm, round 1's results) and makes
    every later output from scratch with a cache of its own: round 2 resumes the pulled round 1 checkpoints,
    and its results, round 3's, the test split and the confirmation must be the committed bytes (here those
    of an incremental rerun: test_repro_rerun_and_views changed round 2).
    That data, sft, rm and round 1 reproduce from scratch in a fresh clone at another path is what CI checks
    before the tests, on the committed demo itself (`dvc repro round1` then .ci/check_demo.py, .ci/run)."""
    repo, root, env = clone
    sh("dvc repro", repo, env)  # the committed lock is this clone's recipes' (a no-op after the tests above)
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm lock --allow-empty", repo)
    sh("dvc push", repo, env)  # (a no-op after the test above)
    again = root / "elsewhere" / "again"
    again.parent.mkdir()
    sh(f"git clone -q {repo} {again}", root)
    sh(f"dvc remote add --local -d shared {root / 'remote'}", again)
    sh("dvc pull --with-deps round1", again, env)
    out = sh("dvc repro", again, dict(env, RLHF_CACHE=str(root / "cache-again")))
    # Every stage whose outputs DVC caches runs again; those whose outputs git holds (the params files, the
    # held-out scores, the summary) run only when a dependency's hash changed, and none did.
    assert ran_stages(out) == {"round2", "round3", "testsplit", "confirm"}
    assert sh("git status --porcelain", again).strip() == "", sh("git diff --stat", again)
    for run in (again / "results" / "round2" / "runs").rglob("run.json"):
        assert str(again) not in run.read_text() and str(repo) not in run.read_text()


RESUMED = """
study.name = 'next'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 4', 'ppo.clip_range = 0.15']
study.variants = {'lr_down': 'ppo.actor_learning_rate = 0.0001'}
study.seeds = 2
study.resume_from = 'results/prev'
study.resume_setting = True
"""


def test_a_resumed_rounds_params_are_what_its_runs_get(write_study, tmp_path, monkeypatch):
    """The params of a round that resumes the previous one: the previous choice's setting under the
    baseline's own bindings, and each seed's start checkpoint, as the planner gives its runs."""
    monkeypatch.chdir(tmp_path)
    path = write_study(RESUMED)
    with pytest.raises(StudyError, match="does not exist: run the previous study first"):
        study_params(str(path), [])  # before the previous round has run, nothing can be said
    prev = tmp_path / "results" / "prev"
    for seed in (0, 1):
        fake_checkpoint(prev / "runs" / "kl" / f"seed{seed}" / "checkpoints" / "step_4", b"weights %d" % seed)
    agg = previous_study_aggregate("prev", "kl", {BASELINE: [], "kl": [(s, "completed", f"runs/kl/seed{s}")
                                                                      for s in (0, 1)]})
    chosen = dataclasses.replace(agg.variants["kl"], bindings=("ppo.kl_coef = 0.2", "ppo.clip_range = 0.3"))
    agg.replace(variants={**agg.variants, "kl": chosen}).save(aggregate_path(prev))

    params = study_params(str(path), [])
    assert params["study"]["resume_from"] == "results/prev"
    assert params["study"]["resumed_setting"] == ["ppo.kl_coef = 0.2", "ppo.clip_range = 0.3"]
    ppo = params["baseline"]["ppo"]
    assert ppo["kl_coef"] == 0.2 and ppo["clip_range"] == 0.15  # inherited; the baseline's own binding wins
    starts = {s: f"results/prev/runs/kl/seed{s}/checkpoints/step_4" for s in (0, 1)}
    assert ppo["init_from"] == starts
    assert params["variants"] == {"lr_down": {"ppo": {"actor_learning_rate": 0.0001}}}
    specs = expand(load_study(path), "results")
    assert {s.seed: s.init_from for s in specs if s.variant == BASELINE} == starts
    for spec in specs:
        assert "ppo.kl_coef = 0.2" in spec.operative_config and "ppo.clip_range = 0.15" in spec.operative_config

    assert cmd_params(argparse.Namespace(studies=[str(path)], binding=[], out="params")) == 0
    text = (tmp_path / "params" / "next.yaml").read_text()
    assert text.startswith("# next's parameters as its runs get them") and "results/prev (the round it resumes)" in text
    assert yaml.safe_load(text) == params and str(tmp_path) not in text
    first = study_params(str(path), ["study.resume_from = ''"])  # a first round: no start checkpoint
    assert first["baseline"]["ppo"]["init_from"] == "" and first["study"]["resumed_setting"] == []
    assert first["baseline"]["ppo"]["kl_coef"] == 0.05


EXPORTED = """
study.name = 'syn'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = {'good': 'ppo.kl_coef = 0.1', 'broken': 'ppo.adam_eps = 1e-300'}
study.seeds = 3
study.guardrails = {'kl_divergence': {'max': 0.5}, 'rollout_success_rate': {'min': 0.95}}
study.equivalence_margin = 0.02
"""
GOLD = {"baseline": [0.50, 0.52, 0.49], "good": [0.70, 0.72, 0.69]}


def _export_in(checkout, path) -> dict:
    """A finished synthetic study in `checkout`/results, exported to `checkout`/reports from there."""
    checkout.mkdir(parents=True)
    os.chdir(checkout)
    study = load_study(path)
    specs = expand(study, "results")
    for spec in specs:
        fake_run(spec, GOLD.get(spec.variant, [0, 0, 0])[spec.seed], kl=0.7 if spec.seed == 2 else 0.05,
                 diverged=spec.variant == "broken")
        if spec.variant != "broken":
            fake_checkpoint(Path(spec.run_dir) / "checkpoints" / "step_5")
    write_report(study, checkout / "results" / "syn", specs)
    assert cmd_export(argparse.Namespace(study=str(path), binding=[], results="results", out="reports")) == 0
    return {f.name: f.read_bytes() for f in (checkout / "reports" / "syn").iterdir() if f.is_file()}


def test_export_writes_the_report_and_per_seed_values_the_same_in_every_checkout(write_study, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_study(EXPORTED)
    files = _export_in(tmp_path / "a", path)
    assert {"metrics.json", "curves.csv", "report.md", "seeds.csv"} <= set(files)
    assert _export_in(tmp_path / "elsewhere" / "b", path) == files  # no path, time or host of its own
    out = tmp_path / "elsewhere" / "b" / "reports" / "syn"
    agg = read_aggregate(Path("results") / "syn", "no aggregate")

    rows = list(csv.DictReader(io.StringIO(files["seeds.csv"].decode())))
    assert [(r["variant"], int(r["seed"])) for r in rows] == [(n, run.seed) for n, v in agg.variants.items()
                                                               for run in v.runs]
    for row, run in zip(rows, (run for v in agg.variants.values() for run in v.runs)):
        assert row["status"] == run.status.value
        assert (float(row["value"]) if row["value"] else None) == run.value
        for metric in ("kl_divergence", "rollout_success_rate"):
            assert (float(row[metric]) if row[metric] else None) == run.guardrails.get(metric)
        assert Path(row["run_dir"]).is_dir() and row["run_dir"].startswith("results/syn/runs/")
    assert [r["status"] for r in rows if r["variant"] == "broken"] == ["failed"] * 3

    report = files["report.md"].decode()
    assert report.startswith("# Study `syn`\n\n*The report of results/syn")
    for row in rows:  # the per-seed values, each verdict's evidence
        value = f"{float(row['value']):.4g}" if row["value"] else "–"
        assert f"| {row['variant']} | {row['seed']} | {row['status']} | {value} |" in report
    for section in ("## Both analyses", "TOST p (Welch)", "## Guardrails (final-window values)", "0.7",
                    "## Best checkpoint by gold"):
        assert section in report
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", report):  # the plots, exported beside it
        assert (out / link).is_file(), link
    named = re.findall(r"`(results/[^`]+)`", report)
    assert named and all(Path(p).is_dir() for p in named)  # checkpoints: paths from the repository root
    assert str(tmp_path) not in report
