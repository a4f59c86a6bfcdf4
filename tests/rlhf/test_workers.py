"""Micro-batch x gradient-accumulation equivalence for the actor and critic updates."""

import copy
import dataclasses

import pytest
import torch

from rlhf.batch import Batch
from rlhf.config import PPOConfig, TinyModelConfig
from rlhf.models import ValueModel
from rlhf.placement.context import DeviceContext
from rlhf.roles.actor import Actor
from rlhf.roles.critic import Critic
from rlhf.tiny import build_char_tokenizer, build_tiny_model

CPU = DeviceContext(torch.device("cpu"))


def make_batch(tok, n=16, P=5, R=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, len(tok), (n, P), generator=g)
    prompt_mask = torch.ones(n, P, dtype=torch.long)
    for i in range(0, n, 3):  # some left padding
        prompt_mask[i, :2] = 0
        prompt_ids[i, :2] = tok.pad_token_id
    response_ids = torch.randint(4, len(tok), (n, R), generator=g)
    lengths = torch.randint(1, R + 1, (n,), generator=g)
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask,
                  "old_logprobs": -torch.rand(n, R, generator=g) * 3,
                  "advantages": torch.randn(n, R, generator=g) * response_mask,
                  "ref_logprobs": -torch.rand(n, R, generator=g) * 3,
                  "values": torch.randn(n, R, generator=g) * response_mask,
                  "returns": torch.randn(n, R, generator=g) * response_mask})


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    tok = build_char_tokenizer(tmp_path_factory.mktemp("tok"))
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                             tok, seed=0).double()
    return tok, model


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("kl_mode", ["reward", "loss"])
def test_actor_micro_batches_equal_one_batch(parts, aggregation, kl_mode):
    tok, model = parts
    batch = make_batch(tok)
    results = []
    for micro in (8, 4, 2):
        cfg = PPOConfig(rollout_micro_batch_size=16, num_rollout_batches=1, mini_batch_size=8, micro_batch_size=micro,
                        ppo_epochs=2, actor_learning_rate=1e-2, loss_aggregation=aggregation, kl_mode=kl_mode,
                        entropy_coef=0.01, max_grad_norm=0.5)
        worker = Actor(CPU, cfg, start_dir="", tokenizer_dir="", total_updates=4, model=copy.deepcopy(model),
                       tokenizer=tok)
        stats = worker.update(batch, shuffle_seed=3, kl_coef=0.1)
        results.append((torch.cat([p.detach().flatten() for p in worker.model.parameters()]), stats))
    base_params, base_stats = results[0]
    for params, stats in results[1:]:
        torch.testing.assert_close(params, base_params, rtol=1e-9, atol=1e-10)
        assert stats["policy_ratio_hist"] == base_stats["policy_ratio_hist"]
        for key in ("actor/pg_loss", "actor/clip_fraction", "actor/entropy", "actor/grad_norm"):
            assert stats[key] == pytest.approx(base_stats[key], rel=1e-6, abs=1e-9), key  # stats are float32
    # The update did something.
    assert not torch.equal(base_params, torch.cat([p.detach().flatten() for p in model.parameters()]))


def test_critic_micro_batches_equal_one_batch(parts):
    tok, model = parts
    batch = make_batch(tok, seed=1)
    results = []
    for micro in (8, 2):
        cfg = PPOConfig(rollout_micro_batch_size=16, num_rollout_batches=1, mini_batch_size=8, micro_batch_size=micro,
                        critic_learning_rate=1e-2)
        critic = ValueModel(copy.deepcopy(model).base_model, model.config.hidden_size).double()
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.value_head.weight)
        torch.nn.init.zeros_(critic.value_head.bias)
        worker = Critic(CPU, cfg, model_dir="", random_init=False, total_updates=2, model=critic)
        stats = worker.update(batch, shuffle_seed=5)
        results.append((torch.cat([p.detach().flatten() for p in worker.model.parameters()]), stats))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-9, atol=1e-10)
    assert results[1][1]["critic/value_loss"] == pytest.approx(results[0][1]["critic/value_loss"], rel=1e-6)
