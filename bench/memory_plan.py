"""Benchmark: the memory plan's prediction against measured peaks on a GPU (not a test).

For each case an actor-shaped model is built from a published shape (random weights; full
fine-tuning in fp32 + bf16 autocast, or LoRA with peft on a frozen bf16 base, with or without
transformers' gradient checkpointing) and one PPO-like update step runs through the engine's own
forward (`rlhf.roles.forward.response_logprobs`: LM head on the response positions, log-probs and
entropy), backward and fused AdamW step; then a no-grad forward as the old-log-prob pass. The peak
allocated memory of each is printed beside `rlhf.memory.predict`'s figure for the same
micro-batch (the actor's resident state + its update / forward micro-batch; no vLLM, no reserve).

    python bench/memory_plan.py [--json OUT.json] [--case NAME]... [--tiny]

bench/results/memory_plan_h200.json was measured with the LM head's full logits, before the head ran in
chunks; the plan is now checked against whole runs of the shipped recipes (bench/recipe_run.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# name: (shape, micro-batch rows, prompt, response, LoRA rank, gradient checkpointing)
CASES = {
    "0.5b_full_mb16": ("qwen2.5-0.5b", 16, 256, 256, 0, False),
    "1.5b_full_mb8": ("qwen2.5-1.5b", 8, 256, 256, 0, False),
    "3b_full_mb8": ("qwen2.5-3b", 8, 256, 256, 0, False),
    "3b_full_mb8_ckpt": ("qwen2.5-3b", 8, 256, 256, 0, True),
    "7b_lora64_mb4": ("qwen2.5-7b", 4, 1024, 512, 64, False),
    "7b_lora64_mb4_ckpt": ("qwen2.5-7b", 4, 1024, 512, 64, True),
}


def run_config(rows: int, prompt: int, response: int, rank: int, ckpt: bool, device: str):
    from rlhf.config import ModelConfig, PPOConfig, RunConfig, SFTConfig, TaskConfig, TinyModelConfig
    ppo = PPOConfig(device=device, dtype="bfloat16", rollout_backend="hf", max_prompt_length=prompt,
                    max_response_length=response, rollout_micro_batch_size=rows, num_rollout_batches=1,
                    mini_batch_size=rows, micro_batch_size=rows, lora_rank=rank, lora_alpha=2.0 * rank or 16.0,
                    gradient_checkpointing=ckpt)
    return RunConfig(ppo=ppo, model=ModelConfig("/published-shape"), task=TaskConfig(), sft=SFTConfig(),
                     tiny_model=TinyModelConfig())


def build(shape, rank: int, ckpt: bool, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    config = Qwen2Config(hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                         intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
                         tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=4096)
    dtype = torch.bfloat16 if rank and device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if rank:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                 target_modules="all-linear", bias="none"),
                               autocast_adapter_dtype=True)
    return model


def batch(rows: int, prompt: int, response: int, vocab: int, device):
    import torch

    from rlhf.batch import Batch
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[: rows // 2, : prompt // 4] = 0  # left padding in half the rows, as rollouts have
    return Batch({"prompt_ids": torch.randint(0, vocab, (rows, prompt), generator=g), "prompt_mask": prompt_mask,
                  "response_ids": torch.randint(0, vocab, (rows, response), generator=g),
                  "response_mask": torch.ones(rows, response, dtype=torch.long)})


def measure(name: str, tiny: bool = False) -> dict:
    import torch

    from rlhf import memory
    from rlhf.models import adamw
    from rlhf.roles.forward import response_logprobs
    shape_name, rows, prompt, response, rank, ckpt = CASES[name]
    shape = memory.KNOWN_SHAPES[shape_name]
    if tiny:
        shape = memory.ModelShape(64, 2, 4, 2, 16, 128, 512, True, True, name="tiny")
        rows, prompt, response = 2, 16, 8
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = memory.predict(run_config(rows, prompt, response, rank, ckpt, device.type), shape,
                          available=int(139 * memory.GIB), gpu=device.type == "cuda")
    actor = plan.roles["actor"]
    autocast = torch.bfloat16 if device.type == "cuda" else None
    model = build(shape, rank, ckpt, device)
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    micro = batch(rows, prompt, response, shape.vocab_size, device)
    mask = micro["response_mask"].to(device).float()

    def update() -> None:
        model.train()
        optimizer.zero_grad(set_to_none=True)
        logprobs, entropy = response_logprobs(model, micro, device, 1.0, autocast)
        loss = -((logprobs + 0.01 * entropy) * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()

    t0 = time.perf_counter()
    update()  # allocates the gradients and AdamW's moments
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    update()
    out = {"case": name, "shape": shape.name, "rows": rows, "prompt": prompt, "response": response,
           "lora_rank": rank, "gradient_checkpointing": ckpt, "params": shape.parameter_count(),
           "predicted_update_gib": (actor.resident + actor.train) / memory.GIB,
           "predicted_forward_gib": (actor.resident + actor.forward) / memory.GIB,
           "predicted_state_gib": actor.resident / memory.GIB}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["measured_update_gib"] = torch.cuda.max_memory_allocated() / memory.GIB
        out["measured_state_gib"] = torch.cuda.memory_allocated() / memory.GIB
        torch.cuda.reset_peak_memory_stats()
        model.eval()
        with torch.no_grad():
            response_logprobs(model, micro, device, 1.0, autocast)
        torch.cuda.synchronize()
        out["measured_forward_gib"] = torch.cuda.max_memory_allocated() / memory.GIB
    out["seconds"] = time.perf_counter() - t0
    model = optimizer = None  # frees the weights: update() holds these same cells
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--case", action="append", default=[], choices=sorted(CASES))
    p.add_argument("--tiny", action="store_true", help="one tiny shape on whatever device (smoke test)")
    args = p.parse_args(argv)
    import torch
    results = []
    for name in args.case or (list(CASES)[:1] if args.tiny else list(CASES)):
        r = measure(name, tiny=args.tiny)
        results.append(r)
        print(f"{name:<22} update predicted {r['predicted_update_gib']:7.2f} "
              f"measured {r.get('measured_update_gib', 0):7.2f}"
              f" | forward predicted {r['predicted_forward_gib']:7.2f} measured {r.get('measured_forward_gib', 0):7.2f}"
              f" | state {r['predicted_state_gib']:6.2f} / {r.get('measured_state_gib', 0):6.2f} GiB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python bench/memory_plan.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
