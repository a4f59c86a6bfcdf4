"""Benchmark: the actor update's tokens/s and MFU on a Qwen2.5-0.5B-shaped model (not a test).

    python bench/gpu_train.py [--json bench/results/gpu_train_h200.json] [--tiny --device cpu]

Variants (each on a fresh copy of the same random weights, median of timed updates):
- `lm_step_reference`: the plain LM step the reference figure came from (16 x 512 tokens, full
  logits, cross-entropy, fp32 weights + bf16 autocast, per-tensor AdamW);
- `actor_*`: the engine's `Actor.update` (PPO loss, a 256-token prompt + 256-token response
  per sequence, mini-batch 64) eager or with `ppo.torch_compile`, fp32 weights + bf16 autocast
  or pure bf16 weights with fp32 master weights (`MasterAdamW` below), micro-batch 16 or 32.

MFU follows the usual model-FLOPs convention: 6 x parameters x tokens + 12 x layers x width x
sequence length x tokens (attention, not discounted for causality), over 790 TFLOP/s, the bf16
matrix rate measured on the H200. `executed_tflops` counts what actually runs instead: the
actor computes the LM head only at response positions, and attention is causal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import flops  # noqa: E402  (bench/, on the path above)

PEAK_TFLOPS = flops.MEASURED_TFLOPS_H200


def sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_flops(n_params: int, cfg, tokens: int, seq_len: int) -> float:
    return flops.model_flops(n_params, cfg.num_hidden_layers, cfg.hidden_size, tokens, seq_len)


def executed_flops(cfg, tokens: int, seq_len: int, logit_tokens: int) -> float:
    """The update's executed FLOPs (bench/flops.py `training_flops`: every weight trains, no checkpointing)."""
    from rlhf.memory import ModelShape
    return flops.training_flops(ModelShape.from_config(cfg), tokens, seq_len, logit_tokens,
                                frozen_base=False, checkpointing=False)


def make_master_adamw():
    import torch

    class MasterAdamW(torch.optim.AdamW):
        """AdamW on fp32 master copies of bf16 model weights: grads are upcast into the masters,
        the fused kernel updates them, and the bf16 weights are refreshed from them."""

        def __init__(self, model_params, **kwargs):
            self.model_params = list(model_params)
            masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
            kwargs.pop("foreach", None)
            super().__init__(masters, fused=True, **kwargs)

        @torch.no_grad()
        def step(self, closure=None):
            masters = self.param_groups[0]["params"]
            for p, m in zip(self.model_params, masters):
                m.grad = None if p.grad is None else p.grad.float()
            super().step()
            torch._foreach_copy_(self.model_params, masters)

        def zero_grad(self, set_to_none: bool = True):
            for p in self.model_params:
                p.grad = None

    return MasterAdamW


def ppo_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int):
    import torch

    from rlhf.batch import Batch
    g = torch.Generator().manual_seed(seed)
    return Batch({
        "prompt_ids": torch.randint(3, vocab, (n, prompt_len), generator=g),
        "prompt_mask": torch.ones(n, prompt_len, dtype=torch.long),
        "response_ids": torch.randint(3, vocab, (n, response_len), generator=g),
        "response_mask": torch.ones(n, response_len, dtype=torch.long),
        "advantages": torch.randn(n, response_len, generator=g),
    })


