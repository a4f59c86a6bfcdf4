"""The round results DVC versions hold no machine record: `.dvcignore` names every file of
rlhf/run_dir.py's MACHINE_RECORDS under results/, and DVC leaves such files out of an output's
hash (checked with DVC itself on a stage that writes a random one)."""

import os
import subprocess
import sys
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
    writes = " && ".join(f"head -c 16 /dev/urandom | od -x > results/round1/runs/a/seed0/{name}"
                         for name in MACHINE_RECORDS)
    (repo / "dvc.yaml").write_text(
        "stages:\n  round1:\n    cmd: mkdir -p results/round1/runs/a/seed0 && echo 0.5 > results/round1/runs/a/seed0/"
        f"summary.json && {writes}\n    outs:\n      - results/round1\n")
    first, second = _out_hash(repo), _out_hash(repo)
    assert first == second
    (repo / ".dvcignore").write_text("")  # without it the random records would move the hash
    assert _out_hash(repo) != first


def test_bytecode_is_not_a_code_change(tmp_path):
    """Importing the code writes __pycache__/*.pyc next to it; `dvc status` still says the stage
    that depends on the code is up to date."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=repo, check=True)
    (repo / ".dvcignore").write_text((REPO / ".dvcignore").read_text())
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (repo / "dvc.yaml").write_text("stages:\n  use:\n    cmd: python -c 'import pkg.mod' && echo ok > out.txt\n"
                                   "    deps:\n      - pkg\n    outs:\n      - out.txt\n")
    subprocess.run(["dvc", "repro", "-q"], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    subprocess.run([sys.executable, "-c", "import pkg.mod"], cwd=repo, check=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    assert list((repo / "pkg").rglob("*.pyc")), "python wrote no bytecode to test with"
    status = subprocess.run(["dvc", "status", "--json"], cwd=repo, check=True, capture_output=True, text=True)
    assert status.stdout.strip() in ("{}", "")
