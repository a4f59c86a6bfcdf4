"""The predicted memory plan of a recipe, without running it (no GPU, no weights: config.json only).

    python -m rlhf.memory RECIPE.gin [-b 'BINDING']... [--gpu-memory-gib 139] [--shape NAME] [--table]
                                     [--longest-prompt TOKENS]

Sequences are planned at the data's longest prompt, measured as the run measures it at its start
(the model directory's tokenizer over the task's prompts), or given; else at ppo.max_prompt_length.

Prints each role's bytes on one GPU, each phase of a PPO step, and the verdict. Exit codes: 0 it
fits, 2 it does not (the line names the bindings that would make it fit) or the configuration is
invalid (one line: the policy is checked as the trainer checks it at its start, rlhf/memory/plan.py
`check_policy`). The arithmetic is rlhf/memory/'s, the same the trainer checks before launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from rlhf.errors import EXIT_CONFIG, EXIT_OK

DEFAULT_GPU_GIB = 139.0
"""What an H200 leaves usable (of 140 GiB), when this machine has no GPU to ask."""
MAX_GPU_GIB = 1e5
"""The most --gpu-memory-gib takes: far above any GPU (an H200 has 140 GiB), far below a typo's 1e30."""
TABLE_VARIANTS = (("full FT", {"lora_rank": 0, "gradient_checkpointing": False}),
                  ("LoRA 64", {"lora_rank": 64, "gradient_checkpointing": False}),
                  ("LoRA 64 + checkpointing", {"lora_rank": 64, "gradient_checkpointing": True}))
TABLE_WORLD_SIZES = (1, 2, 4, 8)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m rlhf.memory",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("recipe", help="a gin recipe, e.g. recipes/models/lora.gin")
    p.add_argument("-b", "--binding", action="append", default=[], help="a gin binding, e.g. 'ppo.lora_rank = 64'")
    p.add_argument("--gpu-memory-gib", default=None,
                   help=f"memory of one GPU in GiB, a number in (0, {MAX_GPU_GIB:g}] (default: this machine's "
                        f"GPU, else {DEFAULT_GPU_GIB:g}, an H200)")
    p.add_argument("--shape", default=None,
                   help="plan a published policy shape instead of model.name_or_path's config.json: "
                        "qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b")
    p.add_argument("--longest-prompt", default=None, metavar="TOKENS",
                   help="the longest prompt of your data in the policy's tokens, which the run plans with (default: "
                        "measured in the task's data as the run measures it at its start, where model.name_or_path "
                        "is a model directory; else ppo.max_prompt_length, the most any prompt keeps)")
    p.add_argument("--table", action="store_true",
                   help="a markdown table: every published shape x (full FT, LoRA 64, LoRA 64 + gradient "
                        "checkpointing) x 1/2/4/8 GPUs, from the recipe's other settings")
    return p.parse_args(argv)


def check_gpu_gib(value: str) -> float:
    """--gpu-memory-gib as a number, or a one-line ConfigError naming the flag and what it takes."""
    from rlhf.errors import ConfigError
    try:
        gib = float(value)
    except ValueError:
        gib = None
    if gib is None or not math.isfinite(gib) or not 0 < gib <= MAX_GPU_GIB:
        raise ConfigError(f"--gpu-memory-gib {value} is invalid: allowed: the memory of one GPU in GiB, a positive "
                          f"finite number up to {MAX_GPU_GIB:g} (an H200: {DEFAULT_GPU_GIB:g})")
    return gib


def check_longest_prompt(value: str) -> int:
    """--longest-prompt as a positive whole number of tokens, or a one-line ConfigError naming the flag."""
    from rlhf.errors import ConfigError
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"--longest-prompt {value} is invalid: allowed: a whole number of tokens, at least 1")
    return int(value)


def measured_longest_prompt(cfg) -> tuple:
    """(tokens or None, how it was found): the data's longest prompt, measured as the run measures it
    at its start (the policy's tokenizer and chat template over the train and evaluation prompts,
    rlhf/trainer.py `TaskPrompts`), where model.name_or_path is a model directory; else None, and the
    plan keeps prompts of ppo.max_prompt_length."""
    from rlhf.errors import ConfigError
    from rlhf.trainer import TaskPrompts, longest_prompt
    if cfg.model.name_or_path == "tiny":
        return None, "the tiny default's prompts are not measured here"
    try:
        lengths = TaskPrompts.load(cfg, log=lambda _: None).lengths()
    except ConfigError as err:
        return None, f"the data's prompts could not be measured ({str(err).splitlines()[0]})"
    longest = longest_prompt(lengths)
    if longest is None:
        return None, "the task's data holds no prompts"
    return longest, "measured in the task's data"


