"""DVC's experiment workflow on the demo pipeline, with real DVC and git in a repository that holds
this checkout's working tree (its DVC outputs left out, so nothing slow runs):
`dvc exp run -S '++round1.ppo.kl_coef=0.1'` reaches round 1's params file and its runs' bindings;
an edit of the generated params/round1.yaml is refused, not overwritten; a fresh clone's
`dvc pull` says there is no remote, and pulls once one is added; `dvc plots show --json` draws one
line per variant; metrics.json's keys are the same numbers in every round, so `dvc metrics diff`
compares them."""

import argparse
import csv
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml

from experiments.cli import SUBCOMMANDS, _apply_overrides, build_parser
from experiments.plan import expand
from experiments.report import write_report
from experiments.stages import cmd_export, metric_key
from experiments.study import load_study
from rlhf.configurable import flat_dict, resolve
from tests.conftest import REPO
from tests.experiments.conftest import fake_run

GIT_USER = ["-c", "user.name=test", "-c", "user.email=test@localhost"]


def run(argv, cwd, check=True):
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, WANDB_MODE="disabled"))
    if check and proc.returncode != 0:
        raise AssertionError(f"{argv} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def dvc(cwd, *args, check=True):
    return run([sys.executable, "-m", "dvc", *args], cwd, check)


def git(cwd, *args):
    return run(["git", *GIT_USER, *args], cwd)


def worktree_repo(dest: Path) -> Path:
    """A git repository holding this checkout's working tree as it is (tracked files and untracked
    ones git does not ignore), committed: the pipeline as the code stands, without DVC outputs."""
    listed = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], REPO).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    git(dest, "init", "-q")
    for key, value in (("user.name", "test"), ("user.email", "test@localhost")):  # `dvc exp run` commits
        git(dest, "config", key, value)
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "working tree")
    return dest


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    path = worktree_repo(tmp_path_factory.mktemp("dvc_workflow") / "repo")
    dvc(path, "repro", "--single-item", "params_round1")  # as the code now writes it (its stamp)
    git(path, "add", "-A")
    git(path, "commit", "-qm", "params", "--allow-empty")
    return path


def _restore(repo: Path) -> None:
    git(repo, "checkout", "-q", "--", ".")


def test_exp_run_set_param_reaches_the_rounds_params_and_runs(repo, monkeypatch):
    """The README's command: `-S '++round1.ppo.kl_coef=0.1'` writes params.yaml's round1 overrides;
    the params stage regenerates params/round1.yaml with them, and the round's own command line
    (dvc.yaml's round1 cmd) gives every run that binding."""
    _restore(repo)
    out = dvc(repo, "exp", "run", "--single-item", "-S", "++round1.ppo.kl_coef=0.1", "params_round1")
    assert "Running stage 'params_round1'" in out.stdout, out.stdout
    assert yaml.safe_load((repo / "params.yaml").read_text())["round1"] == {"ppo": {"kl_coef": 0.1}}
    params = yaml.safe_load((repo / "params" / "round1.yaml").read_text())
    assert params["baseline"]["ppo"]["kl_coef"] == 0.1
    diff = dvc(repo, "params", "diff").stdout
    assert "round1.ppo.kl_coef" in diff and "changed.ppo.kl_coef" in diff and "0.1" in diff, diff
    assert "baseline." not in diff  # the engine defaults are in the file, not in DVC's params views

    stage = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]["round1"]
    assert {"params.yaml": ["round1"]} in stage["params"]
    argv = shlex.split(stage["cmd"].split("&&")[0])
    assert argv[:4] == ["python", "-m", "experiments", "run"]
    monkeypatch.chdir(repo)
    args = build_parser("run").parse_args(argv[3:])
    _apply_overrides(args, SUBCOMMANDS["run"])
    study = load_study(args.study, args.bindings)
    assert "ppo.kl_coef = 0.1" in study.baseline_bindings
    assert flat_dict(resolve(study.baseline_recipe, study.baseline_bindings)[0])["ppo.kl_coef"] == 0.1


def test_a_hand_edit_of_the_generated_params_is_refused(repo):
    _restore(repo)
    out = dvc(repo, "exp", "run", "--single-item", "-S", "params/round1.yaml:baseline.ppo.kl_coef=0.2",
              "params_round1", check=False)
    assert out.returncode != 0
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert said == [("error: params/round1.yaml was edited by hand (baseline.ppo.kl_coef: 0.05 -> 0.2), but it is "
                     "generated from recipes/studies/round1.gin by `python -m experiments params` and regenerating "
                     "it would lose the edit: restore it (git checkout -- params/round1.yaml) and set it in "
                     "params.yaml instead: dvc exp run -S '++round1.ppo.kl_coef=0.2'")], out.stdout + out.stderr
    text = (repo / "params" / "round1.yaml").read_text()
    assert yaml.safe_load(text)["baseline"]["ppo"]["kl_coef"] == 0.2  # the edit is still there, not lost
    assert "GENERATED: do not edit" in text and "dvc exp run -S '++round1.ppo.kl_coef=0.1'" in text
    _restore(repo)


