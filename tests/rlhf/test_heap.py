"""The run's long-lived heap leaves the garbage collector's passes after the first iteration
(rlhf/heap.py), in every process holding a role, and returns to them when the run ends."""

import gc
import weakref

import pytest

from rlhf import configurable, heap
from rlhf.metrics import MetricLogger
from rlhf.trainer import PPOTrainer


class Cycle:
    def __init__(self):
        self.me = self


def test_freeze_collects_the_garbage_first_then_freezes_what_lives():
    garbage, kept = Cycle(), Cycle()
    gone = weakref.ref(garbage)
    del garbage
    try:
        assert heap.freeze() > 0
        assert gone() is None  # a cycle nobody holds was collected, not frozen
        assert not any(o is kept for o in gc.get_objects())  # frozen: out of every generation the passes walk
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_frozen_once_others_once_and_unfrozen_on_leaving_even_on_an_error():
    calls = []
    with pytest.raises(RuntimeError):
        with heap.FrozenAfterFirst(lambda: calls.append("ranks")) as long_lived:
            for _ in range(3):
                long_lived.settle()
                assert gc.get_freeze_count() > 0
            raise RuntimeError("a step failed")
    assert calls == ["ranks"]
    assert gc.get_freeze_count() == 0


def test_a_run_freezes_after_its_first_iteration_only(tmp_path, monkeypatch):
    cfg, _ = configurable.resolve("recipes/tiny.gin", ["ppo.total_steps = 3", "ppo.eval_every = 1000",
                                                       "ppo.save_every = 1000", "task.eval_size = 8"])
    trainer = PPOTrainer(cfg, tmp_path / "run", log=lambda m: None)
    at = []
    freeze = heap.freeze
    monkeypatch.setattr(heap, "freeze", lambda: at.append(trainer.step) or freeze())
    trainer.roles.freeze_heap = lambda: at.append("ranks")
    summary = trainer.run(MetricLogger([]))
    assert summary["steps"] == 3
    assert at == [1, "ranks"]
    assert gc.get_freeze_count() == 0
