"""What a rank's host returns through Ray is on the host (rlhf/placement/host.py `to_host`): Ray
rebuilds a CUDA tensor on the receiver's GPU, and the controller of a Ray run holds no device.
A one-rank optimizer state was such a result: each checkpoint gave the controller a CUDA context
and the moments' bytes on the GPU the ranks plan for (4.2 GiB at the 0.5B shape, an H100)."""

import collections

import pytest
import torch

from rlhf.batch import Batch
from rlhf.placement.host import RankHost, to_host

Pair = collections.namedtuple("Pair", "logprobs entropy")


def nested(t):
    return {"state": {0: {"exp_avg": t, "step": 3}}, "param_groups": [{"lr": 1e-6, "params": [0]}],
            "parts": [Batch({"ids": t}, {"prompt": ["a", "b"]})], "pair": Pair(t, None), "both": (t, "x")}


def test_host_tensors_come_back_as_they_are_in_every_container_a_role_returns():
    t = torch.arange(2.0)
    out = to_host(nested(t))
    assert out["state"][0]["exp_avg"] is t and out["state"][0]["step"] == 3
    assert out["param_groups"] == [{"lr": 1e-6, "params": [0]}]
    part = out["parts"][0]
    assert isinstance(part, Batch) and part["ids"] is t and part["prompt"] == ["a", "b"]
    assert isinstance(out["pair"], Pair) and out["pair"].logprobs is t and out["pair"].entropy is None
    assert out["both"][0] is t and out["both"][1] == "x"


@pytest.mark.parametrize("where", ["state", "parts", "pair", "both"])
def test_a_tensor_off_the_host_is_copied_to_it_wherever_it_sits(where):
    """The meta device is the one a CPU machine has besides the host: its tensors hold no data, so
    the copy being asked for is what shows (torch refuses it); on a GPU the copy is made."""
    t = torch.empty(2, device="meta")
    value = nested(torch.zeros(2))
    value[where] = nested(t)[where]
    with pytest.raises(NotImplementedError, match="meta"):
        to_host(value)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_one_rank_optimizer_state_leaves_the_rank_on_the_host(tmp_path, device):
    from rlhf.config import PPOConfig, TinyModelConfig
    from rlhf.roles import RoleSpec
    from rlhf.tiny import build_char_tokenizer, build_tiny_model

    build_tiny_model(TinyModelConfig(), build_char_tokenizer(tmp_path), seed=0).save_pretrained(str(tmp_path))
    host = RankHost(0, 1, device, 4, bf16=False)
    ppo = PPOConfig(device=device)
    host.add_role(RoleSpec("critic", "rlhf.roles.critic:Critic",
                           dict(ppo=ppo, model_dir=str(tmp_path), random_init=False, total_updates=1)))
    critic = host.roles["critic"]
    sum(p.float().square().sum() for p in critic.model.parameters() if p.requires_grad).backward()
    critic.optimizer.step()  # the moments, where the parameters are
    state = host.call("critic", "optimizer_state")
    tensors = [t for s in state["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    host.shutdown()
