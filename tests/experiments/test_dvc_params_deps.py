"""The `params_roundN` stages depend on everything `python -m experiments params` reads: the files
it opens and the modules it imports are traced while the stage's own command runs, and every
source file among them (tracked by git) must lie under one of the stage's `deps` or be one of its
`params` files, so a change to an engine default, a recipe it includes or the manager's code makes
DVC regenerate params/roundN.yaml. The committed params/round1.yaml is what the command writes now."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from experiments.overrides import read_overrides
from experiments.paths import portable
from experiments.stages import study_params
from experiments.study import load_study
from tests.conftest import REPO

TRACE = """
import atexit, os, runpy, sys
read = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        read.add(os.path.abspath(os.fsdecode(args[0])))
sys.addaudithook(hook)
def report():
    imported = {os.path.abspath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    with open(os.environ["PARAMS_TRACE"], "w") as f:
        f.write("\\n".join(sorted(read | imported)))
atexit.register(report)
sys.argv = ["experiments", *sys.argv[1:]]
runpy.run_module("experiments", run_name="__main__", alter_sys=True)
"""


def _stages():
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def _params_files(stage) -> set:
    return {next(iter(p)) if isinstance(p, dict) else "params.yaml" for p in stage.get("params", [])}


def _read_by(stage, tmp_path) -> set:
    """The repository files the stage's command reads (opens or imports), relative to the repository."""
    argv = shlex.split(stage["cmd"])
    assert argv[:3] == ["python", "-m", "experiments"] and "--out" in argv, stage["cmd"]
    argv[argv.index("--out") + 1] = str(tmp_path / "out")  # the committed params stay as they are
    trace = tmp_path / "trace.txt"
    subprocess.run([sys.executable, "-c", TRACE, *argv[3:]], cwd=REPO, check=True, capture_output=True,
                   env=dict(os.environ, PARAMS_TRACE=str(trace)), timeout=300)
    root = str(REPO.resolve()) + os.sep
    return {p[len(root):] for p in trace.read_text().splitlines() if p.startswith(root)}


def test_the_params_stage_depends_on_every_source_it_reads(tmp_path):
    stage = _stages()["params_round1"]
    tracked = set(subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout.splitlines())
    read = _read_by(stage, tmp_path) & tracked
    # The trace sees what decides the file: the engine's config defaults, the recipes gin includes,
    # the manager's study and plan code, the overrides.
    assert {"rlhf/config.py", "rlhf/configurable.py", "recipes/models/tiny_llama.gin", "recipes/demo.gin",
            "recipes/studies/round1.gin", "experiments/study.py", "experiments/stages.py", "params.yaml"} <= read
    deps = [Path(d) for d in stage["deps"]]
    missing = sorted(p for p in read if p not in _params_files(stage)
                     and not any(Path(p) == d or d in Path(p).parents for d in deps))
    assert missing == [], f"dvc.yaml's params_round1 reads these but does not list them under deps: {missing}"


def test_every_params_stage_lists_the_same_sources_and_the_round_it_resumes():
    """Rounds 2 and 3 read what round 1's params stage reads (their own recipe instead of round 1's)
    and the results of the round they resume (their `ppo.init_from` and inherited setting)."""
    stages = _stages()
    common = set(stages["params_round1"]["deps"]) - {"recipes/studies/round1.gin"}
    rounds = sorted(name[len("params_"):] for name in stages if name.startswith("params_round"))
    assert rounds == ["round1", "round2", "round3"]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        for name in rounds:
            stage = stages[f"params_{name}"]
            study = load_study(f"recipes/studies/{name}.gin")
            resumed = {portable(study.resume_from)} if study.resume_from else set()
            assert set(stage["deps"]) == common | {f"recipes/studies/{name}.gin"} | resumed, name
            assert {"params.yaml": [name]} in stage["params"] and f"--overrides params.yaml:{name}" in stage["cmd"]
            outs = stage["outs"][0][f"params/{name}.yaml"]
            assert outs == {"cache": False, "persist": True}  # kept while it runs: a hand edit is refused
            round_stage = stages[name]
            assert f"--overrides params.yaml:{name}" in round_stage["cmd"]
            assert {"params.yaml": [name]} in round_stage["params"]
    finally:
        os.chdir(cwd)


def test_the_committed_params_hold_every_binding_the_runs_get(monkeypatch):
    """params/round1.yaml as committed is what the command writes now: every engine default
    (ppo.overlap_rollout and the rest of rlhf/config.py), each recipe's binding, the overrides."""
    monkeypatch.chdir(REPO)
    committed = yaml.safe_load((REPO / "params" / "round1.yaml").read_text())
    now = study_params("recipes/studies/round1.gin", list(read_overrides("params.yaml:round1")))
    assert committed == now, "params/round1.yaml is stale: run `dvc repro params_round1`"
    assert "overlap_rollout" in committed["baseline"]["ppo"]
