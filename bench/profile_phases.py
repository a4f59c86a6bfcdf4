"""Where a PPO iteration's time goes, from a torch.profiler trace (not a test).

    python bench/profile_phases.py TRACE.json[.gz] [--json OUT.json]

Prints the per-phase table of `rlhf.profiling.summarize` (GPU busy and idle time, idle gaps, host
waits, kernel time by kind; the module says what each figure is) for a trace written by
`python -m rlhf.train ... --profile STEP` or `bench/ppo_step.py --profile DIR`, on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.profiling import PHASES, format_table, load_trace, summarize  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    summary = summarize(load_trace(args.trace), args.phases.split(","))
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