def test_a_misspelt_set_key_says_how_to_restore_params_yaml(repo):
    """`dvc exp run -S` writes the key into params.yaml before the stage refuses it; the one line says
    so and how to undo it, and after that restore the pipeline runs again."""
    _restore(repo)
    out = dvc(repo, "exp", "run", "--single-item", "-S", "++round1.ppo.kl_cof=0.1", "params_round1", check=False)
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error: ")]
    assert out.returncode != 0 and len(said) == 1, out.stdout + out.stderr
    assert "ppo.kl_cof is not a known binding" in said[0] and "git checkout -- params.yaml" in said[0], said
    assert "kl_cof" in (repo / "params.yaml").read_text()  # what DVC leaves behind, as the line says
    git(repo, "checkout", "--", "params.yaml")
    assert dvc(repo, "status", "params_round1").returncode == 0
    _restore(repo)


def test_a_fresh_clone_pulls_from_the_remote_it_is_given(repo, tmp_path):
    """No remote is configured: a fresh clone's `dvc pull` says so (README: run `dvc repro`, or add
    the team's remote); with `dvc remote add -d` and a `dvc push`, another clone pulls the outputs."""
    _restore(repo)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(repo), str(fresh))
    out = dvc(fresh, "pull", check=False)
    assert out.returncode != 0 and "No remote provided and no default remote set" in out.stdout + out.stderr

    dvc(repo, "repro", "--single-item", "data")
    dvc(repo, "remote", "add", "-d", "shared", str(tmp_path / "shared"))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "data and a shared remote")
    dvc(repo, "push", "data")
    again = tmp_path / "again"
    git(tmp_path, "clone", "-q", str(repo), str(again))
    dvc(again, "pull", "data")
    for name in ("train.jsonl", "eval.jsonl", "meta.json"):
        assert (again / "data" / "arithmetic" / name).read_bytes() == (repo / "data" / "arithmetic" / name).read_bytes()
    dvc(repo, "remote", "remove", "shared")
    git(repo, "commit", "-qam", "no remote")


ROUND2 = """
study.name = 'round2'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 5']
study.variants = {'kl_up': 'ppo.kl_coef = 0.1', 'clip_up': 'ppo.clip_range = 0.3'}
study.seeds = 3
"""


def _export_round2(repo: Path, gold: dict, variants: Optional[dict] = None) -> dict:
    """A finished synthetic round 2 (its run dirs written as the engine leaves them), exported to
    reports/round2 by the pipeline's own export; returns its metrics.json."""
    shutil.rmtree(repo / "results" / "round2", ignore_errors=True)
    path = repo / "round2_synthetic.gin"
    path.write_text(ROUND2)
    study = load_study(path, [f"study.variants = {variants!r}"] if variants else [])
    if variants:
        gold = dict(zip(["baseline", *variants], gold.values()))
    specs = expand(study, "results")
    for spec in specs:
        fake_run(spec, gold[spec.variant][spec.seed])
    write_report(study, repo / "results" / "round2", specs)
    assert cmd_export(argparse.Namespace(study=str(path), binding=[], results="results", out="reports")) == 0
    path.unlink()
    return json.loads((repo / "reports" / "round2" / "metrics.json").read_text())