def prompt_line(longest: int, ppo) -> str:
    """The tail of the `prompts:` line: the longest prompt measured and, above ppo.max_prompt_length,
    what the run does with it (ppo.prompt_truncation: cut to the limit, or refused at its start)."""
    limit = ppo.max_prompt_length
    if longest <= limit:
        return f", the longest {longest} tokens"
    if ppo.prompt_truncation == "error":
        return (f", the longest {longest} tokens, over ppo.max_prompt_length = {limit}: the run refuses it at "
                f"its start (ppo.prompt_truncation = 'error'); planned at {limit}")
    return (f", the longest {longest} tokens, cut to ppo.max_prompt_length = {limit} "
            f"(ppo.prompt_truncation = {ppo.prompt_truncation!r}); planned at {limit}")


def gpu_gib(requested) -> tuple:
    """(GiB, where the figure comes from)."""
    if requested is not None:
        return check_gpu_gib(requested), "--gpu-memory-gib"
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2 ** 30, torch.cuda.get_device_name(0)
    return DEFAULT_GPU_GIB, f"no GPU here: assumed {DEFAULT_GPU_GIB:g} GiB (an H200); set --gpu-memory-gib"


def _gib(b: int) -> str:
    return f"{b / 2 ** 30:.1f}"


def render(plan, cfg, policy, recipe: str, where: str) -> str:
    ppo = cfg.ppo
    s = plan.settings
    prompt = s["prompt_tokens"]
    budget = f"{ppo.max_tokens_per_micro_batch} tokens a micro-batch (packed)" if ppo.max_tokens_per_micro_batch \
        else f"micro-batch {ppo.micro_batch_size} x {prompt + ppo.max_response_length} tokens"
    longest = f" (the longest; ppo.max_prompt_length {ppo.max_prompt_length})" if prompt < ppo.max_prompt_length else ""
    if not ppo.uses_critic:
        trained = f"LoRA rank {ppo.lora_rank}" if ppo.lora_rank else "full fine-tuning"
        trained += f", no critic ({ppo.adv_estimator})"
    elif ppo.lora_rank:
        trained = f"LoRA rank {ppo.lora_rank} (critic {ppo.resolved_critic_lora_rank})"
    elif ppo.resolved_critic_lora_rank:
        trained = f"full fine-tuning (critic LoRA {ppo.resolved_critic_lora_rank})"
    else:
        trained = "full fine-tuning"
    lines = [f"{recipe}: policy {policy.name or 'model'} ({s['policy_params'] / 1e9:.2f}B parameters), prompt "
             f"{prompt}{longest} + response {ppo.max_response_length}, {trained}"
             + f", gradient checkpointing {'on' if ppo.gradient_checkpointing else 'off'}, {budget}, world_size "
               f"{ppo.world_size} ({ppo.resolved_placement}, {plan.gpus} GPU{'s' if plan.gpus > 1 else ''}), "
               f"rollouts {ppo.rollout_backend}"
             + (f" ({ppo.vllm_gpu_memory_utilization:g} of the GPU)" if ppo.rollout_backend == "vllm" else ""),
             f"GPU: {plan.available / 2 ** 30:.1f} GiB ({where})" if plan.available is not None else "CPU run",
             "",
             f"{'role (GiB a GPU)':<18}{'weights':>9}{'grads':>9}{'optimizer':>11}{'resident':>10}"
             f"{'update mb':>11}{'forward mb':>12}  note"]
    for r in plan.roles.values():
        lines.append(f"{r.name:<18}{_gib(r.weights):>9}{_gib(r.grads):>9}{_gib(r.optimizer):>11}"
                     f"{_gib(r.resident):>10}{_gib(r.train):>11}{_gib(r.forward):>12}  {r.note}"
                     + (f" (+ rollout replica {_gib(r.replica)})" if r.replica else ""))
    lines += ["", f"{'phase (GiB)':<18}{'resident':>10}{'vLLM':>8}{'micro-batch':>13}{'cuBLAS':>8}{'reserve':>9}"
                  f"{'total':>8}"]
    for p in plan.phases:
        lines.append(f"{p.name:<18}{_gib(p.resident):>10}{_gib(p.engine):>8}{_gib(p.transient):>13}"
                     f"{_gib(p.workspaces):>8}{_gib(p.reserve):>9}{_gib(p.total):>8}"
                     + ("  <- peak" if p is plan.peak else ""))
    def how(setting) -> str:
        return "'auto', decided as the runtime decides" if setting == "auto" else f"set to {setting!r}"
    lines += ["", f"offload idle models: {'on' if plan.offload else 'off'} ({how(ppo.offload_idle_models)}); "
                  f"vLLM sleep: {'on' if plan.sleep else 'off'} ({how(ppo.vllm_sleep)})"]
    return "\n".join(lines)


