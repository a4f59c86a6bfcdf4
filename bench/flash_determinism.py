"""What `ppo.deterministic` costs and what it fixes: torch's packed (variable-length) flash attention
backward at the Qwen2.5 shapes of the shipped recipes, strict deterministic algorithms against the
engine's warn-only mode (atomic adds of query gradients), on one GPU. Prints a table and writes JSON.

    python bench/flash_determinism.py --json OUT.json [--tokens 8192] [--repeats 20]

For each shape and mode: the backward's median time over `repeats` runs of one packed micro-batch of
`tokens` tokens (sequences of 256 + 512 tokens, the benchmarks' rows) and how many of the repeats'
query/key/value gradients differ from the first run's, with the largest difference. The update
phases run one such backward per layer and micro-batch, so layers x micro-batches x (time difference)
is the mode's cost an update (printed for the 7B recipe: 28 layers, 196,608 tokens at 8192 a micro-batch)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.attention import varlen_attention  # noqa: E402
from rlhf.determinism import deterministic_backward  # noqa: E402

SHAPES = {"qwen2.5-7b": (28, 4, 128, 28), "qwen2.5-0.5b": (14, 2, 64, 24)}
"""name: (query heads, key/value heads, head dim, layers)."""


def run(shape: str, strict: bool, tokens: int, repeats: int, seq: int = 768) -> dict:
    heads, kv_heads, dim, layers = SHAPES[shape]
    device = torch.device("cuda")
    lengths = [seq] * (tokens // seq) + ([tokens % seq] if tokens % seq else [])
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, tokens, dim, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, kv_heads, tokens, dim, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    grad_out = torch.randn(1, tokens, heads, dim, device=device, dtype=torch.bfloat16, generator=gen)
    times, grads = [], []
    for i in range(repeats + 2):  # two warm-up runs
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, cu, max(lengths), None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with deterministic_backward(strict):
            start.record()
            out.backward(grad_out)
            end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
            grads.append(torch.cat([t.grad.float().flatten() for t in leaves]))
    diffs = [float((g - grads[0]).abs().max()) for g in grads[1:]]
    return {"shape": shape, "mode": "strict" if strict else "warn_only", "tokens": tokens, "repeats": repeats,
            "backward_ms_median": statistics.median(times), "layers": layers,
            "repeats_differing": sum(d > 0 for d in diffs), "max_abs_difference": max(diffs, default=0.0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    torch.use_deterministic_algorithms(True, warn_only=True)  # what every engine process sets
    torch.utils.deterministic.fill_uninitialized_memory = False  # pyright: ignore[reportAttributeAccessIssue]
    rows = [run(shape, strict, args.tokens, args.repeats) for shape in SHAPES for strict in (False, True)]
    print(f"{'shape':<14}{'mode':<11}{'backward ms':>12}{'repeats differing':>19}{'max |diff|':>12}")
    for r in rows:
        print(f"{r['shape']:<14}{r['mode']:<11}{r['backward_ms_median']:>12.3f}"
              f"{r['repeats_differing']:>12} of {r['repeats'] - 1:<4}{r['max_abs_difference']:>12.3g}")
    by = {(r["shape"], r["mode"]): r["backward_ms_median"] for r in rows}
    micro = 196_608 / args.tokens
    cost_7b = (by[("qwen2.5-7b", "strict")] - by[("qwen2.5-7b", "warn_only")]) * SHAPES["qwen2.5-7b"][3] * micro / 1e3
    print(f"7B recipe: strict mode adds {cost_7b:.2f} s to each update phase (28 layers x {micro:.0f} micro-batches)")
    Path(args.json).write_text(json.dumps({"rows": rows, "update_phase_cost_s_7b": cost_7b,
                                           "device": torch.cuda.get_device_name(),
                                           "torch": torch.__version__}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
