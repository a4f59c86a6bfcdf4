"""Peer benchmark: TRL's GRPOTrainer with vLLM in colocate mode on one GPU (not a test).

    python bench/peers/trl_grpo.py --assets DIR --json OUT.json [--gradient-checkpointing] \
        [--warmup 1] [--steps 3] [--shape 0.5b|7b] [--lora-rank 64 [--lora-alpha 128]] \
        [--vllm-gpu-memory-utilization 0.3]

The work (the same as `bench/peers/engine.py --algo grpo`): 32 prompts x 8 completions per
generation batch, prompts of exactly 256 tokens, at most 256 new tokens (temperature 1, no EOS
stop in practice: random weights), a reference model (beta 0.04), one optimizer step per
generation batch (micro-batch 32 completions x 8 accumulation steps = 256), bf16, AdamW at 1e-6.
The model is the Qwen2.5-0.5B shape with random weights (`bench/peers/common.py`), or with
`--shape 7b` the Qwen2.5-7B shape (drawn on the GPU; 15 GB of bf16 weights).

`--lora-rank R`: a `peft.LoraConfig(r=R, lora_alpha=2R unless --lora-alpha, lora_dropout=0,
target_modules='all-linear', task_type='CAUSAL_LM')` passed as GRPOTrainer's `peft_config`,
gradient checkpointing forced on. TRL then wraps the bf16 model with peft (adapters in fp32:
peft's default autocast_adapter_dtype), computes the reference log-probs with the adapter
disabled (no second model), and syncs vLLM by merging the adapter, loading the weights and
unmerging (trl/generation/vllm_generation.py). vLLM's share of the GPU: 0.3 (42 GB of 141) holds
the 7B weights (15 GB) and a KV cache for the 256 sequences of 512 tokens (7.5 GB); the trainer
beside it needs the bf16 base (15 GB), the adapters with their AdamW state (~2.6 GB for rank 64)
and the activations of 32 checkpointed sequences of 512 tokens plus their completion logits
(~10-20 GB), so both fit with room to spare; it is the engine's share in
`bench/peers/engine.py` too.

Timing: a TrainerCallback records each optimizer step's wall time (one step = one generation
batch: generate, score, reference log-probs, 8 micro-batches forward + backward, AdamW step);
TRL's own profiling blocks (vLLM.generate, sync_weights, _prepare_inputs, compute_loss,
_get_per_token_logps_and_entropies, _calculate_rewards) are captured by patching
`trl.extras.profiling.ProfilingContext` and summed per step as phases. Memory:
torch.cuda.max_memory_allocated (this process: trainer + in-process vLLM) and the device's
peak in use (NVML / nvidia-smi). The JSON is rewritten after every step, so a run cut by a
time limit still leaves the steps it finished.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WORK = dict(prompts_per_step=32, num_generations=8, prompt_tokens=common.PROMPT_TOKENS,
            max_new_tokens=common.RESPONSE_TOKENS, beta=0.04, micro_batch=32, learning_rate=1e-6)


def lora_config(args):
    """The peft config of `--lora-rank` (None without it)."""
    if not args.lora_rank:
        return None
    from peft import LoraConfig
    return LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank, lora_dropout=0.0,
                      target_modules="all-linear", task_type="CAUSAL_LM")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpo_config_kwargs(args, out_dir: str) -> dict:
    """GRPOConfig arguments (TRL 1.16 names) for the benchmark's work."""
    per_step = WORK["prompts_per_step"] * WORK["num_generations"]  # completions per optimizer step
    tiny = args.tiny
    kw = dict(
        output_dir=out_dir,
        # one optimizer step per generation batch: 32 completions per micro-batch x 8 accumulation steps
        per_device_train_batch_size=WORK["micro_batch"] if not tiny else 8,
        gradient_accumulation_steps=(per_step // WORK["micro_batch"]) if not tiny else 2,
        num_generations=WORK["num_generations"] if not tiny else 4,
        max_completion_length=WORK["max_new_tokens"] if not tiny else 8,
        num_iterations=1,
        beta=WORK["beta"],
        learning_rate=WORK["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        temperature=1.0,
        max_steps=args.warmup + args.steps,
        gradient_checkpointing=args.gradient_checkpointing or bool(args.lora_rank),
        bf16=not tiny,
        use_vllm=not tiny,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_max_model_length=(WORK["prompt_tokens"] + WORK["max_new_tokens"]) if not tiny else None,
        vllm_enable_sleep_mode=False,
        model_init_kwargs={"dtype": "bfloat16" if not tiny else "float32"},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        shuffle_dataset=True,
        dataloader_num_workers=0,
        # RANK/LOCAL_RANK/WORLD_SIZE (which vLLM's external launcher needs) make accelerate wrap the model in
        # a one-process DDP; every parameter gets a gradient, so skip the unused-parameter search it adds.
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        use_cpu=tiny,
    )
    return kw


def reward_len(completions, **kwargs):
    """A free rule reward (the peers' reward costs nothing): distinct characters in the completion."""
    return [float(len(set(c))) / 64.0 for c in completions]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assets", required=True, help="directory for the shared inputs (built if missing)")
    p.add_argument("--json", required=True)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--shape", choices=("0.5b", "7b"), default="0.5b", help="model shape of the shared inputs")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (peft, every linear layer); implies "
                                                            "--gradient-checkpointing")
    p.add_argument("--lora-alpha", type=float, default=0.0, help="LoRA alpha (default: twice the rank)")
    p.add_argument("--tiny", action="store_true", help="tiny shape on the CPU, HF generate (smoke test)")
    p.add_argument("--config-only", action="store_true", help="build GRPOConfig, print it, exit")
    args = p.parse_args(argv)

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                     TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled").items():
        os.environ.setdefault(k, v)

    import torch
    import trl
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    out_dir = str(Path(args.json).with_suffix("")) + "-trainer"
    cfg_kw = grpo_config_kwargs(args, out_dir)
    if args.tiny:
        for k in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_max_model_length",
                  "vllm_enable_sleep_mode"):
            cfg_kw.pop(k)
    if args.config_only and not torch.cuda.is_available():
        cfg_kw["use_cpu"] = True  # only so that bf16 validates on a machine without a GPU
    config = GRPOConfig(**cfg_kw)
    print(f"GRPOConfig: generation_batch_size={config.generation_batch_size} "
          f"steps_per_generation={config.steps_per_generation} per_device_train_batch_size="
          f"{config.per_device_train_batch_size} gradient_accumulation_steps={config.gradient_accumulation_steps} "
          f"beta={config.beta} gradient_checkpointing={config.gradient_checkpointing} use_vllm={config.use_vllm}",
          flush=True)
    if args.config_only:
        return 0

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    t0 = time.perf_counter()
    inputs = common.build_inputs(args.assets, tiny=args.tiny, shape=args.shape)
    common.check_assets(inputs)
    tokenizer = AutoTokenizer.from_pretrained(inputs["model_dir"], local_files_only=True)
    prompts = [text for text in common.prompt_texts(common.N_PROMPTS, inputs["prompt_tokens"],
                                                    vocab_size=inputs["vocab_size"])]
    dataset = Dataset.from_dict({"prompt": prompts})

    # Phases: TRL's profiling blocks, summed per optimizer step; nested names keep their parent.
    phase_now: dict = defaultdict(float)
    stack: list = []
    orig_enter, orig_exit = profiling.ProfilingContext.__enter__, profiling.ProfilingContext.__exit__

    def enter(self):
        stack.append(self.name.split(".", 1)[-1])
        return orig_enter(self)

    def exit_(self, *exc):
        start = self._start_time
        result = orig_exit(self, *exc)
        name = stack.pop() if stack else self.name
        key = ">".join(stack + [name])
        if start is not None:
            phase_now[key] += time.perf_counter() - start
        return result

    profiling.ProfilingContext.__enter__, profiling.ProfilingContext.__exit__ = enter, exit_

    gpu = common.GPUMemorySampler().start()
    peft_config = lora_config(args)
    variant = "gc" if config.gradient_checkpointing else "no_gc"
    result = {
        "system": "trl", "algorithm": "grpo",
        "variant": f"lora{args.lora_rank}_{variant}" if args.lora_rank else variant,
        "command": common.command_line(argv),
        "work": dict(WORK, steps_per_generation=config.steps_per_generation,
                     generation_batch_size=config.generation_batch_size, tiny=args.tiny, shape=inputs["shape"],
                     lora_rank=args.lora_rank, lora_alpha=peft_config.lora_alpha if peft_config else None,
                     gradient_checkpointing=config.gradient_checkpointing),
        "config": {k: (v if isinstance(v, (int, float, str, bool, type(None), dict)) else str(v))
                   for k, v in cfg_kw.items() if k != "output_dir"},
        "versions": common.versions("trl", "datasets"),
        "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_NO_USAGE_STATS")},
        "steps": [],
    }

    class Timer(TrainerCallback):
        def __init__(self):
            self.last = None
            self.begin = None

        def on_train_begin(self, a, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == args.warmup and torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
                gpu.reset()
            self.begin = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            rec = {"step": state.global_step, "step_s": now - self.last,
                   "step_begin_to_end_s": now - (self.begin or self.last),
                   "phases_s": dict(phase_now)}
            phase_now.clear()
            if torch.cuda.is_available():
                rec["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            rec["gpu_memory_used_peak_gb"] = gpu.peak_gb
            self.last = now
            result["steps"].append(rec)
            finish(partial=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and result["steps"]:
                result["steps"][-1].setdefault("trl_logs", {}).update(
                    {k: v for k, v in logs.items() if isinstance(v, (int, float))})
                finish(partial=True)

    def finish(partial: bool):
        steps = result["steps"]
        times = [s["step_s"] for s in steps]
        result.update(common.summarize(times, args.warmup))
        timed = steps[args.warmup:]
        if timed:
            import statistics
            keys = sorted({k for s in timed for k in s["phases_s"]})
            result["median_phases_s"] = {k: statistics.median(s["phases_s"].get(k, 0.0) for s in timed) for k in keys}
            med = result["median_step_s"]
            seqs = config.generation_batch_size  # completions per optimizer step
            gen_len = [s.get("trl_logs", {}).get("completions/mean_length") for s in timed]
            gen_len = [g for g in gen_len if g is not None]
            mean_len = statistics.mean(gen_len) if gen_len else config.max_completion_length
            result["response_length_mean"] = mean_len
            result["tokens_per_s"] = seqs * (inputs["prompt_tokens"] + mean_len) / med
            gen_s = result["median_phases_s"].get("_prepare_inputs>vLLM.generate") or \
                result["median_phases_s"].get("vLLM.generate")
            if gen_s:
                result["generated_tokens_per_s"] = seqs * mean_len / gen_s
            result["max_memory_allocated_gb"] = max(s.get("max_memory_allocated_gb") or 0 for s in timed) or None
            result["gpu_memory_used_peak_gb"] = max(s.get("gpu_memory_used_peak_gb") or 0 for s in timed) or None
        result["partial"] = partial
        common.write_json(args.json, result)

    trainer = GRPOTrainer(model=inputs["model_dir"], reward_funcs=reward_len, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()], peft_config=peft_config)
    result["setup_s"] = time.perf_counter() - t0
    if peft_config is not None:
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in trainer.model.parameters())
        result["parameters"] = {"trainable": trainable, "total": total,
                                "trainable_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()
                                                            if p.requires_grad})}
        result["versions"]["peft"] = __import__("peft").__version__
    result["versions"]["trl"] = trl.__version__
    print(f"trainer ready in {result['setup_s']:.1f} s", flush=True)
    trainer.train()
    gpu.stop()
    finish(partial=False)
    print(f"TRL GRPO ({result['variant']}): median {result.get('median_step_s')} s per step over "
          f"{result.get('timed_steps')} steps; wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
