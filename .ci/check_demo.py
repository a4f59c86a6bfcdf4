"""CI: reproduce the demo's first stages (data, sft, rm, round 1) in this clone and compare them
with what is committed: the content hashes of the stage outputs in dvc.lock, round 1's params and
its report (metrics, learning curves, report.md and the per-seed values), round 1's results
included: its run dirs' machine records (timings, wall clocks, hosts, logs: rlhf/run_dir.py's
MACHINE_RECORDS) are left out of its hash by .dvcignore, and everything else in them is the same
bits on every machine.

    python .ci/check_demo.py          # after `dvc repro round1`

Exit 0 when everything matches, 1 with one line per difference otherwise. Bitwise equality is
asked of every x86-64 CPU with AVX2, Intel or AMD, under the engine's default `portable` numerics
(rlhf/numerics.py; bench/cpu_numerics.py measured the same bits on AMD EPYC and Intel Xeon) and the
torch release the README pins. Outside that (another profile, another torch, another architecture)
the differences are printed, with the reason, but do not fail.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = ("data/arithmetic", "models/sft", "data/rm_pairs", "models/rm", "results/round1")
REPORTS = ("params/round1.yaml", "reports/round1/metrics.json", "reports/round1/curves.csv",
           "reports/round1/report.md", "reports/round1/seeds.csv")
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


def out_hashes(lock_text: str) -> dict:
    lock = yaml.safe_load(lock_text)
    found = {}
    for stage in lock.get("stages", {}).values():
        for out in stage.get("outs", []):
            found[out["path"]] = out.get("md5")
    return found


def main() -> int:
    committed = out_hashes(subprocess.run(["git", "show", "HEAD:dvc.lock"], cwd=REPO, check=True,
                                          capture_output=True, text=True).stdout)
    now = out_hashes((REPO / "dvc.lock").read_text())
    problems = [f"{path}: committed {committed.get(path)}, reproduced {now.get(path)}"
                for path in OUTPUTS if committed.get(path) != now.get(path)]
    for report in REPORTS:
        shown = subprocess.run(["git", "show", f"HEAD:{report}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode != 0:
            problems.append(f"{report}: not committed")
        elif shown.stdout != (REPO / report).read_text():
            problems.append(f"{report}: differs from the committed one (git diff HEAD -- {report})")
    here = (json.loads((REPO / "results" / "round1" / "provenance.json").read_text()).get("hardware_fingerprint")
            if (REPO / "results" / "round1" / "provenance.json").exists() else None)
    for line in problems:
        print(f"demo does not reproduce: {line}")
    if not problems:
        print(f"demo reproduces: {', '.join(OUTPUTS)}, round 1's params and report equal what is committed "
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
