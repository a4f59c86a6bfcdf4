"""Whether a host-bound decoding loop and a GPU-bound update fill each other's gaps on one GPU, by where
the decoding loop runs: the question behind `ppo.overlap_rollout` with `ppo.vllm_own_process`.

The two loads, at the shipped 0.5B recipe's scale (Qwen2.5-0.5B shape, random weights, bf16):
- update: `--train-steps` training steps on a 12288-token micro-batch (bench/ray_rank_overhead.py
  `training_step`; the critic's update takes ~8 of them);
- decoding: `--decode-steps` eager forward passes of 256 one-token rows, each ending with the next
  tokens on the host as a sampler's do: hundreds of small kernels a step, launched from Python, the way
  a rollout's decoding steps leave the GPU idle while the host works.

Each load is timed alone, then both at once: the decoding loop on a thread of this process (on a CUDA
stream of its own, one interpreter for both: the engine in the trainer's process) and in a process of its
own (the engine in vLLM's process: two CUDA contexts, which the GPU time-slices without MPS).

    python bench/overlap_processes.py --json OUT.json [--train-steps 8] [--decode-steps 400]
    python bench/overlap_processes.py --json OUT.json --tiny      # small models on the CPU (the tests')

Prints, for each placement, the wall time of both loads together against the two alone in turn (below
1.0: the overlap saves time) and each load's median step against its own alone, and writes them to
OUT.json. Compare ratios measured in one run: the machines are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from ray_rank_overhead import qwen05b, training_step  # noqa: E402

from rlhf.atomic import write_json  # noqa: E402

DECODE_ROWS = 256  # the recipe's sequences in flight (vLLM's max_num_seqs)
TRAIN_TOKENS = 12288  # the recipe's update micro-batch on an 80 GB GPU


def decoding_step(tiny: bool = False):
    """One decoding-shaped step of `qwen05b`: a forward pass of DECODE_ROWS one-token rows, the greedy
    next tokens copied to the host (the step's end, as a sampler's)."""
    import torch

    model, device = qwen05b(tiny)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (DECODE_ROWS, 1), device=device)

    @torch.inference_mode()
    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not tiny):
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        logits[:, -1].argmax(-1).cpu()
    return step


def timed(step, n: int, warmup: int = 3) -> dict:
    """`n` steps after `warmup`: each step's seconds, and the monotonic clock at the first's start and
    the last's end (comparable across this machine's processes)."""
    for _ in range(warmup):
        step()
    times = []
    start = time.monotonic()
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"start": start, "end": time.monotonic(), "step_s": times}


def _decode_process(n: int, tiny: bool, ready, go, out) -> None:
    import torch
    torch.set_num_threads(1)
    if not tiny:
        torch.cuda.set_device(0)
    step = decoding_step(tiny)
    for _ in range(3):
        step()
    ready.set()
    go.wait()
    out.put(timed(step, n, warmup=0))


def together(train, decode_n: int, train_n: int, where: str, tiny: bool) -> tuple:
    """Both loads at once, the decoding loop on a thread ('thread') or in a process of its own
    ('process'); the update in this thread. Returns (update's timing, decoding's timing)."""
    if where == "thread":
        import torch
        decode = decoding_step(tiny)
        on_stream = contextlib.nullcontext() if tiny else torch.cuda.stream(torch.cuda.Stream())
        for _ in range(3):
            decode()
        result = {}

        def run():
            with on_stream:
                result["decode"] = timed(decode, decode_n, warmup=0)
        worker = threading.Thread(target=run, name="rollout")
        worker.start()
        update = timed(train, train_n, warmup=0)
        worker.join()
        return update, result["decode"]
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_decode_process, args=(decode_n, tiny, ready, go, out))
    child.start()
    ready.wait()
    go.set()
    update = timed(train, train_n, warmup=0)
    decode = out.get()
    child.join()
    return update, decode


def summary(timing: dict) -> dict:
    return {"median_s": statistics.median(timing["step_s"]), "wall_s": timing["end"] - timing["start"],
            "step_s": timing["step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--train-steps", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=400)
    parser.add_argument("--tiny", action="store_true", help="small models on the CPU")
    args = parser.parse_args()
    if os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: give a file path in an existing directory")  # one line, exit 2
    if args.train_steps < 1 or args.decode_steps < 1:
        parser.error("--train-steps and --decode-steps take a positive count")
    import torch

    if not args.tiny and not torch.cuda.is_available():
        parser.error("--tiny is needed without a GPU")
    torch.set_num_threads(1)
    train = training_step(256 if args.tiny else TRAIN_TOKENS, args.tiny)
    decode = decoding_step(args.tiny)
    alone = {"update": summary(timed(train, args.train_steps)), "decode": summary(timed(decode, args.decode_steps))}
    del decode
    if not args.tiny:
        torch.cuda.empty_cache()
    in_turn = alone["update"]["wall_s"] + alone["decode"]["wall_s"]
    out = {"device": "cpu" if args.tiny else torch.cuda.get_device_name(0), "train_tokens": TRAIN_TOKENS,
           "decode_rows": DECODE_ROWS, "train_steps": args.train_steps, "decode_steps": args.decode_steps,
           "alone": alone, "in_turn_s": in_turn}
    print(f"alone: update {alone['update']['median_s'] * 1e3:.1f} ms a step ({alone['update']['wall_s']:.2f} s), "
          f"decoding {alone['decode']['median_s'] * 1e3:.2f} ms a step ({alone['decode']['wall_s']:.2f} s); "
          f"in turn {in_turn:.2f} s")
    for where in ("thread", "process"):
        update, decode = together(train, args.decode_steps, args.train_steps, where, args.tiny)
        wall = max(update["end"], decode["end"]) - min(update["start"], decode["start"])
        u, d = summary(update), summary(decode)
        out[where] = {"update": u, "decode": d, "wall_s": wall, "wall_over_in_turn": wall / in_turn,
                      "update_slowdown": u["median_s"] / alone["update"]["median_s"],
                      "decode_slowdown": d["median_s"] / alone["decode"]["median_s"]}
        r = out[where]
        print(f"together, decoding on a {where:7s}: {wall:.2f} s = x{r['wall_over_in_turn']:.3f} of in turn; "
              f"update x{r['update_slowdown']:.2f}, decoding x{r['decode_slowdown']:.2f} a step")
    write_json(args.json, out)  # whole or not at all: a call's time limit may kill the run


if __name__ == "__main__":
    main()
