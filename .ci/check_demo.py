"""Checks that a clone's `dvc repro` reproduced the committed demo: every stage DVC finds up to date
in this clone (all of them after the README's `dvc repro`; data, sft, rm, params_round1 and round1
after CI's `dvc repro round1`) must have the committed output hashes in dvc.lock, and each output
kept in git (params, reports) the committed bytes. The rounds' results are included: their run
dirs' machine records (timings, wall clocks, hosts, logs: rlhf/run_dir.py's MACHINE_RECORDS) are
left out of their hashes by .dvcignore, and everything else in them is the same bits on every
machine.

    python .ci/check_demo.py          # after `dvc repro` (or `dvc repro round1`)

Exit 0 when everything matches, 1 with one line per difference otherwise (also when round 1 was
not reproduced). Bitwise equality is asked of every x86-64 CPU with AVX2, Intel or AMD, under the
engine's default `portable` numerics (rlhf/numerics.py; bench/cpu_numerics.py measured the same
bits on AMD EPYC and Intel Xeon) and the torch release the README pins. Outside that (another
profile, another torch, another architecture) the differences are printed, with the reason, but do
not fail.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
REQUIRED = ("data", "sft", "rm", "params_round1", "round1")
"""The stages CI reproduces (`dvc repro round1`): the check fails when one of them is not up to date."""
PINNED_TORCH = "2.13.0"  # the README's and .ci/run's pin, with which the committed demo was made


def not_comparable() -> str | None:
    """Why this machine is not expected to give the committed bits, or None when it is."""
    from importlib.metadata import version

    sys.path.insert(0, str(REPO))
    from rlhf import numerics
    from rlhf.provenance import cpu_info
    if numerics.profile() != "portable":
        return f"{numerics.PROFILE_ENV}={numerics.profile()}: only the portable profile is the same on every CPU"
    if platform.machine() != "x86_64" or "avx2" not in cpu_info().get("kernel_flags", []):
        return f"{platform.machine()} without AVX2: the portable profile pins x86-64's AVX2 kernels"
    torch = version("torch").split("+")[0]
    if torch != PINNED_TORCH:
        return f"torch {torch}, the demo was made with torch {PINNED_TORCH}"
    return None


def stage_outs(lock_text: str) -> dict:
    """{stage: {out path: md5}} of a dvc.lock."""
    lock = yaml.safe_load(lock_text)
    return {name: {out["path"]: out.get("md5") for out in stage.get("outs", [])}
            for name, stage in lock.get("stages", {}).items()}


def reproduced_stages() -> list:
    """The stages `dvc status` finds up to date here (their deps and outs as dvc.lock records them)."""
    shown = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
    changed = set(json.loads(shown or "{}"))
    return [name for name in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"] if name not in changed]


def main() -> int:
    committed = stage_outs(subprocess.run(["git", "show", "HEAD:dvc.lock"], cwd=REPO, check=True,
                                          capture_output=True, text=True).stdout)
    now = stage_outs((REPO / "dvc.lock").read_text())
    stages = reproduced_stages()
    problems = [f"stage {name} is not up to date here: run `dvc repro {name}` first"
                for name in REQUIRED if name not in stages]
    for name in stages:
        for path, md5 in now.get(name, {}).items():
            in_git = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=REPO,
                                    capture_output=True).returncode == 0
            if committed.get(name, {}).get(path) != md5:
                problems.append(f"{path}: committed {committed.get(name, {}).get(path)}, reproduced {md5}"
                                + (f" (git diff HEAD -- {path})" if in_git else ""))
            elif in_git and subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path], cwd=REPO).returncode:
                problems.append(f"{path}: differs from the committed one (git diff HEAD -- {path})")
    provenance = REPO / "results" / "round1" / "provenance.json"
    here = json.loads(provenance.read_text()).get("hardware_fingerprint") if provenance.exists() else None
    for line in problems:
        print(f"demo does not reproduce: {line}")
    if not problems:
        print(f"demo reproduces: the outputs of {', '.join(stages)} equal what is committed "
              f"(reproduced on {', '.join(here or ['?'])})")
        return 0
    reason = not_comparable()
    if reason:
        print(f"(reported, not failed: {reason})")
        return 0
    print(f"(reproduced on {here}: the portable numerics promise the committed bits on every x86-64 CPU with AVX2)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
