"""What a LoRA adapter costs in the engine's decoder layers, by how it is computed, on one GPU (not a
test). Prints a table and writes JSON.

    python bench/lora_layers.py --json OUT.json [--layers 4] [--rank 64] [--repeats 10]

A Qwen2.5 model of the shipped 7B recipe's width (random bf16 weights, `--layers` decoder layers),
peft adapters on every linear layer as `ppo.lora_rank` puts them, packed rows of 768-token sequences
(256 + 512, the benchmarks' rows) through the engine's packed attention, bf16 autocast, compiled
layers (`ppo.torch_compile`) and deterministic backward as `models/lora.gin` runs them. For each way:

- `base`: the adapters switched off (the reference pass): the floor;
- `peft`: peft's own forward, `base(x) + B(A(x)) * s`;
- `addmm` and `merged`: `rlhf.roles.compiled.fuse_lora`'s modes;

(`--dynamic`: the layers compiled for any token count, as a run's micro-batches of varying length
make Dynamo compile them; by default one static count)

it times a forward-only pass of `--forward-tokens` (the forward passes' budget, 32768) and a forward
+ backward of `--update-tokens` (the update's, 8192), medians over `--repeats` after two warm-ups,
per layer, and the cost of the adapters over `base` scaled to one iteration of the 7B recipe
(28 layers, 196,608 tokens: the two forward passes with adapters on, old log-probs and values, and
the two updates).

`--update-tokens` takes a list (`1536,6144,7680,8192,12288`): the forward + backward at each count,
with the layers compiled for any count (as `--dynamic`), and its cost per 1,000 tokens. A mini-batch
of 32 sequences of 768 tokens is cut at 8192 into 7680 + 7680 + 7680 + 1536 tokens, at 12288 into two
of 12288: the list says what each cut costs (`mini_batch_ms_per_layer`, for each count that is a
budget). The first count is the one the adapters' cost is scaled from."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlhf.attention import packed_kwargs, use_packed_attention  # noqa: E402
from rlhf.determinism import deterministic_backward  # noqa: E402
from rlhf.models import add_lora  # noqa: E402
from rlhf.packing import budget_partition  # noqa: E402
from rlhf.roles.compiled import compile_layers, fuse_lora  # noqa: E402

MODES = ("base", "peft", "addmm", "merged")
RECIPE_LAYERS, RECIPE_TOKENS = 28, 196_608


def build(layers: int, rank: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                         num_hidden_layers=layers, vocab_size=152064, max_position_embeddings=32768,
                         rope_theta=1e6, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model = add_lora(model, rank, 2.0 * rank, 0.0, "all-linear")
    for name, p in model.named_parameters():  # B = 0 at the start: draw it, as after some training
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=1e-3)
    return use_packed_attention(model)


def set_mode(model, mode: str) -> None:
    from peft.tuners.lora.layer import Linear as LoraLinear
    for module in model.modules():
        if isinstance(module, LoraLinear):
            module.__dict__.pop("forward", None)
            module.enable_adapters(True)
    if mode == "base":
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.enable_adapters(False)
    elif mode in ("addmm", "merged"):
        fuse_lora(model, mode)
    torch._dynamo.reset()
    compile_layers(model)


def row(tokens: int, seq: int = 768):
    lengths = [seq] * (tokens // seq) + ([tokens % seq] if tokens % seq else [])
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    return positions, packed_kwargs(lengths, "cuda")


def timed(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(model, mode: str, forward_tokens: int, update_tokens: int, repeats: int, dynamic: bool) -> dict:
    set_mode(model, mode)
    decoder = model.base_model.model.model
    gen = torch.Generator(device="cuda").manual_seed(0)

    def run(tokens: int, grad: bool):
        positions, attention = row(tokens)
        embeds = torch.randn(1, tokens, 3584, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02

        def step():
            with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=torch.bfloat16):
                h = decoder(inputs_embeds=embeds.requires_grad_(grad), position_ids=positions,
                            use_cache=False, **attention).last_hidden_state
            if grad:
                with deterministic_backward(True):
                    h.float().square().mean().backward()
                model.zero_grad(set_to_none=True)
                embeds.grad = None
        return step

    dynamic = dynamic or len(update_tokens) > 1
    if dynamic:  # a second token count first: Dynamo recompiles the layers with the count symbolic
        run(forward_tokens - 768, False)()
        run(update_tokens[0] - 768, True)()
    layers = len(decoder.layers)
    forward_ms = timed(run(forward_tokens, False), repeats)
    by_tokens = {n: timed(run(n, True), repeats) / layers for n in update_tokens}
    out = {"mode": mode, "shapes": "dynamic" if dynamic else "static", "forward_ms_per_layer": forward_ms / layers,
           "update_ms_per_layer": by_tokens[update_tokens[0]], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if len(update_tokens) > 1:
        out["update_ms_per_layer_by_tokens"] = {str(n): ms for n, ms in by_tokens.items()}
        out["update_ms_per_1k_tokens"] = {str(n): 1000 * ms / n for n, ms in by_tokens.items()}
        cuts = {b: greedy_cuts(MINI_BATCH, b) for b in update_tokens if b >= SEQ}
        out["mini_batch_ms_per_layer"] = {str(b): sum(by_tokens[c] for c in cut) for b, cut in cuts.items()
                                          if all(c in by_tokens for c in cut)}
    return out


SEQ, MINI_BATCH = 768, 32


def greedy_cuts(sequences: int, budget: int, seq: int = SEQ) -> list:
    """The token counts of the micro-batches a mini-batch of `sequences` sequences of `seq` tokens is
    cut into at a token budget, as the engine cuts it (rlhf/packing.py `budget_partition`)."""
    return [seq * len(part) for part in budget_partition([seq] * sequences, budget)]


def token_counts(text: str) -> list:
    """`--update-tokens`: positive token counts, comma-separated (argparse's one-line error, exit 2, otherwise)."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive token counts, comma-separated (e.g. 8192,12288)")
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--forward-tokens", type=int, default=32768)
    p.add_argument("--update-tokens", type=token_counts, default=[8192],
                   help="forward + backward token count(s), comma-separated (a list compiles the layers for any count)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dynamic", action="store_true",
                   help="compile the layers for any token count, as a run's varying micro-batches make Dynamo do "
                        "(one warm-up at another count first); default: one static count")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/lora_layers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True, warn_only=True)
    update_tokens = args.update_tokens
    model = build(args.layers, args.rank)
    results = []
    for mode in args.modes.split(","):
        torch.cuda.reset_peak_memory_stats()
        results.append(measure(model, mode, args.forward_tokens, update_tokens, args.repeats, args.dynamic))
        r = results[-1]
        print(f"{mode:>7}: forward {r['forward_ms_per_layer']:.2f} ms/layer at {args.forward_tokens} tokens, "
              f"forward+backward {r['update_ms_per_layer']:.2f} ms/layer at {update_tokens[0]}", flush=True)
        for n, per_1k in r.get("update_ms_per_1k_tokens", {}).items():
            print(f"{'':>7}  forward+backward at {n:>6} tokens: {per_1k:.3f} ms/layer per 1,000 tokens", flush=True)
        for b, ms in r.get("mini_batch_ms_per_layer", {}).items():
            print(f"{'':>7}  a mini-batch of {MINI_BATCH} x {SEQ} tokens cut at {b:>6}: "
                  f"{greedy_cuts(MINI_BATCH, int(b))} = {ms:.2f} ms/layer", flush=True)
    base = next((r for r in results if r["mode"] == "base"), None)
    if base is not None:
        for r in results:  # one 7B iteration: 3 adapted forward passes and 2 updates over RECIPE_TOKENS
            fwd = (r["forward_ms_per_layer"] - base["forward_ms_per_layer"]) * RECIPE_TOKENS / args.forward_tokens
            upd = (r["update_ms_per_layer"] - base["update_ms_per_layer"]) * RECIPE_TOKENS / update_tokens[0]
            r["adapter_s_per_7b_iteration"] = round(RECIPE_LAYERS * (2 * fwd + 2 * upd) / 1000, 2)
            print(f"{r['mode']:>7}: adapters cost {r['adapter_s_per_7b_iteration']:.2f} s of a 7B recipe iteration "
                  f"(2 adapted forward passes + 2 updates)")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers, "rank": args.rank,
           "forward_tokens": args.forward_tokens,
           "update_tokens": update_tokens[0] if len(update_tokens) == 1 else update_tokens, "results": results}
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
