"""Every shipped recipe parses and builds; bad bindings fail before compute with one clear line."""

import time

import pytest

from rlhf import configurable
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from tests.conftest import REPO, run_train

# Recipes that build on their own. Not here: studies; recipes/rm/ (reward-model training's own `rm`
# scope); the real-model layers and recipes/gsm8k.gin, which need a user's model paths (tested with
# local checkpoints in tests/rlhf/test_reward_model_engine.py).
REAL_MODEL_RECIPES = ("gsm8k.gin", "instruct.gin", "reward_model.gin", "gsm8k_verl.gin", "lora.gin", "multi_gpu.gin")
ENGINE_RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.gin")
                        if "studies" not in p.parts and "rm" not in p.parts and p.name not in REAL_MODEL_RECIPES)
POLICY_ONLY_RECIPES = ("instruct.gin", "lora.gin", "multi_gpu.gin")  # recipes/models/: one path to set


@pytest.mark.parametrize("recipe", ENGINE_RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_engine_recipe_parses_and_builds(recipe):
    cfg, operative = configurable.resolve(recipe, [])
    assert "ppo.kl_coef" in operative
    assert cfg.ppo.rollout_batch_size % cfg.ppo.mini_batch_size == 0


@pytest.mark.parametrize("name", POLICY_ONLY_RECIPES)
def test_model_recipes_build_once_the_policy_path_is_set(name):
    recipe = REPO / "recipes" / "models" / name
    with pytest.raises(ConfigError, match="model.name_or_path is required"):
        configurable.resolve(recipe, [])
    cfg, operative = configurable.resolve(recipe, ["model.name_or_path = '/models/policy'"])
    assert "ppo.kl_coef" in operative and cfg.ppo.rollout_batch_size % cfg.ppo.mini_batch_size == 0


def test_guide_parameters_are_bindable():
    cfg, _ = configurable.resolve(REPO / "recipes" / "tiny.gin", [
        "ppo.rollout_micro_batch_size = 8", "ppo.num_rollout_batches = 4", "ppo.kl_coef = 0.12",
        "ppo.clip_range = 0.12", "ppo.actor_learning_rate = 1.5e-4", "ppo.critic_learning_rate = 4e-4",
        "ppo.max_prompt_length = 16", "ppo.max_response_length = 5", "ppo.seed = 3"])
    p = cfg.ppo
    assert (p.rollout_micro_batch_size, p.num_rollout_batches, p.kl_coef, p.clip_range) == (8, 4, 0.12, 0.12)
    assert (p.actor_learning_rate, p.critic_learning_rate, p.max_prompt_length, p.max_response_length,
            p.seed) == (1.5e-4, 4e-4, 16, 5, 3)


@pytest.mark.parametrize("binding, expected", [
    ("ppo.kl_coef = -0.1", "ppo.kl_coef = -0.1 is invalid: must be a number in [0.0, 100.0]"),
    ("ppo.clip_range = 1.5", "ppo.clip_range = 1.5 is invalid"),
    ("ppo.kl_cof = 0.1", "did you mean ppo.kl_coef?"),
    ("ppx.kl_coef = 0.1", "'ppx' is not a known configurable"),
    ("ppo.kl_estimator = 'k9'", "must be one of 'k1', 'k2', 'k3'"),
    ("ppo.mini_batch_size = 48", "ppo.mini_batch_size = 48 is invalid: must divide the rollout buffer"),
    ("ppo.adv_estimator = 'grpo'", "ppo.samples_per_prompt = 1 is invalid: must be >= 2"),
    ("ppo.total_steps = 0", "ppo.total_steps = 0 is invalid: must be an integer >= 1"),
    ("task.reward_fn = 'nope'", "task.reward_fn = 'nope' is invalid: must be one of"),
    ("model.name_or_path = '/does/not/exist'", "not a local model directory"),
    ("ppo.kl_coef = ", "cannot parse binding"),
])
def test_bad_binding_exits_with_one_clear_line(tmp_path, binding, expected):
    start = time.time()
    proc = run_train(["recipes/tiny.gin", "-b", binding, "--out", tmp_path / "run"], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran
    assert time.time() - start < 60


def test_config_errors_raise_in_process():
    with pytest.raises(ConfigError, match="ppo.top_p"):
        PPOConfig(top_p=0.0)
    with pytest.raises(ConfigError, match="recipe 'missing.gin' does not exist"):
        configurable.resolve("missing.gin", [])


def test_host_threads_default_by_device(monkeypatch):
    """A one-process GPU run that sets no ppo.torch_threads gets GPU_TORCH_THREADS (its host threads
    launch kernels beside vLLM); a CPU run leaves the count to the pinned numerics; a binding wins."""
    from rlhf.config import GPU_TORCH_THREADS
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert PPOConfig().host_threads("cuda") == GPU_TORCH_THREADS == 4
    assert PPOConfig().host_threads("cpu") == 0
    assert PPOConfig(torch_threads=8).host_threads("cuda") == 8 and PPOConfig(torch_threads=3).host_threads("cpu") == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert PPOConfig().host_threads("cuda") == 2
