"""The round results DVC versions hold no machine record: `.dvcignore` names every file of
rlhf/run_dir.py's MACHINE_RECORDS under results/, and DVC leaves such files out of an output's
hash (checked with DVC itself on a stage that writes a random one)."""

import subprocess
from pathlib import Path

from rlhf.run_dir import MACHINE_RECORDS
from tests.conftest import REPO


def test_dvcignore_names_every_machine_record():
    patterns = {line.strip() for line in (REPO / ".dvcignore").read_text().splitlines()}
    assert {f"/results/**/{name}" for name in MACHINE_RECORDS} <= patterns


def _out_hash(repo: Path) -> str:
    subprocess.run(["dvc", "repro", "-q", "-f"], cwd=repo, check=True, capture_output=True)
    lock = (repo / "dvc.lock").read_text()
    return next(line.split()[-1] for line in lock.splitlines() if line.strip().startswith("md5:") and ".dir" in line)


def test_a_machine_record_does_not_change_a_results_hash(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=repo, check=True)
    (repo / ".dvcignore").write_text((REPO / ".dvcignore").read_text())
    writes = " && ".join(f"head -c 16 /dev/urandom | od -x > results/round1/runs/a/seed0/{name}" for name in MACHINE_RECORDS)
    (repo / "dvc.yaml").write_text(
        "stages:\n  round1:\n    cmd: mkdir -p results/round1/runs/a/seed0 && echo 0.5 > results/round1/runs/a/seed0/"
        f"summary.json && {writes}\n    outs:\n      - results/round1\n")
    first, second = _out_hash(repo), _out_hash(repo)
    assert first == second
    (repo / ".dvcignore").write_text("")  # without it the random records would move the hash
    assert _out_hash(repo) != first