def test_plots_draw_one_line_per_variant_and_metrics_keys_are_stable(repo, monkeypatch):
    _restore(repo)
    monkeypatch.chdir(repo)
    metrics = _export_round2(repo, {"baseline": [0.50, 0.52, 0.49], "kl_up": [0.70, 0.72, 0.69],
                                    "clip_up": [0.50, 0.51, 0.50]})
    decision = metrics["decision"]
    assert decision["chosen"] == "kl_up" and metrics["variants"]["kl_up"]["verdict"] == "better"
    for key in ("chosen_value", "baseline_value", "effect", "p_value"):
        assert isinstance(decision[key], float), key
    assert decision["effect"] == pytest.approx(0.2) == metrics["variants"]["kl_up"]["difference"]
    assert decision["baseline_value"] == pytest.approx(0.5033, abs=1e-4)
    assert decision["chosen_value"] == pytest.approx(0.7033, abs=1e-4)
    assert set(metrics) == {"decision", "variants"} and set(metrics["variants"]) == {"kl_up", "clip_up"}

    shown = json.loads(dvc(repo, "plots", "show", "--json").stdout)["data"]
    spec = shown["round2 gold accuracy"][0]["content"]
    assert spec["encoding"]["color"]["field"] == "series" and spec["encoding"]["strokeDash"]["field"] == "rev"
    assert {"calculate": "datum.study + '/' + datum.variant", "as": "series"} in spec["transform"]
    lines = {}
    for row in spec["data"]["values"]:  # the template's transforms: blank values left out, a line per series
        if row["eval_accuracy"] not in ("", None):
            lines.setdefault((row["study"] + "/" + row["variant"], row["rev"]), []).append(int(row["step"]))
    assert set(lines) == {(f"round2/{v}", "workspace") for v in ("baseline", "kl_up", "clip_up")}
    for steps in lines.values():
        assert steps == sorted(set(steps)) and len(steps) == 2  # no zig-zag: each line goes forward in steps
    assert "gold accuracy, every round" in shown and "reward-model score, every round" in shown
    dvc(repo, "plots", "show")  # the HTML, under dvc_plots/, which git ignores
    assert (repo / "dvc_plots" / "index.html").is_file()
    assert "dvc_plots" not in run(["git", "status", "--porcelain"], repo).stdout

    git(repo, "add", "reports/round2")
    git(repo, "commit", "-qm", "round 2")
    _export_round2(repo, {"baseline": [0.50, 0.52, 0.49], "kl_up": [0.60, 0.62, 0.59],
                          "clip_up": [0.50, 0.51, 0.50]})
    diff = json.loads(dvc(repo, "metrics", "diff", "--json").stdout)["reports/round2/metrics.json"]
    assert diff["decision.effect"]["diff"] == pytest.approx(-0.1)
    assert diff["decision.chosen_value"]["diff"] == pytest.approx(-0.1)
    assert "decision.baseline_value" not in diff  # unchanged
    _restore(repo)


def test_a_variant_name_with_dots_is_one_metrics_key():
    assert metric_key("kl_coef_x8.2") == "kl_coef_x8_2"
    assert metric_key("a.b", taken=["a_b"]) == "a_b_2" and metric_key("lr 1e-6/2") == "lr_1e-6_2"


def test_exp_show_has_a_column_per_changed_parameter_and_stable_metrics(repo, monkeypatch):
    """Two experiments that differ in one override: `dvc exp show --csv` has the decision's columns,
    per-variant columns without dots, and the round's changed parameters, never every engine default."""
    _restore(repo)
    monkeypatch.chdir(repo)
    _export_round2(repo, {"baseline": [0.50, 0.52, 0.49], "kl_up": [0.70, 0.72, 0.69],
                          "clip_up": [0.50, 0.51, 0.50]}, variants={"kl_x8.2": "ppo.kl_coef = 0.1",
                                                                     "clip_up": "ppo.clip_range = 0.3"})
    git(repo, "add", "reports/round2")
    git(repo, "commit", "-qm", "round 2")
    for kl in ("0.1", "0.2"):
        dvc(repo, "exp", "run", "--single-item", "-S", f"++round1.ppo.kl_coef={kl}", "params_round1")
    rows = list(csv.DictReader(io.StringIO(dvc(repo, "exp", "show", "--csv").stdout)))
    columns = list(rows[0])  # a key, or 'file:key' where two files share it
    keys = {c: c.rpartition(":")[2] for c in columns}
    decision = {f"decision.{k}" for k in ("chosen", "chosen_value", "baseline_value", "effect", "p_value")}
    per_variant = {f"variants.{v}.{k}" for v in ("kl_x8_2", "clip_up") for k in ("difference", "verdict")}
    assert decision | per_variant <= set(keys.values()), columns
    fixed = {"Experiment", "rev", "typ", "Created", "parent", "State", "Executor"}
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].values()
    deps = {dep for stage in stages for dep in stage.get("deps", [])}  # a column each: their hashes
    shown = [c for c in columns if c not in fixed and c not in deps]
    for c in shown:  # every round's metrics (the committed rounds too): the same stable keys
        key = keys[c]
        assert (key in decision or re.fullmatch(r"variants\.[\w-]+\.(difference|verdict)", key)
                or key.startswith(("changed.", "round1", "round2", "round3"))), c  # no engine default
    kl = next(c for c in columns if c in ("changed.ppo.kl_coef", "params/round1.yaml:changed.ppo.kl_coef"))
    assert {r[kl] for r in rows if r[kl] not in ("", "-")} == {"0.1", "0.2"}  # (the workspace is the last one)
    assert len(shown) < 50, shown
    _restore(repo)
