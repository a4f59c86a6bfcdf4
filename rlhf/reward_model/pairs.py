"""Preference pairs of the embedded default, from the arithmetic task's rows.

    python -m rlhf.reward_model.pairs --data data/arithmetic --out data/rm_pairs [--seed 0] [--per-prompt 2]

For every `a+b=` / `a-b=` row the chosen response is the right integer; the rejected one is a
wrong integer, drawn as real preference data is: half are near misses (off by 1 to 3), half are
short guesses (one digit). So in these pairs a one-digit answer is nearly always the rejected one,
a surface feature correlated with correctness that a reward model learns beside the arithmetic;
a policy pushed far from its SFT start can exploit it (long answers where a short one is right),
as policies exploit the length and style biases of real reward models.
Train pairs come from the task's train split and held-out pairs from its held-out split, so the
reward model never sees the prompts PPO is evaluated on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Sequence

import numpy as np


def wrong_answer(correct: int, rng: np.random.Generator) -> int:
    if rng.random() < 0.5:  # a near miss
        while True:
            v = correct + int(rng.choice([-3, -2, -1, 1, 2, 3]))
            if v != correct:
                return v
    while True:  # a short guess
        v = int(rng.integers(0, 10))
        if v != correct:
            return v


def make_pairs(rows: Sequence[dict], seed: int, per_prompt: int = 2) -> List[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        correct = int(row["answer"])
        for _ in range(per_prompt):
            out.append({"prompt": row["prompt"], "chosen": str(correct), "rejected": str(wrong_answer(correct, rng))})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a dir with train.jsonl and eval.jsonl of prompt/answer rows")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-prompt", type=int, default=2)
    args = p.parse_args(argv)
    from rlhf.config import ConfigError
    from rlhf.data import read_records
    out = Path(args.out)
    try:
        splits = {name: read_records(Path(args.data) / f"{name}.jsonl") for name in ("train", "eval")}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, rows) in enumerate(splits.items()):
        pairs = make_pairs(rows, seed=args.seed + i, per_prompt=args.per_prompt)
        with open(out / f"{name}.jsonl", "w") as f:
            for pair in pairs:
                f.write(json.dumps(pair) + "\n")
        print(f"wrote {len(pairs)} {name} pairs to {out / f'{name}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
