"""The next rollout running ahead, during the critic's update (`ppo.overlap_rollout`): the pipelined
loop computes the numbers of the sequential one, and the switch says when it cannot apply."""

import threading

import pytest
import torch

from rlhf import configurable
from rlhf.errors import ConfigError
from rlhf.placement.proxy import local_proxy
from rlhf.roles.dispatch import ALL, CALLS, dispatch
from rlhf.trainer import PPOTrainer

VOLATILE = ("timing_s/", "perf/")
BINDINGS = ["ppo.total_steps = 4", "ppo.eval_every = 1000", "ppo.save_every = 1000", "task.eval_size = 16"]


def steps(trainer, n):
    records = []
    for _ in range(n):
        trainer.step += 1
        records.append(trainer.train_step())
    trainer.drain()
    return records


def build(tmp_path, name, overlap: bool):
    cfg, _ = configurable.resolve("recipes/tiny.gin", BINDINGS)
    trainer = PPOTrainer(cfg, tmp_path / name, log=lambda m: None)
    assert trainer.overlap is False  # 'auto' on a CPU: rollouts run in turn
    trainer.overlap = overlap  # what 'auto' resolves to on a GPU with vLLM: here the HF backend on the CPU
    return trainer


def test_rollouts_ahead_give_the_numbers_of_the_sequential_loop(tmp_path):
    sequential = build(tmp_path, "seq", overlap=False)
    seq = steps(sequential, 4)
    pipelined = build(tmp_path, "pipe", overlap=True)
    threads = []
    actor = pipelined.actor.local_roles[0]
    generate = actor.generate

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return generate(*args, **kwargs)

    actor.generate = spy
    pipe = steps(pipelined, 4)
    # Steps 2-4 were generated during the previous step's critic update, on the proxy's thread.
    assert ["timing_s/generate_ahead" in rec for rec in pipe] == [False, True, True, True]
    assert threads[0] == threading.current_thread().name and all(t.startswith("actor-calls") for t in threads[1:])
    assert len(threads) == 4  # no rollout ran past the last step
    for a, b in zip(seq, pipe):
        assert {k: v for k, v in a.items() if not k.startswith(VOLATILE)} == \
               {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
    for role in ("actor", "critic"):
        sa = getattr(sequential, role).local_roles[0].model.state_dict()
        sb = getattr(pipelined, role).local_roles[0].model.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert sequential.sampler.state_dict() == pipelined.sampler.state_dict()


def test_no_rollout_runs_ahead_of_an_evaluation_a_save_or_the_end(tmp_path):
    cfg, _ = configurable.resolve("recipes/tiny.gin", ["ppo.total_steps = 6", "ppo.eval_every = 3",
                                                       "ppo.save_every = 4", "task.eval_size = 16"])
    trainer = PPOTrainer(cfg, tmp_path / "run", log=lambda m: None)
    trainer.overlap = True
    ahead = []
    for step in range(1, 7):
        trainer.step = step
        ahead.append(trainer._may_run_ahead())
    assert ahead == [True, True, False, False, True, False]


def test_overlap_switch_is_checked_before_compute(tmp_path):
    with pytest.raises(ConfigError, match="ppo.overlap_rollout"):
        configurable.resolve("recipes/tiny.gin", ["ppo.overlap_rollout = True"])  # the HF backend
    with pytest.raises(ConfigError, match="ppo.overlap_rollout"):
        configurable.resolve("recipes/tiny.gin", ["ppo.overlap_rollout = 'yes'"])
    cfg, _ = configurable.resolve("recipes/tiny.gin", ["ppo.overlap_rollout = False"] + BINDINGS)
    assert PPOTrainer(cfg, tmp_path / "off", log=lambda m: None).overlap is False


class Echo:
    @dispatch(CALLS)
    def work(self, requests, scale):
        return [(threading.current_thread().name, r * scale) for r in requests]

    @dispatch(ALL)
    def fail(self):
        raise RuntimeError("boom")


def test_a_submitted_call_runs_on_the_proxys_thread_and_returns_what_the_call_returns():
    proxy = local_proxy("echo", [Echo()])
    direct = proxy.work([1, 2, 3], 10)
    pending = proxy.submit("work", [1, 2, 3], 10)
    ahead = pending.result()
    assert [v for _, v in ahead] == [v for _, v in direct] == [10, 20, 30]
    assert direct[0][0] == threading.current_thread().name and ahead[0][0].startswith("echo-calls")
    with pytest.raises(RuntimeError, match="boom"):  # the call's exception reaches the caller
        proxy.submit("fail").result()