def table(cfg, gib: float, longest_prompt=None) -> str:
    """Rows: published shape x variant; columns: per-GPU peak (GiB) at each world size."""
    from rlhf import memory
    from rlhf.errors import ConfigError
    available = int(gib * memory.GIB)
    head = ["| policy shape | params | training | " + " | ".join(
        f"{n} GPU{'s' if n > 1 else ''}" for n in TABLE_WORLD_SIZES) + " |",
        "|---|---:|---|" + "---:|" * len(TABLE_WORLD_SIZES)]
    rows = []
    for shape in memory.KNOWN_SHAPES.values():
        for label, change in TABLE_VARIANTS:
            cells = []
            for n in TABLE_WORLD_SIZES:
                extra: dict[str, object] = {"world_size": n}
                if n > 1 and cfg.ppo.placement == "local":
                    extra["placement"] = "colocated"
                try:
                    variant = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, **change, **extra))
                except ConfigError:
                    cells.append("–")
                    continue
                plan = memory.predict(variant, shape, available=available, longest_prompt=longest_prompt)
                cells.append(f"{_gib(plan.peak.total)} {'fits' if plan.fits else '**no**'}")
            params = f"{shape.parameter_count() / 1e9:.2f}B"
            rows.append(f"| {shape.name} | {params} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(head + rows)


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    from rlhf import configurable, memory
    from rlhf.errors import ConfigError
    bindings = list(args.binding)
    try:
        if args.gpu_memory_gib is not None:
            check_gpu_gib(args.gpu_memory_gib)  # before the recipe: a bad flag is named first
        longest = check_longest_prompt(args.longest_prompt) if args.longest_prompt is not None else None
        shape = None
        if args.shape is not None:
            shape = memory.KNOWN_SHAPES.get(args.shape.lower())
            if shape is None:
                raise ConfigError(f"--shape {args.shape!r} is not a published shape here; allowed: "
                                  f"{', '.join(memory.KNOWN_SHAPES)}")
        if (shape is not None or args.table) and not any(b.strip().startswith("model.name_or_path") for b in bindings):
            bindings.insert(0, f"model.name_or_path = '{args.shape or 'published-shape'}'")  # a shape, not a dir
        cfg, _ = configurable.resolve(args.recipe, bindings)
        gib, where = gpu_gib(args.gpu_memory_gib)
        if args.table:
            print(table(cfg, gib, longest))
            return EXIT_OK
        memory.check_policy(cfg, policy=shape)  # what the trainer refuses at its start, refused here
        policy, reward_model = memory.run_shapes(cfg, policy=shape)
        if longest is None and shape is None:
            longest, how = measured_longest_prompt(cfg)
            print(f"prompts: {how}" + (prompt_line(longest, cfg.ppo) if longest is not None else
                                        f"; planned at ppo.max_prompt_length = {cfg.ppo.max_prompt_length}"))
        gpu = cfg.ppo.device != "cpu"
        available = int(gib * memory.GIB) if gpu else None
        plan = memory.predict(cfg, policy, reward_model, available=available, gpu=gpu, longest_prompt=longest)
        print(render(plan, cfg, policy, args.recipe, where))
        if gpu:
            assert available is not None  # set above on every GPU run
            memory.check(cfg, policy, reward_model, available=available, longest_prompt=longest)
        print(f"verdict: the run {plan.verdict()}")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
