"""The DVC pipeline in a temporary clone: `dvc repro` runs every stage, a second repro does
nothing, a one-binding change in round 2 reruns exactly round 2 onward (and inside round 2 only
the runs whose hash changed), DVC's params/metrics/plots views work, and push/pull round-trip
through a local remote."""

import json
import os
import re
import subprocess

import pytest
import yaml

from tests.conftest import REPO

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
study.variants = {'kl_coef_up': 'ppo.kl_coef = 0.06', 'clip_range_up': 'ppo.clip_range = 0.24'}
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
    tiny = repo / "recipes" / "models" / "tiny.gin"
    tiny.write_text(tiny.read_text() + "sft.steps = 40  # a short warm start: the test checks the pipeline, not learning\n")
    rm = repo / "recipes" / "rm" / "tiny.gin"  # a short reward model, for the same reason
    assert "rm.steps = 1500" in rm.read_text()
    rm.write_text(rm.read_text().replace("rm.steps = 1500", "rm.steps = 20"))
    sh(f"dvc remote modify --local local url {root / 'remote'}", repo)
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm small", repo)
    env = dict(os.environ, WANDB_MODE="disabled", RLHF_CACHE=str(root / "cache"))
    return repo, root, env


@pytest.mark.slow
def test_repro_rerun_and_views(clone):
    repo, root, env = clone
    first = sh("dvc repro", repo, env)
    stages = set(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"])
    assert {"data", "sft", "params", "round1", "round2", "round3", "report"} <= stages
    assert ran_stages(first) == stages
    for n in (1, 2, 3):
        metrics = json.loads((repo / "reports" / f"round{n}" / "metrics.json").read_text())
        assert metrics["chosen"] and metrics["baseline"]["n"] == 2
        assert list((repo / "reports" / f"round{n}" / "plots").glob("*.png"))
    summary = (repo / "reports" / "summary.md").read_text()
    assert "round3" in summary and "Held-out evaluation" in summary

    # Nothing changed: nothing runs.
    assert ran_stages(sh("dvc repro", repo, env)) == set()
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm first", repo)

    # One binding of round 2 changes: round 2 onward reruns, and in round 2 only that variant's runs.
    round2 = repo / "recipes" / "studies" / "round2.gin"
    round2.write_text(round2.read_text().replace("ppo.clip_range = 0.24", "ppo.clip_range = 0.3"))
    before = {p: json.loads(p.read_text())["attempts"][-1]["start"]
              for p in (repo / "results" / "round2" / "runs").rglob("attempts.json")}
    second = sh("dvc repro", repo, env)
    assert ran_stages(second) == {"params", "round2", "round3", "report"}
    after = {p: json.loads(p.read_text())["attempts"][-1]["start"]
             for p in (repo / "results" / "round2" / "runs").rglob("attempts.json")}
    rerun = sorted(p.parent.parent.name for p in after if before.get(p) != after[p])
    assert rerun == ["clip_range_up", "clip_range_up"], rerun

    # DVC's views see the recipe's change through the generated params file.
    diff = sh("dvc params diff", repo, env)
    assert "variants.clip_range_up.ppo.clip_range" in diff and "0.24" in diff and "0.3" in diff
    assert "round2" in sh("dvc metrics show", repo, env)
    sh(f"dvc plots show -o {root / 'plots'}", repo, env)
    assert (root / "plots" / "index.html").exists()
    shown = sh("dvc exp show --no-pager --csv", repo, env)
    assert "variants.clip_range_up.ppo.clip_range" in shown


@pytest.mark.slow
def test_push_then_pull_in_a_fresh_clone(clone):
    repo, root, env = clone
    sh("dvc repro", repo, env)  # the lock of this clone's recipes (a no-op after the test above)
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm lock --allow-empty", repo)
    sh("dvc push", repo, env)
    fresh = root / "fresh"
    sh(f"git clone -q {repo} {fresh}", root)
    sh(f"dvc remote modify --local local url {root / 'remote'}", fresh)
    sh("dvc pull", fresh, env)
    for path in ("data/arithmetic/train.jsonl", "models/sft/model/model.safetensors", "results/round1/aggregate.json"):
        assert (fresh / path).read_bytes() == (repo / path).read_bytes(), path
    status = sh("dvc status", fresh, env)
    assert "changed" not in status


@pytest.mark.slow
def test_a_fresh_clone_reproduces_the_committed_lock(clone):
    """`dvc repro` from scratch in another clone, at another path, leaves `git status` clean: every
    stage output, the rounds' results included, hashes as committed (their machine records, which
    .dvcignore names, are not hashed)."""
    repo, root, env = clone
    sh("dvc repro", repo, env)  # the committed lock is this clone's recipes' (a no-op after the tests above)
    sh("git add -A && git -c user.name=t -c user.email=t@t commit -qm lock --allow-empty", repo)
    again = root / "elsewhere" / "again"
    again.parent.mkdir()
    sh(f"git clone -q {repo} {again}", root)
    out = sh("dvc repro", again, dict(env, RLHF_CACHE=str(root / "cache-again")))
    assert "round3" in ran_stages(out)
    assert sh("git status --porcelain", again).strip() == "", sh("git diff --stat", again)
    for run in (again / "results" / "round2" / "runs").rglob("run.json"):
        assert str(again) not in run.read_text() and str(repo) not in run.read_text()
