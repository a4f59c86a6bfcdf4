"""What running in a Ray actor costs a GPU loop whose host launches the kernels: the same training
step of a Qwen2.5-0.5B-shaped model (random weights, bf16 autocast, AdamW, one 12288-token
micro-batch: the shipped 0.5B recipe's update budget on an 80 GB GPU) timed in this process and in
a Ray actor made as the engine makes its rank hosts (rlhf/placement/cluster.py `start_hosts`: one
GPU, `ppo.cpus_per_rank` CPUs, two calls at once, so each call runs on a thread of the actor's
pool), with torch's one host thread in both. Ray starts its workers at niceness 15
(`RAY_worker_niceness`); with `--niceness 0` the actors run at the controller's.

    python bench/ray_rank_overhead.py --json OUT.json [--niceness 0] [--steps 20]
    python bench/ray_rank_overhead.py --json OUT.json --tiny      # a small model on the CPU (the tests')

Prints each placement's median step time and its ratio to this process's (compare ratios measured
in one run: the machines are noisy), and writes them with the settings to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

QWEN05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "vocab_size": 151936}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}
SEQUENCE = 1536  # the recipe's 256 + 512 tokens, two sequences a row


def qwen05b(tiny: bool = False):
    """The Qwen2.5-0.5B-shaped model with random weights on this process's GPU (`tiny`: a small one on
    the CPU), and its device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    device = torch.device("cpu") if tiny else torch.device("cuda", torch.cuda.current_device())
    config = Qwen2Config(**(TINY if tiny else QWEN05B), max_position_embeddings=32768, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).to(device), device


def training_step(tokens: int, tiny: bool = False):
    """One training step (forward, backward, AdamW) of `qwen05b` on `tokens` tokens in rows of
    SEQUENCE, as a callable that returns when the device has finished it."""
    import torch

    model, device = qwen05b(tiny)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (max(1, tokens // SEQUENCE), min(tokens, SEQUENCE)),
                        device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not tiny):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return step


def step_times(steps: int, tokens: int, tiny: bool = False) -> dict:
    """Median seconds of a training step (forward, backward, AdamW) in the calling thread, and the
    process's niceness and thread. On the GPU (`tiny`: a small model on the CPU)."""
    import threading

    import torch

    step = training_step(tokens, tiny)
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        step()
        if i >= 3:  # the first steps allocate and pick kernels
            times.append(time.perf_counter() - start)
    return {"step_s_median": statistics.median(times), "step_s": times, "niceness": os.nice(0),
            "thread": threading.current_thread().name, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=12288)
    parser.add_argument("--niceness", type=int, default=None, help="the Ray workers' (default: Ray's own, 15)")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU, 256 tokens")
    args = parser.parse_args()
    if os.path.isdir(args.json) or not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: give a file path in an existing directory")  # one line, exit 2
    if args.steps < 1 or args.tokens < 1 or (args.niceness is not None and not 0 <= args.niceness <= 19):
        parser.error("--steps and --tokens take a positive count, --niceness 0-19")
    tokens = 256 if args.tiny else args.tokens
    if args.niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.niceness)  # read by the raylet ray.init starts
    import ray
    import torch

    torch.set_num_threads(1)  # as a rank's (ppo.cpus_per_rank): only the placement differs
    out = {"tokens": tokens, "steps": args.steps, "device": "cpu" if args.tiny else torch.cuda.get_device_name(0),
           "this_process": step_times(args.steps, tokens, args.tiny)}
    gpus = 0 if args.tiny else 1
    if gpus:
        torch.cuda.empty_cache()
    ray.init(num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    remote = ray.remote(num_gpus=gpus, num_cpus=1)(Rank)
    for name, concurrency in (("ray_actor", 1), ("ray_actor_threaded", 2)):
        actor = remote.options(max_concurrency=concurrency).remote()
        out[name] = ray.get(actor.run.remote(args.steps, tokens, args.tiny))
        ray.kill(actor)
        time.sleep(2)
    ray.shutdown()
    base = out["this_process"]["step_s_median"]
    for name in ("this_process", "ray_actor", "ray_actor_threaded"):
        r = out[name]
        r["ratio"] = r["step_s_median"] / base
        print(f"{name:20s} {r['step_s_median'] * 1e3:8.1f} ms  x{r['ratio']:.3f}  nice {r['niceness']:3d}  "
              f"thread {r['thread']}, torch threads {r['torch_threads']}")
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


class Rank:
    def run(self, steps: int, tokens: int, tiny: bool) -> dict:
        import torch
        torch.set_num_threads(1)  # a rank's: ppo.cpus_per_rank
        return step_times(steps, tokens, tiny)


if __name__ == "__main__":
    main()
