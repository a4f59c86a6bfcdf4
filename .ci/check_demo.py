"""CI: reproduce the demo's first stages (data, sft, rm, round 1) in this clone and compare them
with what is committed: the content hashes of the stage outputs in dvc.lock and round 1's report
(its metrics and learning curves). Run ids, timings and wall clocks are not compared: the round's
run directories hold them, so results/round1 itself is not.

    python .ci/check_demo.py          # after `dvc repro round1`

Exit 0 when everything matches, 1 with one line per difference otherwise. Bitwise equality is
asked of the same kind of machine (`hardware` in round 1's metrics.json: the engine's hardware
fingerprint of the runs); on another CPU model the differences are printed but do not fail,
since the pinned CPU numerics (rlhf/numerics.py) do not yet give the same bits on every vendor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = ("data/arithmetic", "models/sft", "data/rm_pairs", "models/rm")
REPORTS = ("reports/round1/metrics.json", "reports/round1/curves.csv")


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
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", report], cwd=REPO)
        if diff.returncode:
            problems.append(f"{report}: differs from the committed one (git diff HEAD -- {report})")
    made_on = json.loads(subprocess.run(["git", "show", f"HEAD:{REPORTS[0]}"], cwd=REPO, check=True,
                                        capture_output=True, text=True).stdout).get("hardware")
    here = json.loads((REPO / REPORTS[0]).read_text()).get("hardware")
    same_machine = made_on == here
    for line in problems:
        print(f"demo does not reproduce: {line}")
    if not problems:
        print(f"demo reproduces: {', '.join(OUTPUTS)} and round 1's report equal what is committed")
    elif not same_machine:
        print(f"(the committed demo was made on {made_on}, this run on {here}: reported, not failed)")
    return 1 if problems and same_machine else 0


if __name__ == "__main__":
    sys.exit(main())