def run_actor_variant(name, base_state, config, device, args, compile_: bool, pure_bf16: bool, micro: int):
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf.config import PPOConfig
    from rlhf.placement.context import DeviceContext
    from rlhf.roles.actor import Actor

    n, P, R = args.batch, args.prompt_len, args.response_len
    cfg = PPOConfig(rollout_micro_batch_size=n, num_rollout_batches=1, mini_batch_size=n, micro_batch_size=micro,
                    max_prompt_length=P, max_response_length=R, actor_learning_rate=1e-6,
                    torch_compile=compile_, dtype="bfloat16")
    dtype = torch.bfloat16 if pure_bf16 else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(base_state)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    autocast = torch.bfloat16 if (device.type == "cuda" and not pure_bf16) else None
    actor = Actor(DeviceContext(device, autocast), cfg, start_dir="", tokenizer_dir="", total_updates=100, model=model,
                  tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=1))  # generation is not timed here
    if pure_bf16:
        actor.optimizer = make_master_adamw()(model.parameters(), lr=1e-6, betas=(0.9, 0.95), eps=1e-8)
        from rlhf.roles.optimizer import build_scheduler
        actor.scheduler = build_scheduler(actor.optimizer, cfg, 100)
    batch = ppo_batch(n, P, R, config.vocab_size, seed=1)
    torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None

    def old_logprobs():
        sync(device)
        t = time.perf_counter()
        batch["old_logprobs"], _ = actor.compute_logprobs(batch)
        sync(device)
        return time.perf_counter() - t

    def update():
        sync(device)
        t = time.perf_counter()
        actor.update(batch, shuffle_seed=0, kl_coef=0.0)
        sync(device)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        old_logprobs()
        update()
    warm_s = time.perf_counter() - t0
    fwd = statistics.median(old_logprobs() for _ in range(args.steps))
    upd = statistics.median(update() for _ in range(args.steps))
    tokens, seq = n * (P + R), P + R
    mf = model_flops(n_params, config, tokens, seq)
    ef = executed_flops(config, tokens, seq, n * R)
    out = {
        "variant": name, "torch_compile": compile_,
        "weights": "bf16 + fp32 master" if pure_bf16 else "fp32 + bf16 autocast",
        "sequences": n, "prompt_tokens": P, "response_tokens": R, "micro_batch_size": micro, "mini_batch_size": n,
        "params": n_params, "warmup_s": warm_s,
        "update_s": upd, "update_tokens_per_s": tokens / upd,
        "update_mfu": mf / upd / (PEAK_TFLOPS * 1e12), "update_executed_tflops": ef / upd / 1e12,
        "old_logprobs_s": fwd, "old_logprobs_tokens_per_s": tokens / fwd,
        "old_logprobs_mfu": (mf / 3) / fwd / (PEAK_TFLOPS * 1e12),
    }
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    actor = model = None  # frees the weights: the closures above hold these same cells
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_lm_reference(base_state, config, device, args):
    """The reference figure's setup: a plain LM step, 16 x 512 tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(base_state)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)
    B, T = 16, args.prompt_len + args.response_len
    ids = torch.randint(3, config.vocab_size, (B, T), device=device)
    autocast = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        sync(device)
        t = time.perf_counter()
        with torch.autocast(**autocast):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t

    for _ in range(args.warmup):
        step()
    s = statistics.median(step() for _ in range(args.steps * 2))
    tokens = B * T
    out = {"variant": "lm_step_reference", "sequences": B, "seq_len": T, "step_s": s, "tokens_per_s": tokens / s,
           "mfu": model_flops(n_params, config, tokens, T) / s / (PEAK_TFLOPS * 1e12)}
    model = opt = None  # frees the weights: step() holds these same cells
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "gpu_train_h200.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model shape (CPU smoke test)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--variants", default="lm_step_reference,actor_eager,actor_compiled,actor_compiled_mb32,"
                                          "actor_compiled_bf16_master,actor_compiled_nondeterministic")
    args = p.parse_args(argv)

    import torch
    from gpu_assets import model_config
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    config = model_config(args.tiny)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base_state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    specs = {
        "actor_eager": dict(compile_=False, pure_bf16=False, micro=16),
        "actor_compiled": dict(compile_=True, pure_bf16=False, micro=16),
        "actor_compiled_mb32": dict(compile_=True, pure_bf16=False, micro=32),
        "actor_compiled_bf16_master": dict(compile_=True, pure_bf16=True, micro=16),
        "actor_compiled_nondeterministic": dict(compile_=True, pure_bf16=False, micro=16),
    }
    results, errors = [], {}
    for name in args.variants.split(","):
        # The trainer runs with deterministic algorithms on (warn only); so do these, but one variant.
        torch.use_deterministic_algorithms(not name.endswith("nondeterministic"), warn_only=True)
        try:
            if name == "lm_step_reference":
                r = run_lm_reference(base_state, config, device, args)
            else:
                r = run_actor_variant(name, base_state, config, device, args, **specs[name])
            r["deterministic_algorithms"] = not name.endswith("nondeterministic")
            results.append(r)
            print(json.dumps(r), flush=True)
        except Exception as err:  # keep measuring the other variants
            errors[name] = "".join(traceback.format_exception_only(type(err), err)).strip()[-2000:]
            traceback.print_exc()
        result = {
            "command": "python bench/gpu_train.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "peak_tflops_bf16": PEAK_TFLOPS, "model_shape": "tiny" if args.tiny else "Qwen2.5-0.5B (random weights)",
            "results": results, "errors": errors,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))  # after every variant: a timeout keeps the rest
    print(f"\n{'variant':<34} {'tok/s':>9} {'MFU':>6} {'fwd tok/s':>10} {'mem GB':>7}")
    for r in results:
        if r["variant"] == "lm_step_reference":
            print(f"{r['variant']:<34} {r['tokens_per_s']:9.0f} {100 * r['mfu']:5.1f}%")
        else:
            print(f"{r['variant']:<34} {r['update_tokens_per_s']:9.0f} {100 * r['update_mfu']:5.1f}% "
                  f"{r['old_logprobs_tokens_per_s']:10.0f} {r.get('peak_memory_gb', 0):7.1f}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
