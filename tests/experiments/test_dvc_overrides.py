"""A round's overrides (`--overrides FILE:KEY`, the pipeline's params.yaml:roundN): read as bindings
in either YAML shape, applied to every run's baseline so the changed runs get new hashes and the
others keep theirs, and refused in one line naming FILE:KEY (exit 2, no traceback) when a binding is
unknown or invalid."""

import subprocess
import sys

import pytest
import yaml

from experiments.errors import StudyError
from experiments.overrides import read_overrides
from experiments.plan import expand
from experiments.study import load_study
from tests.conftest import REPO

STUDY = """
study.name = 's'
study.baseline_recipe = 'tiny.gin'
study.baseline_bindings = ['ppo.total_steps = 4']
study.variants = {'kl_up': 'ppo.kl_coef = 0.1', 'clip_up': 'ppo.clip_range = 0.3'}
study.seeds = 2
"""

OVERRIDES = {
    "round1": {},
    "nested": {"ppo": {"clip_range": 0.3, "overlap_rollout": "auto"}, "study": {"seeds": 3}},
    "dotted": {"ppo.clip_range": 0.25},
    "unknown": {"ppo": {"clip_rnage": 0.3}},
    "invalid": {"ppo": {"clip_range": "wide"}},
    "scope": {"optimizer": {"lr": 0.1}},
    "name": {"study": {"name": "other"}},
    "seeds": {"study": {"seeds": 0}},
    "not_a_mapping": [1, 2],
    "variant_as_baseline": {"ppo": {"kl_coef": 0.1}},
}


@pytest.fixture
def overrides(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(OVERRIDES))
    return path


def test_overrides_read_as_bindings(overrides):
    assert read_overrides(f"{overrides}:round1") == ()
    assert read_overrides(f"{overrides}:nested") == ("ppo.clip_range = 0.3", "ppo.overlap_rollout = 'auto'",
                                                     "study.seeds = 3")
    assert read_overrides(f"{overrides}:dotted") == ("ppo.clip_range = 0.25",)


def test_overridden_runs_rerun_and_the_others_keep_their_hashes(write_study, overrides, tmp_path, monkeypatch):
    """The overrides join the baseline of every variant: a run whose config they change gets a new
    hash (so it reruns); a variant that sets that parameter itself keeps its own value, its config
    and its hash (its runs are reused)."""
    monkeypatch.chdir(tmp_path)
    path = write_study(STUDY)
    plain = {s.key: s for s in expand(load_study(path), "results")}
    bindings = read_overrides(f"{overrides}:dotted")
    study = load_study(path, bindings)
    assert "ppo.clip_range = 0.25" in study.baseline_bindings
    changed = {s.key: s for s in expand(study, "results")}
    assert set(changed) == set(plain)
    for key, spec in changed.items():
        own = spec.variant == "clip_up"
        assert f"ppo.clip_range = {0.3 if own else 0.25}" in spec.operative_config
        assert (spec.run_hash == plain[key].run_hash) is own, key
    assert changed["clip_up/seed0"].changes == {"ppo.clip_range": 0.3}
    study_level = load_study(path, read_overrides(f"{overrides}:nested"))
    assert study_level.seeds == (0, 1, 2)


def _plan(study, spec, cwd):
    return subprocess.run([sys.executable, "-m", "experiments", "plan", str(study), "--overrides", spec], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("key, says", [
    ("unknown", "ppo.clip_rnage is not a known binding; did you mean ppo.clip_range?"),
    ("invalid", "ppo.clip_range = 'wide' is invalid"),
    ("scope", "binds scope 'optimizer'; allowed scopes: ppo"),
    ("name", "study.name may not be overridden"),
    ("seeds", "study.seeds = 0 is invalid"),
    ("not_a_mapping", "must be a mapping {scope: {parameter: value}}"),
    ("variant_as_baseline", "makes study.variants['kl_up'] (ppo.kl_coef = 0.1) the baseline"),
    ("round9", "has no key 'round9' (its keys: dotted, invalid"),
])
def test_a_bad_override_is_one_line_naming_the_file_and_key(write_study, overrides, tmp_path, key, says):
    proc = _plan(write_study(STUDY), f"params.yaml:{key}", tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"error: --overrides params.yaml:{key}") and says in lines[0], lines[0]
    if key in ("unknown", "invalid", "variant_as_baseline"):  # how to undo the `dvc exp run -S` that set it
        assert "git checkout -- params.yaml" in lines[0], lines[0]


def test_a_missing_overrides_file_or_key_is_refused(write_study, tmp_path):
    for spec, says in (("nothing.yaml:round1", "'nothing.yaml' does not exist"),
                       ("round1", "expected FILE:KEY, e.g. params.yaml:round1")):
        proc = _plan(write_study(STUDY), spec, tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert says in proc.stderr


def test_the_pipeline_overrides_start_empty():
    """params.yaml, as committed, overrides nothing: each round runs its recipe as written."""
    committed = yaml.safe_load((REPO / "params.yaml").read_text())
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    rounds = sorted(name for name in stages if name.startswith("round"))
    assert rounds and committed == {name: {} for name in rounds}
    for name in rounds:
        assert read_overrides(f"{REPO / 'params.yaml'}:{name}") == ()
        with pytest.raises(StudyError, match="has no key 'round9'"):
            read_overrides(f"{REPO / 'params.yaml'}:round9")
