"""Preference pairs of the embedded default, from the arithmetic task's rows.

    python -m rlhf.reward_model.pairs --data data/arithmetic --out data/rm_pairs [--seed 0] [--per-prompt 2]

For every `a+b=` / `a-b=` row the chosen response is the right integer; the rejected one is a
wrong integer, drawn as real preference data is: 40% near misses (off by 1 to 3), 30% far misses
(off by 4 to 15), 30% short guesses (one digit). So in these pairs a one-digit answer is nearly always the rejected one,
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
    kind = rng.random()
    if kind < 0.4:  # a near miss
        return correct + int(rng.choice([-3, -2, -1, 1, 2, 3]))
    if kind < 0.7:  # a far miss
        return correct + int(rng.choice([-1, 1])) * int(rng.integers(4, 16))
    while True:  # a short guess
        v = int(rng.integers(0, 10))
        if v != correct:
            return v


def make_pairs(rows: Sequence[dict], seed: int, per_prompt: int = 2, samples: Sequence[Sequence[str]] = (),
               short_fraction: float = 0.3) -> List[dict]:
    """`per_prompt` pairs per row, the right answer chosen. Without `samples` the rejected answer
    is synthetic (`wrong_answer`); with them (the policy's own responses per row, as real preference
    data is collected) it is one of the row's wrong samples, or a one-digit guess with probability
    `short_fraction` (and when the policy never erred on the row)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, row in enumerate(rows):
        correct = int(row["answer"])
        wrong = [x for x in (samples[i] if samples else []) if x.strip() != str(correct)]
        for _ in range(per_prompt):
            if samples and wrong and rng.random() >= short_fraction:
                rejected = wrong[int(rng.integers(0, len(wrong)))]
            elif samples:
                rejected = str(next(v for v in map(int, rng.permutation(10)) if v != correct))
            else:
                rejected = str(wrong_answer(correct, rng))
            out.append({"prompt": row["prompt"], "chosen": str(correct), "rejected": rejected})
    return out


def policy_samples(model_dir: str, tokenizer_dir: str, prompts: Sequence[str], n: int, seed: int,
                   max_new_tokens: int = 6, batch_size: int = 256) -> List[List[str]]:
    """`n` responses per prompt sampled from a policy checkpoint at temperature 1 (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    flat = [p for p in prompts for _ in range(n)]
    texts: List[str] = []
    torch.manual_seed(seed)
    with torch.no_grad():
        for start in range(0, len(flat), batch_size):
            enc = tok(flat[start:start + batch_size], return_tensors="pt", padding=True, add_special_tokens=True)
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,  # pyright: ignore[reportAttributeAccessIssue]
                                 max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
            for ids in out[:, enc["input_ids"].shape[1]:].tolist():
                ids = ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
                texts.append(tok.decode(ids, skip_special_tokens=True))
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--data", required=True, help="a dir with train.jsonl and eval.jsonl of prompt/answer rows")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-prompt", type=int, default=2)
    p.add_argument("--policy", default="", help="a policy checkpoint (e.g. models/sft/model): rejected answers are "
                                                 "its own wrong samples instead of synthetic ones")
    p.add_argument("--tokenizer", default="", help="the policy's tokenizer dir (default: --policy)")
    p.add_argument("--samples", type=int, default=8, help="responses sampled per prompt from --policy")
    p.add_argument("--short-fraction", type=float, default=0.3,
                   help="share of rejected answers that are one-digit guesses (the reward model's exploitable bias)")
    args = p.parse_args(argv)
    from rlhf import numerics
    numerics.apply()  # before torch loads: the same policy samples on every x86-64 CPU
    numerics.set_threads(0)
    from rlhf.data import read_records
    from rlhf.errors import ConfigError
    out = Path(args.out)
    try:
        splits = {name: read_records(Path(args.data) / f"{name}.jsonl") for name in ("train", "eval")}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for i, (name, rows) in enumerate(splits.items()):
        samples = policy_samples(args.policy, args.tokenizer or args.policy, [r["prompt"] for r in rows],
                                 args.samples, seed=args.seed + i) if args.policy else ()
        pairs = make_pairs(rows, seed=args.seed + i, per_prompt=args.per_prompt, samples=samples,
                           short_fraction=args.short_fraction)
        with open(out / f"{name}.jsonl", "w") as f:
            for pair in pairs:
                f.write(json.dumps(pair) + "\n")
        print(f"wrote {len(pairs)} {name} pairs to {out / f'{name}.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
