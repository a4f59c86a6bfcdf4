"""Benchmark: the engine's vLLM generate call under torch's deterministic-mode settings (not a test).

    python bench/gpu_generate_modes.py --assets /tmp/assets-0.5b --json OUT.json [--repeats 2]

The trainer runs with `torch.use_deterministic_algorithms(True, warn_only=True)`; the flag is
process-wide, so a rollout that runs beside the critic's update (`ppo.overlap_rollout`) cannot
lift it without changing what the critic's compiled layers run. This measures what the flag costs
the rollout itself: `VLLMRollout.generate` on 256 prompts x 256 prompt tokens x 256 new tokens
(the PPO workload), with the same seed, alternating between the modes

- `off`: deterministic algorithms off (how the engine generated before overlap);
- `on_fill`: on, with torch's NaN fill of every new tensor (torch's default under the flag);
- `on`: on, without the fill (`rlhf.determinism.deterministic_algorithms` on a GPU);

and whether each mode gives the same tokens as `off`. Best of `--repeats` per mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MODES = {"off": (False, True), "on_fill": (True, True), "on": (True, False)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--assets", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=256)
    args = p.parse_args(argv)

    import torch
    from gpu_assets import build_assets, random_prompts

    from rlhf.config import PPOConfig
    from rlhf.models import load_tokenizer
    from rlhf.rollout import SamplingParams
    from rlhf.rollout.vllm import VLLMRollout

    assets = build_assets(args.assets)
    tok = load_tokenizer(assets["tokenizer_dir"])
    device = torch.device("cuda")
    rollout = VLLMRollout(tokenizer=tok, device=device, model_dir=assets["model_dir"], seed=0, max_model_len=512,
                          gpu_memory_utilization=0.3)
    prompts = random_prompts(args.prompts, 256, seed=1)
    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=256, max_prompt_length=256))
    torch.set_num_threads(4)
    rollout.generate(prompts[:16], sampling, seed=5)  # warm-up
    times = {m: [] for m in MODES}
    tokens = {}
    for _ in range(args.repeats):
        for mode, (flag, fill) in MODES.items():
            torch.use_deterministic_algorithms(flag, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = fill
            torch.cuda.synchronize()
            t = time.perf_counter()
            batch = rollout.generate(prompts, sampling, seed=7)
            torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - t)
            tokens[mode] = batch["response_ids"]
            print(f"{mode:8s} {times[mode][-1]:.3f} s", flush=True)
    result = {
        "work": f"{args.prompts} prompts x 256 prompt tokens x 256 new tokens, VLLMRollout.generate, one seed",
        "best_s": {m: min(v) for m, v in times.items()},
        "all_s": times,
        "same_tokens_as_off": {m: bool(torch.equal(tokens[m], tokens["off"])) for m in MODES},
        "torch": torch.__version__,
        "command": "python bench/gpu_generate_modes.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["best_s"]), result["same_tokens_as_off"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
