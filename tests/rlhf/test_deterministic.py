"""`ppo.deterministic` (rlhf/determinism.py `deterministic_backward`): the updates' backward
passes under strict deterministic algorithms on a GPU, the process's warn-only setting restored
after, and an op with no deterministic kernel stopped with one line naming it and the binding.
The GPU half (flash attention's backward, bit for bit) is tests/rlhf/test_packed_attention_gpu.py."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import PPOConfig
from rlhf.determinism import deterministic_backward
from rlhf.errors import ConfigError


@pytest.fixture
def warn_only_mode():
    """The engine's process-wide setting (rlhf.determinism.deterministic_algorithms), undone after."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _put() -> None:
    """An op with no deterministic kernel on any device (torch raises for it in strict mode)."""
    torch.zeros(4).put_(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]), accumulate=False)


def test_strict_inside_and_the_warn_only_setting_restored_after(warn_only_mode):
    with deterministic_backward(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    with pytest.raises(ZeroDivisionError), deterministic_backward(True):
        raise ZeroDivisionError  # any error: the setting still comes back
    assert torch.is_deterministic_algorithms_warn_only_enabled()


def test_off_leaves_the_process_setting_alone(warn_only_mode):
    with deterministic_backward(False):
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        with pytest.warns(UserWarning, match="put_ does not have a deterministic implementation"):
            _put()


def test_an_op_without_a_deterministic_kernel_is_one_line_naming_it_and_the_binding(warn_only_mode):
    with pytest.raises(ConfigError) as caught, deterministic_backward(True):
        _put()
    line = str(caught.value)
    assert "\n" not in line and line.startswith("ppo.deterministic = True: put_ has no deterministic kernel")
    assert "set ppo.deterministic = False" in line
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    with pytest.raises(RuntimeError, match="boom"), deterministic_backward(True):  # other errors pass through
        raise RuntimeError("boom")


def test_a_backward_under_it_gives_the_same_gradients():
    """On the CPU strict mode changes nothing the engine computes: the same gradients bit for bit."""
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50))
    tokens = torch.randint(0, 50, (4, 12))
    grads = []
    for strict in (False, True):
        layer.zero_grad(set_to_none=True)
        loss = torch.log_softmax(layer(tokens), -1).gather(-1, tokens.unsqueeze(-1)).sum()
        with deterministic_backward(strict):
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in layer.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_the_binding_is_on_by_default_and_must_be_a_bool():
    assert PPOConfig().deterministic is True
    assert PPOConfig(deterministic=False).deterministic is False
    with pytest.raises(ConfigError, match="ppo.deterministic"):
        PPOConfig(deterministic="yes")  # pyright: ignore[reportArgumentType]
