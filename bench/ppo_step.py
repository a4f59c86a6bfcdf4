"""Benchmark: time per phase and tokens/s of PPO iterations (not a test).

    python bench/ppo_step.py [--recipe recipes/tiny.gin] [-b BINDING]... [--steps 5] [--json PATH]
                             [--reward-model random|DIR] [--time-budget S] [--phase-memory] [--no-eval]

Builds the trainer from a recipe, runs one warm-up iteration, then `--steps` timed iterations,
and reports the median of each phase. Figures go to stdout and to a JSON file, rewritten after
every iteration (`"partial": true` until the run ends; before the first timed iteration ends,
the warm-up's figures, flagged `"warmup_only": true`), so a run cut short keeps what it measured.
`--time-budget S`: start no further timed iteration once the last one says it would end more
than S seconds after start-up began (at least one timed iteration runs).
`--phase-memory` (GPU, one process): each phase's peak allocated and reserved memory of this
process's torch allocator, and the device's peak memory in use (every allocator and process,
sampled every 0.1 s), per iteration and as the maximum over the timed ones.
`--profile DIR` (one process): one more iteration after the timed ones, under torch.profiler
(host and GPU), each phase a named range; writes DIR/step_N.trace.json.gz and the per-phase summary of
`rlhf.profiling` (GPU busy and idle time, idle gaps, host waits, kernel time by kind)
into DIR/step_N.json and the result's `profile`. Its timings are not among the timed ones.
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
sys.path.insert(0, str(REPO / "bench"))


def rollout_parity(trainer, repeats: int = 3) -> dict:
    """The PPO generate phase (prompt encoding, vLLM, batch assembly, decoding) against vLLM's own
    `LLM.generate` on the same token ids and sampling parameters, engine awake, best of `repeats`."""
    import torch

    ppo = trainer.ppo
    rollout = trainer.actor.local_roles[0].rollout  # one process: the actor role itself, behind its proxy
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


STEP_RESULTS = ("step", "reward_mean", "kl_divergence", "response_length_mean", "actor/pg_loss", "actor/grad_norm",
                "actor/entropy_old", "critic/value_loss", "critic/grad_norm", "critic/values_mean")


class PhaseMemory:
    """Per-phase peak memory, by wrapping the trainer's phase timer (one process on a GPU).

    At each phase's start: synchronize, reset the allocator's peak statistics; at its end:
    synchronize and read them. A sampler thread keeps the device-wide peak in use
    (`torch.cuda.mem_get_info`, which also sees vLLM's own memory pool) for the phase open.
    The allocator's peak since start-up (the monitor's perf/max_memory_allocated_gb) no longer
    means that, so the iteration's figure becomes the maximum over its phases."""

    def __init__(self, period: float = 0.1):
        import contextlib
        import threading

        import torch

        import rlhf.trainer as trainer_module
        self.torch, self.period = torch, period
        self.current: dict = {}
        self.device_peak = 0.0
        self._stop = threading.Event()
        orig = trainer_module.PhaseTimer.__call__
        memory = self

        @contextlib.contextmanager
        def timed(timer, name):
            with orig(timer, name):
                memory.begin()
                try:
                    yield
                finally:
                    memory.end(name)

        trainer_module.PhaseTimer.__call__ = timed
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _used_gb(self) -> float:
        free, total = self.torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def _sample(self):
        while not self._stop.wait(self.period):
            try:
                self.device_peak = max(self.device_peak, self._used_gb())
            except Exception:
                pass

    def begin(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.device_peak = self._used_gb()

    def end(self, name: str):
        torch = self.torch
        torch.cuda.synchronize()
        gb = 2**30
        now = {"allocated_peak_gb": torch.cuda.max_memory_allocated() / gb,
               "reserved_peak_gb": torch.cuda.max_memory_reserved() / gb,
               "device_used_peak_gb": max(self.device_peak, self._used_gb()),
               "allocated_end_gb": torch.cuda.memory_allocated() / gb}
        old = self.current.get(name)
        self.current[name] = now if old is None else {k: max(v, old[k]) if k.endswith("peak_gb") else v
                                                      for k, v in now.items()}

    def take(self) -> dict:
        out, self.current = self.current, {}
        return out

    def close(self):
        self._stop.set()


def profiled_step(trainer, out_dir: Path) -> dict:
    """One more iteration under torch.profiler with every phase as a named range (and the whole as
    'iteration'; `PPOTrainer.profiled_train_step`): its trace and summary go to out_dir/step_N.*."""
    trainer.step += 1
    record, summary = trainer.profiled_train_step(out_dir)
    summary["step_timings_s"] = {k.split("/", 1)[1]: v for k, v in record.items() if k.startswith("timing_s/")}
    summary["placement"] = trainer.placement.get("placement")
    return summary


def summarize(records: list, args, argv, cfg, device, torch, setup_s: float, eval_s, placement, parity,
              phase_memory: list, partial: bool) -> dict:
    phases = sorted({k for r in records for k in r if k.startswith("timing_s/")})
    result = {
        "recipe": (str(Path(args.recipe).relative_to(REPO))
                   if args.recipe and Path(args.recipe).resolve().is_relative_to(REPO) else args.recipe),
        "bindings": args.binding,
        "command": "python bench/ppo_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "timed_steps": len(records),
        "rollout_batch_size": cfg.ppo.rollout_batch_size,
        "max_response_length": cfg.ppo.max_response_length,
        "device": str(device),
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
    if len(records) != args.steps:
        result["steps_asked"] = args.steps
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
    if phase_memory:
        names = sorted({n for step in phase_memory for n in step})
        result["phase_memory_gb"] = {n: {k: max(step[n][k] for step in phase_memory if n in step)
                                         for k in ("allocated_peak_gb", "reserved_peak_gb", "device_used_peak_gb")}
                                     for n in names}
        result["phase_memory_per_step_gb"] = phase_memory
        result["max_memory_allocated_gb"] = max(v["allocated_peak_gb"] for v in result["phase_memory_gb"].values())
        result["max_memory_reserved_gb"] = max(v["reserved_peak_gb"] for v in result["phase_memory_gb"].values())
        result["device_memory_used_peak_gb"] = max(v["device_used_peak_gb"]
                                                   for v in result["phase_memory_gb"].values())
    result["step_s"] = [r["timing_s/step"] for r in records]
    # Each iteration's results beside its time: two variants that should compute the same numbers
    # (ppo.overlap_rollout on and off, one seed) can be compared step by step.
    result["step_results"] = [{k: r[k] for k in STEP_RESULTS if k in r} for r in records]
    if partial:
        result["partial"] = True
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(REPO / "recipes" / "tiny.gin"),
                   help="a gin recipe; '' for the engine's defaults (rlhf/config.py) and the bindings alone")
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "ppo_step_cpu.json"))
    p.add_argument("--reward-model", default="", help="'random' (the policy's shape, random weights) or a reward-model "
                                                       "checkpoint dir: train against it (reward.kind = 'model')")
    p.add_argument("--rollout-parity", action="store_true",
                   help="vLLM, one process: also time vLLM's own generate on the generate phase's requests")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds from start-up: start no timed iteration predicted to end past it (0: no limit)")
    p.add_argument("--phase-memory", action="store_true", help="GPU, one process: peak memory of every phase")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation after the timed iterations")
    p.add_argument("--profile", default="", help="DIR: one more iteration under torch.profiler; trace and "
                                                 "per-phase summary into DIR")
    args = p.parse_args(argv)
    started = time.perf_counter()

    import torch

    from rlhf import configurable
    from rlhf.trainer import PPOTrainer

    # With --profile the profiled iteration is not the run's last, so that a rollout runs ahead
    # into it and out of it as in every middle iteration (ppo.overlap_rollout); it is drained after.
    bindings = args.binding + [f"ppo.total_steps = {args.steps + (3 if args.profile else 1)}"]
    cfg, _ = configurable.resolve(args.recipe or None, bindings)
    with tempfile.TemporaryDirectory() as out:
        if args.reward_model:
            path = (args.reward_model if args.reward_model != "random"
                    else str(random_reward_model(cfg, Path(out) / "rm")))
            cfg, _ = configurable.resolve(args.recipe or None,
                                          bindings + ["reward.kind = 'model'", f"reward.model_path = '{path}'"])
        t0 = time.perf_counter()
        trainer = PPOTrainer(cfg, Path(out) / "run", log=lambda m: print(m, file=sys.stderr))
        setup_s = time.perf_counter() - t0
        memory = None
        if args.phase_memory and trainer.device.type == "cuda" and trainer.placement.get("placement") == "local":
            memory = PhaseMemory()
        records, phase_memory, warmup = [], [], []

        profiled = None

        def write(partial: bool, eval_s=None, parity=None):
            # Until a timed iteration ends, the warm-up's figures stand in (flagged): a run cut short still says
            # something.
            use = records or [w[0] for w in warmup]
            result = summarize(use, args, argv, cfg, trainer.device, torch, setup_s, eval_s, trainer.placement,
                               parity, phase_memory if records else [w[1] for w in warmup if w[1]], partial)
            if not records:
                result["timed_steps"] = 0
                result["warmup_only"] = True
            if warmup:
                result["warmup_step_s"] = warmup[0][0]["timing_s/step"]
            if profiled is not None:
                result["profile"] = profiled
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))
            return result

        for i in range(args.steps + 1):
            if records and args.time_budget:
                predicted = time.perf_counter() - started + records[-1]["timing_s/step"]
                if predicted > args.time_budget:
                    print(f"stopping after {len(records)} timed iterations: the next would end at ~{predicted:.0f} s "
                          f"(budget {args.time_budget:.0f} s)", file=sys.stderr)
                    break
            trainer.step += 1
            record = {"step": trainer.step, **trainer.train_step()}
            if memory is not None:
                phases = memory.take()
                if phases:
                    record["perf/max_memory_allocated_gb"] = max(v["allocated_peak_gb"] for v in phases.values())
            print(f"iteration {i} ({'warm-up' if i == 0 else 'timed'}): {record['timing_s/step']:.2f} s "
                  f"at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
            if i > 0:  # the first iteration is a warm-up
                records.append(record)
                if memory is not None:
                    phase_memory.append(phases)
            else:
                warmup.append((record, phases if memory is not None else None))
            write(partial=True)
        if args.profile and records:
            predicted = time.perf_counter() - started + 2 * records[-1]["timing_s/step"]  # the profiler's overhead too
            if args.time_budget and predicted > args.time_budget:
                print(f"no profiled iteration: it would end at ~{predicted:.0f} s (budget {args.time_budget:.0f} s)",
                      file=sys.stderr)
            else:
                profiled = profiled_step(trainer, Path(args.profile))
        trainer.drain()
        parity = rollout_parity(trainer) if args.rollout_parity and cfg.ppo.rollout_backend == "vllm" else None
        eval_s = None
        if not args.no_eval:
            t0 = time.perf_counter()
            trainer.evaluate()
            eval_s = time.perf_counter() - t0
        if memory is not None:
            memory.close()
        trainer.close()

    result = write(partial=False, eval_s=eval_s, parity=parity)
    step = result["median_s"]["step"]
    print(f"PPO iteration on {result['device']} ({cfg.ppo.rollout_batch_size} sequences, "
          f"<= {cfg.ppo.max_response_length} new tokens): {step * 1000:.1f} ms median over "
          f"{result['timed_steps']} steps")
    for name, seconds in sorted(result["median_s"].items(), key=lambda kv: -kv[1]):
        if name != "step":
            print(f"  {name:<14} {seconds * 1000:8.1f} ms  {100 * seconds / step:5.1f}%")
    for name, mem in sorted(result.get("phase_memory_gb", {}).items()):
        print(f"  {name:<14} peak allocated {mem['allocated_peak_gb']:6.1f} GB, reserved "
              f"{mem['reserved_peak_gb']:6.1f} GB, device in use {mem['device_used_peak_gb']:6.1f} GB")
    print(f"  tokens/s (prompt + response, whole iteration): {result['tokens_per_s']:.0f}")
    print(f"  generated tokens/s (generate phase):           {result['generated_tokens_per_s']:.0f}")
    if "reward_model" in result:
        print(f"  reward-model tokens/s (reward_model phase):    {result['reward_model']['tokens_per_s']:.0f}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
