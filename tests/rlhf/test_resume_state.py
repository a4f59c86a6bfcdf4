"""`checkpoint.restore_training` against what `save_checkpoint` saved: the weights, each optimizer's
state, each LR schedule's position, and the torch, numpy and Python generators (the next numbers
drawn after a resume are the ones drawn after the save)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from rlhf import checkpoint
from rlhf.batch import Batch
from rlhf.config import PPOConfig, TinyModelConfig
from rlhf.models import ValueModel
from rlhf.placement.context import DeviceContext
from rlhf.roles.actor import Actor
from rlhf.roles.critic import Critic
from rlhf.tiny import build_char_tokenizer, build_tiny_model

CPU = DeviceContext(torch.device("cpu"))
N, P, R = 4, 3, 3
CFG = PPOConfig(rollout_micro_batch_size=N, num_rollout_batches=1, mini_batch_size=2, micro_batch_size=2,
                actor_learning_rate=1e-3, critic_learning_rate=1e-3, lr_warmup_steps=3, lr_schedule="linear")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def roles(tok) -> tuple[Actor, Critic]:
    shape = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    actor = Actor(CPU, CFG, start_dir="", tokenizer_dir="", total_updates=8, model=build_tiny_model(shape, tok, 0),
                  tokenizer=tok)
    value = ValueModel(build_tiny_model(shape, tok, 1).base_model, shape.hidden_size)
    return actor, Critic(CPU, CFG, model_dir="", random_init=False, total_updates=8, model=value)


def rollout(tok, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(N, R, dtype=torch.long)
    return Batch({"prompt_ids": torch.randint(4, len(tok), (N, P), generator=g),
                  "prompt_mask": torch.ones(N, P, dtype=torch.long),
                  "response_ids": torch.randint(4, len(tok), (N, R), generator=g), "response_mask": mask,
                  "old_logprobs": -torch.rand(N, R, generator=g) - 3, "advantages": torch.randn(N, R, generator=g),
                  "values": torch.randn(N, R, generator=g), "returns": torch.randn(N, R, generator=g)})


def train(actor: Actor, critic: Critic, batch: Batch) -> None:
    actor.update(batch, shuffle_seed=1, kl_coef=0.0)
    critic.update(batch, shuffle_seed=2)


def draws() -> tuple:
    return torch.rand(4).tolist(), np.random.rand(4).tolist(), np.random.normal(), [random.random() for _ in range(4)]


def assert_same(a, b, where="") -> None:
    if isinstance(a, np.ndarray):
        a, b = torch.from_numpy(a.astype(np.int64)), torch.from_numpy(np.asarray(b).astype(np.int64))
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_restore_training_brings_back_weights_optimizers_schedules_and_generators(tok, tmp_path):
    actor, critic = roles(tok)
    train(actor, critic, rollout(tok, 0))  # optimizer moments exist; the schedules are mid-warmup
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    np.random.normal()  # numpy's cached Gaussian is part of its state
    # Copies: the roles' state dicts share storage with the tensors that training goes on to change.
    saved = {name: {"weights": copy.deepcopy(role.model_state()), "optimizer": copy.deepcopy(role.optimizer_state()),
                    "scheduler": {k: v for k, v in role.scheduler_state().items() if k != "lr_lambdas"}}
             for name, role in (("actor", actor), ("critic", critic))}
    rng = (torch.get_rng_state(), np.random.get_state(legacy=True), random.getstate())
    ckpt = checkpoint.save_checkpoint(tmp_path / "checkpoints", 1, actor=actor, critic=critic, tokenizer=tok,
                                      trainer_state={"sampler": {"position": 5}}, keep=0)
    after_save = draws()
    train(actor, critic, rollout(tok, 1))  # the run goes on past the checkpoint, then dies

    fresh_actor, fresh_critic = roles(tok)  # a new process: fresh weights, optimizers, seeded generators
    assert checkpoint.restore_training(ckpt, actor=fresh_actor, critic=fresh_critic) == {"sampler": {"position": 5}}
    assert_same(torch.get_rng_state(), rng[0], "torch")
    assert_same(list(np.random.get_state(legacy=True)), list(rng[1]), "numpy")
    assert_same(random.getstate(), rng[2], "python")
    for name, role in (("actor", fresh_actor), ("critic", fresh_critic)):
        assert_same(role.model_state(), saved[name]["weights"], f"{name} weights")
        optimizer = role.optimizer_state()
        assert optimizer["state"], f"{name}: no optimizer moments restored"
        assert_same(optimizer, saved[name]["optimizer"], f"{name} optimizer")
        scheduler = {k: v for k, v in role.scheduler_state().items() if k != "lr_lambdas"}
        assert scheduler["last_epoch"] == 2, name  # two mini-batches stepped it
        assert_same(scheduler, saved[name]["scheduler"], f"{name} scheduler")
    assert draws() == after_save
