"""The reward-model role on every placement: in this process and on Ray ranks (world size 1, and
2 with the model sharded by FSDP2 over gloo) its scores equal a direct
AutoModelForSequenceClassification forward at the last non-pad token; the reward phase pads an
uneven batch for the ranks and never lets evaluation move its running statistics."""

import pytest
import torch

from rlhf.chat import PromptRenderer
from rlhf.config import PPOConfig, RewardConfig, TaskConfig
from rlhf.placement.context import DeviceContext
from rlhf.roles import RoleSpec
from rlhf.roles.dispatch import ROWS, dispatched_methods
from rlhf.roles.reward import Reward
from rlhf.roles.reward_model import RewardModel
from tests.conftest import REPO
from tests.rlhf.test_reward_model import FINISHED, PROMPTS, RESPONSES, direct_scores, policy_batch, setup  # noqa: F401


def expected(root, tok, rm_tok, which):
    renderer = PromptRenderer(tok, "auto")
    if which == "same":
        seqs = [renderer.ids(p) + tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if f else [])
                for p, r, f in zip(PROMPTS, RESPONSES, FINISHED)]
    else:
        convos = [([{"role": "user", "content": p}] if isinstance(p, str) else p)
                  + [{"role": "assistant", "content": r}]
                  for p, r in zip(PROMPTS, RESPONSES)]
        seqs = [list(rm_tok.apply_chat_template(c, add_generation_prompt=False)["input_ids"]) for c in convos]
    return direct_scores(root / which, seqs)


def role_kwargs(root, which, micro_batch_size=2):
    return dict(reward=RewardConfig(kind="model", model_path=str(root / which), micro_batch_size=micro_batch_size),
                task=TaskConfig(), policy_tokenizer_dir=str(root / "policy_tok"))


def test_role_declares_rows_dispatch():
    assert dispatched_methods(RewardModel) == {"score": ROWS}
    assert dispatched_methods(Reward) == {}  # the reward phase runs in the controller


@pytest.mark.parametrize("which", ["same", "other"])
def test_in_process_role_scores_equal_direct_forward(setup, which):
    root, tok, rm_tok = setup
    role = RewardModel(DeviceContext(torch.device("cpu")), **role_kwargs(root, which), log=lambda m: None)
    reward = Reward(DeviceContext(torch.device("cpu")), TaskConfig(), role_kwargs(root, which)["reward"], role)
    batch = policy_batch(tok, PromptRenderer(tok, "auto"), "left")
    torch.testing.assert_close(reward.model_scores(batch), expected(root, tok, rm_tok, which), atol=1e-5, rtol=1e-5)
    out = reward.score(batch, update=False)
    assert out["correct"].tolist() == [True, True, False, False, True, False]


@pytest.fixture(scope="module")
def ray_cpu():
    ray = pytest.importorskip("ray")
    owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if owned:
        ray.shutdown()


@pytest.mark.parametrize("world_size", [1, 2])
def test_role_on_ray_ranks_scores_equal_direct_forward(setup, ray_cpu, world_size):
    from rlhf.placement import cluster
    from rlhf.placement.proxy import ray_proxy
    root, tok, rm_tok = setup
    ppo = PPOConfig(world_size=world_size, placement="colocated", cpus_per_rank=1.0, torch_threads=1,
                    mini_batch_size=32, micro_batch_size=16, device="cpu")
    pg = cluster.reserve(ppo, world_size, "cpu")
    hosts, _ = cluster.start_hosts(pg, list(range(world_size)), ppo, "cpu")
    try:
        for which in ("same", "other"):
            spec = RoleSpec("reward_model", "rlhf.roles.reward_model:RewardModel", role_kwargs(root, which))
            ray_cpu.get([h.add_role.remote(spec) for h in hosts])
            proxy = ray_proxy("reward_model", RewardModel, hosts)
            reward = Reward(DeviceContext(torch.device("cpu")), TaskConfig(), spec.kwargs["reward"], proxy)
            want = expected(root, tok, rm_tok, which)
            batch = policy_batch(tok, PromptRenderer(tok, "auto"), "right")
            torch.testing.assert_close(reward.model_scores(batch), want, atol=1e-5, rtol=1e-5)
            # an odd number of rows: padded to equal shares, the padding's scores dropped
            odd = batch.select(range(5))
            torch.testing.assert_close(reward.model_scores(odd), want[:5], atol=1e-5, rtol=1e-5)
    finally:
        for h in hosts:
            ray_cpu.get(h.shutdown.remote())
            ray_cpu.kill(h)
        ray_cpu.util.remove_placement_group(pg)


def test_bad_reward_model_is_one_line_before_any_rank_starts(setup, tmp_path):
    from rlhf import configurable
    from rlhf.errors import ConfigError
    from rlhf.placement import role_specs
    from tests.rlhf.test_reward_model import save_rm
    root, tok, _ = setup
    save_rm(tmp_path / "two", tok, num_labels=2)
    (tmp_path / "bad.jinja").write_text("{% for %}")
    cases = [([f"reward.model_path = '{tmp_path / 'two'}'"], "num_labels = 2"),
             ([f"reward.model_path = '{tmp_path / 'nowhere'}'"], "no config.json"),
             ([f"reward.model_path = '{root / 'same'}'", f"reward.chat_template = '{tmp_path / 'bad.jinja'}'"],
              "does not render")]
    for bindings, message in cases:
        cfg, _ = configurable.resolve(str(REPO / "recipes" / "tiny.gin"),
                                      ["reward.kind = 'model'", "ppo.world_size = 2", *bindings])
        with pytest.raises(ConfigError, match=message) as e:
            role_specs(cfg, model_dir=root, tokenizer_dir=root / "policy_tok", start_dir=root)
        assert "\n" not in str(e.value)
