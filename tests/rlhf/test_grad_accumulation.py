"""Micro-batch x gradient-accumulation equivalence for the actor and critic updates."""

import copy

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


def test_local_placement_spreads_uneven_rows_and_calls_as_declared(parts):
    """The local placement calls a role through the proxy its `@dispatch` declarations build, as
    the Ray placement does (rlhf/placement/proxy.py). Over three in-process ranks (one replica
    each), 7 rows do not split evenly: each rank's share is padded with copies of the last row,
    the padding's results are dropped, and what comes back equals the role's own undispatched
    call row for row; generation requests come back in request order, sampled as one process does."""
    from rlhf.placement.proxy import local_proxy
    from rlhf.roles.dispatch import spread
    from rlhf.rollout import SamplingParams

    tok, model = parts
    batch = make_batch(tok, n=7, seed=2)
    cfg = PPOConfig(rollout_micro_batch_size=8, num_rollout_batches=1, mini_batch_size=8, micro_batch_size=2,
                    forward_micro_batch_size=2, critic_learning_rate=1e-2)
    actors = [Actor(CPU, cfg, start_dir="", tokenizer_dir="", total_updates=1, model=copy.deepcopy(model),
                    tokenizer=tok) for _ in range(3)]
    value_model = ValueModel(copy.deepcopy(model).base_model, model.config.hidden_size).double()
    critics = [Critic(CPU, cfg, model_dir="", random_init=False, total_updates=1, model=copy.deepcopy(value_model))
               for _ in range(3)]
    actor, critic = local_proxy("actor", actors), local_proxy("critic", critics)

    shares = spread(actor.methods["compute_logprobs"], 3, (batch,), {}, "actor.compute_logprobs")
    assert [len(args[0]) for _, args, _ in shares.calls] == [3, 3, 3] and shares.padded and shares.size == 7
    assert shares.calls[2][1][0]["prompt_ids"][1:].tolist() == [batch["prompt_ids"][6].tolist()] * 2

    logprobs, entropy = actor.compute_logprobs(batch)
    want_logprobs, want_entropy = actors[0].compute_logprobs(batch)
    assert logprobs.shape == (7, batch["response_ids"].shape[1])
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-9, atol=1e-10)
    values = critic.compute_values(batch)
    assert values.shape == (7, batch["response_ids"].shape[1])
    torch.testing.assert_close(values, critics[0].compute_values(batch), rtol=1e-9, atol=1e-10)

    sampling = SamplingParams.from_ppo(PPOConfig(max_response_length=3, max_prompt_length=8))
    requests = [([tok(f"{i}+{i}=")["input_ids"]] * (1 + i % 2), 100 + i) for i in range(5)]
    got = local_proxy("actor", actors[:2]).generate(requests, sampling)
    want = actors[0].generate(requests, sampling)
    assert len(got) == 5
    for g, w in zip(got, want):
        assert torch.equal(g["response_ids"], w["response_ids"]) and torch.equal(g["prompt_ids"], w["prompt_ids"])


def test_mini_batches_walk_the_buffer_epoch_by_epoch_in_shuffled_order(parts):
    """`mini_batches` (rlhf/roles/minibatches.py): per epoch, the seeded shuffle cut into
    mini-batches, each cut into micro-batches in row order, with the mini-batch's token count
    (token_mean) or non-empty sequence count (seq_mean) as the loss normalizer."""
    from rlhf.placement.context import SingleRank
    from rlhf.roles.minibatches import mini_batches, minibatch_indices

    tok, _ = parts
    batch = make_batch(tok)
    batch["row"] = torch.arange(len(batch))
    for aggregation in ("token_mean", "seq_mean"):
        cfg = PPOConfig(rollout_micro_batch_size=16, num_rollout_batches=1, mini_batch_size=8, micro_batch_size=4,
                        ppo_epochs=2, loss_aggregation=aggregation)
        minis = list(mini_batches(batch, cfg, 5, torch.device("cpu"), SingleRank()))
        expected = minibatch_indices(16, 8, 5) + minibatch_indices(16, 8, 6)
        assert len(minis) == len(expected) == 4
        for mini, rows in zip(minis, expected):
            assert [len(m) for m in mini.micro_batches] == [4, 4]
            assert torch.cat([m["row"] for m in mini.micro_batches]).tolist() == rows.tolist()
            mask = batch["response_mask"][rows].float()
            count = mask.sum() if aggregation == "token_mean" else (mask.sum(-1) > 0).sum()
            assert mini.loss_normalizer == float(count)
