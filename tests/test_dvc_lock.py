"""The committed dvc.lock records the committed tree: a fresh clone's `dvc repro` reruns no stage for a
dependency the commit changed and leaves dvc.lock as committed (any edit to a stage's dependency, a
recipe's comment included, needs the demo regenerated: `dvc repro`, then dvc.lock and reports/ committed)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def changed_dependencies(status: dict) -> dict:
    """{stage: {path: state}} of `dvc status --json`'s dependencies that differ from dvc.lock, leaving out
    those a fresh clone lacks because another stage makes them ('deleted')."""
    out = {}
    for stage, entries in status.items():
        changed = {path: state for entry in entries if isinstance(entry, dict)
                   for path, state in entry.get("changed deps", {}).items() if state != "deleted"}
        if changed:
            out[stage] = changed
    return out


def test_changed_dependencies_leave_out_what_other_stages_make():
    status = {"round1": [{"changed deps": {"recipes/models": "modified", "models/sft": "deleted"}},
                         {"changed outs": {"results/round1": "not in cache"}}],
              "sft": [{"changed deps": {"data/arithmetic": "deleted"}}], "data": ["always changed"]}
    assert changed_dependencies(status) == {"round1": {"recipes/models": "modified"}}


def test_the_committed_lock_records_every_committed_dependency(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the committed tree is not at hand")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True)
    shown = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=clone, check=True,
                           capture_output=True, text=True, timeout=300)
    assert changed_dependencies(json.loads(shown.stdout or "{}")) == {}, (
        "dvc.lock is out of date with the committed tree: run `dvc repro` and commit dvc.lock and reports/")
