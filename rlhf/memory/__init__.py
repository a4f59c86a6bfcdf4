"""Device memory: what each role takes, predicted before launch from the model's shape and measured
once the roles are built, and moving idle roles' state to pinned host memory when they do not fit.

    shapes.py    a model's shape from its config.json (`ModelShape`), the published shapes
    formulas.py  the bytes of each role and of one micro-batch of each phase, from a shape and `ppo`
    plan.py      the predicted plan phase by phase (`predict`), the check that names a fix (`check`,
                 `suggest`), the check at a run's start (`preflight`) and the 'auto' rule (`resolve_auto`)
    runtime.py   the plan applied on a GPU from what the built roles hold (`apply_runtime_plan`)
    offload.py   idle roles' state to pinned host memory and back (`Offloader`)
    __main__.py  `python -m rlhf.memory RECIPE.gin`: a recipe's plan, printed

Measured (`ppo.offload_idle_models = 'auto'`, the default): colocated roles are built with
offloading on, so building never overflows; then the sum of what each holds resident plus the
predicted activations must fit beside the awake rollout engine, or idle roles are offloaded and vLLM
sleeps (`ppo.vllm_sleep = 'auto'`).

Checked against the shipped recipes run through `python -m rlhf.train` on one H200 (bench/recipe_run.py;
docs/lora_memory.md has the tables): each phase's peak, allocated and reserved, beside the plan. On the
recipes as shipped before (bench/results/lora7b_recipe_gc16k_h200.json: the 7B shape, LoRA with
checkpointing; bench/results/instruct05b_recipe_eager_h200.json: the 0.5B shape, full fine-tuning,
eager) the plan is 0-9% above every phase's measured allocation, never below
(tests/rlhf/test_memory_plan.py keeps both runs). The torch allocator runs with expandable segments
(rlhf/allocator.py), so a phase's reserve stays close to its allocation.
"""

from __future__ import annotations

from rlhf.memory.formulas import GIB, layer_activation_bytes, saved_activation_bytes
from rlhf.memory.offload import Offloader
from rlhf.memory.plan import MemoryPlan, check, check_policy, predict, preflight, run_shapes, suggest
from rlhf.memory.runtime import apply_runtime_plan, device_memory, runtime_plan, state_bytes
from rlhf.memory.shapes import KNOWN_SHAPES, LINEARS, ModelShape, parameter_count, tiny_shape

__all__ = ["GIB", "KNOWN_SHAPES", "LINEARS", "MemoryPlan", "ModelShape", "Offloader", "apply_runtime_plan", "check",
           "check_policy", "device_memory", "layer_activation_bytes", "parameter_count", "predict", "preflight",
           "run_shapes", "runtime_plan", "saved_activation_bytes", "state_bytes", "suggest", "tiny_shape"]
