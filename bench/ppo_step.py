"""Benchmark: time per phase and tokens/s of PPO iterations (not a test).

    python bench/ppo_step.py [--recipe recipes/tiny.gin] [-b BINDING]... [--steps 5] [--json PATH]
                             [--reward-model random|DIR]

Builds the trainer from a recipe, runs one warm-up iteration, then `--steps` timed iterations,
and reports the median of each phase. Figures go to stdout and to a JSON file.
`--reward-model` trains against a reward model (reward.kind = 'model'): a checkpoint dir, or
'random', a one-output classifier with the policy's own architecture, shape and tokenizer and
random weights (built locally); its phase is `reward_model`, with its tokens/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rollout_parity(trainer, repeats: int = 3) -> dict:
    """The PPO generate phase (prompt encoding, vLLM, batch assembly, decoding) against vLLM's own
    `LLM.generate` on the same token ids and sampling parameters, engine awake, best of `repeats`."""
    import torch

    ppo = trainer.ppo
    rollout = trainer.actor.rollout  # one process: the actor role itself
    prompts = trainer.sampler.next(ppo.rollout_micro_batch_size * ppo.num_rollout_batches)
    rollout.set_sleep(False)

    def phase():
        torch.cuda.synchronize()
        t = time.perf_counter()
        batch = trainer.generate(prompts, trainer.sampling, (ppo.seed, 10**6), ppo.samples_per_prompt,
                                 ppo.num_rollout_batches)
        torch.cuda.synchronize()
        return time.perf_counter() - t, batch

    phase_times, batch = [], None
    for _ in range(repeats):
        seconds, batch = phase()
        phase_times.append(seconds)
    requests = [{"prompt_token_ids": [t for t, m in zip(ids, mask) if m]}
                for ids, mask in zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist())]
    params = rollout._sampling_params(trainer.sampling, None)
    alone = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        outputs = rollout.llm.generate(requests, params, use_tqdm=False)
        torch.cuda.synchronize()
        alone.append(time.perf_counter() - t)
    tokens = int(batch["response_mask"].sum())
    alone_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"requests": len(requests), "ppo_generate_s": min(phase_times), "vllm_generate_s": min(alone),
            "ppo_generated_tokens": tokens, "vllm_generated_tokens": alone_tokens,
            "ppo_tokens_per_s": tokens / min(phase_times), "vllm_tokens_per_s": alone_tokens / min(alone),
            "ratio_ppo_over_vllm_time": min(phase_times) / min(alone) * alone_tokens / max(tokens, 1)}


def random_reward_model(cfg, out_dir: Path) -> Path:
    """A one-output sequence classifier shaped like the run's policy (random weights), with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.trainer import resolve_model_paths
    model_dir, tokenizer_dir = resolve_model_paths(cfg, log=lambda m: print(m, file=sys.stderr))
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    config.num_labels = 1
    config.architectures = None
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cfg.ppo.dtype == "bfloat16" else torch.float32
    model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(out_dir))
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.gin"))
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "ppo_step_cpu.json"))
    p.add_argument("--reward-model", default="", help="'random' (the policy's shape, random weights) or a reward-model "
                                                       "checkpoint dir: train against it (reward.kind = 'model')")
    p.add_argument("--rollout-parity", action="store_true",
                   help="vLLM, one process: also time vLLM's own generate on the generate phase's requests")
    args = p.parse_args(argv)

    import torch

    from rlhf import configurable
    from rlhf.trainer import PPOTrainer

    bindings = args.binding + [f"ppo.total_steps = {args.steps + 1}"]
    cfg, _ = configurable.resolve(args.recipe, bindings)
    with tempfile.TemporaryDirectory() as out:
        if args.reward_model:
            path = args.reward_model if args.reward_model != "random" else str(random_reward_model(cfg, Path(out) / "rm"))
            cfg, _ = configurable.resolve(args.recipe, bindings + ["reward.kind = 'model'", f"reward.model_path = '{path}'"])
        t0 = time.perf_counter()
        trainer = PPOTrainer(cfg, Path(out) / "run", log=lambda m: print(m, file=sys.stderr))
        setup_s = time.perf_counter() - t0
        records = []
        for i in range(args.steps + 1):
            trainer.step += 1
            record = trainer.train_step()
            if i > 0:  # the first iteration is a warm-up
                records.append(record)
        parity = rollout_parity(trainer) if args.rollout_parity else None
        t0 = time.perf_counter()
        trainer.evaluate()
        eval_s = time.perf_counter() - t0
        placement = trainer.placement
        trainer.close()

    phases = sorted({k for r in records for k in r if k.startswith("timing_s/")})
    result = {
        "recipe": str(Path(args.recipe).relative_to(REPO)) if Path(args.recipe).resolve().is_relative_to(REPO) else args.recipe,
        "bindings": args.binding,
        "command": "python bench/ppo_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "timed_steps": args.steps,
        "rollout_batch_size": cfg.ppo.rollout_batch_size,
        "max_response_length": cfg.ppo.max_response_length,
        "device": str(trainer.device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "setup_s": setup_s,
        "eval_s": eval_s,
        "median_s": {k.split("/", 1)[1]: statistics.median(r[k] for r in records if k in r) for k in phases},
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in records),
        "generated_tokens_per_s": statistics.median(r["perf/generated_tokens_per_s"] for r in records),
        "response_length_mean": statistics.mean(r["response_length_mean"] for r in records),
    }
    result["placement"] = placement
    if "reward_model" in result["median_s"]:
        # The reward model reads every prompt and response token of the step's batch.
        tokens = [r["perf/tokens_per_s"] * r["timing_s/step"] for r in records]
        result["reward_model"] = {"kind": "random" if args.reward_model == "random" else args.reward_model,
                                  "micro_batch_size": cfg.reward.micro_batch_size,
                                  "phase_s": result["median_s"]["reward_model"],
                                  "tokens_per_s": statistics.median(t / r["timing_s/reward_model"]
                                                                    for t, r in zip(tokens, records)),
                                  "share_of_step": result["median_s"]["reward_model"] / result["median_s"]["step"]}
    if parity is not None:
        result["rollout_parity"] = parity
    for key in ("perf/max_memory_allocated_gb", "perf/max_rss_gb", "perf/gpu_utilization"):
        if key in records[-1]:
            result[key.split("/", 1)[1]] = records[-1][key]
    step = result["median_s"]["step"]
    print(f"PPO iteration on {result['device']} ({cfg.ppo.rollout_batch_size} sequences, "
          f"<= {cfg.ppo.max_response_length} new tokens): {step * 1000:.1f} ms median over {args.steps} steps")
    for name, seconds in sorted(result["median_s"].items(), key=lambda kv: -kv[1]):
        if name != "step":
            print(f"  {name:<14} {seconds * 1000:8.1f} ms  {100 * seconds / step:5.1f}%")
    print(f"  tokens/s (prompt + response, whole iteration): {result['tokens_per_s']:.0f}")
    print(f"  generated tokens/s (generate phase):           {result['generated_tokens_per_s']:.0f}")
    if "reward_model" in result:
        print(f"  reward-model tokens/s (reward_model phase):    {result['reward_model']['tokens_per_s']:.0f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
