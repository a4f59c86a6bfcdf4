"""The response mask (rlhf/rollout/base.py `response_mask_from_ids`): EOS in, padding out, a response
cut at the limit kept whole; and the HF and vLLM backends, which both build their batch with
`response_batch`, give the same batch for the same tokens."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import TinyModelConfig
from rlhf.rollout import SamplingParams
from rlhf.rollout.base import response_batch, response_mask_from_ids
from rlhf.rollout.hf import HFRollout
from rlhf.rollout.vllm import batch_from_token_lists
from rlhf.tiny import build_char_tokenizer, build_tiny_model

EOS, PAD = 2, 0


@pytest.mark.parametrize("ids, lengths, mask, finished", [
    ([9, 8, EOS, PAD, PAD], None, [1, 1, 1, 0, 0], True),         # EOS included, padding after it excluded
    ([EOS, PAD, PAD, PAD, PAD], None, [1, 0, 0, 0, 0], True),     # an immediate EOS is a one-token response
    ([9, 8, 7, 6, 5], None, [1, 1, 1, 1, 1], False),               # cut at the limit: every token, not finished
    ([9, 8, 7, 6, EOS], None, [1, 1, 1, 1, 1], True),              # EOS as the last token the limit allows
    ([9, EOS, 7, EOS, 5], None, [1, 1, 0, 0, 0], True),            # only the first EOS ends the response
    ([9, 8, PAD, PAD, PAD], [2], [1, 1, 0, 0, 0], False),          # an engine's short return: its padding is out
    ([9, 8, EOS, PAD, EOS], [2], [1, 1, 0, 0, 0], False),          # an EOS past what was returned does not count
    ([PAD, PAD, PAD, PAD, PAD], [0], [0, 0, 0, 0, 0], False),      # nothing returned
])
def test_response_mask_from_ids(ids, lengths, mask, finished):
    got_mask, got_finished = response_mask_from_ids(torch.tensor([ids]), EOS,
                                                    None if lengths is None else torch.tensor(lengths))
    assert got_mask.tolist() == [mask] and got_finished.tolist() == [finished]


def test_the_batch_pads_what_the_mask_leaves_out():
    batch = response_batch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                           torch.tensor([[9, EOS, 7, 6]]), EOS, PAD)
    assert batch["response_ids"].tolist() == [[9, EOS, PAD, PAD]] and batch["response_mask"].tolist() == [[1, 1, 0, 0]]


@pytest.fixture(scope="module")
def hf_rollout(tmp_path_factory):
    """A real HF generate on a tiny random Llama whose final norm is zero: every token is equally
    likely, so in 40 tokens about half the responses meet an EOS and the others run to the limit."""
    tok = build_char_tokenizer(tmp_path_factory.mktemp("tok"))
    model = build_tiny_model(TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    return tok, HFRollout(model, tok, torch.device("cpu"))


def test_hf_and_vllm_give_the_same_batch_for_the_same_tokens(hf_rollout):
    """The HF backend's batch from a real generate; the same tokens as vLLM returns them (each
    response up to and including its EOS, or the limit's worth) through the vLLM backend's
    conversion: the same ids, mask and `finished`."""
    tok, rollout = hf_rollout
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=1.0, top_k=0, max_prompt_length=8,
                              truncation="left")
    hf = rollout.generate(["1+2=", "3+4=", "5+6=", "7+8=", "9+1=", "2+3=", "4+5=", "6+7="], sampling, seed=3)
    finished = hf["finished"].tolist()
    assert True in finished and False in finished, "the sample should hold both kinds of response"
    as_vllm = [ids[mask.bool()].tolist() for ids, mask in zip(hf["response_ids"], hf["response_mask"])]
    assert all(r[-1] == tok.eos_token_id for r, f in zip(as_vllm, finished) if f)
    vllm = batch_from_token_lists(hf["prompt_ids"], hf["prompt_mask"], as_vllm, sampling.max_new_tokens,
                                  tok.eos_token_id, tok.pad_token_id)
    for key in ("response_ids", "response_mask", "finished"):
        assert torch.equal(vllm[key], hf[key]), key
