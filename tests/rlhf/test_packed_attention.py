"""The packed fast path on the CPU: attention by sequence over a packed row (rlhf/attention.py), the LM
head in chunks (rlhf/roles/forward.py), and the on-policy update that skips the old log-prob pass."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf import algos
from rlhf.attention import PACKED_SDPA, packed_kwargs, prepared_mask, use_packed_attention
from rlhf.packing import PackedBatch
from rlhf.roles.compiled import logprobs_and_entropy
from rlhf.roles.forward import chunked_head_logprobs, response_logprobs

CPU = torch.device("cpu")


def qwen2(seed=0, vocab=97):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        tie_word_embeddings=False))


def packed_row(lengths, vocab=97, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions


def test_packed_rows_attend_within_each_sequence_only():
    """A packed row under PACKED_SDPA gives each sequence the logits it has alone, with no mask."""
    lengths = (5, 9, 1, 7)
    model = use_packed_attention(qwen2()).eval()
    assert model.config._attn_implementation == PACKED_SDPA
    ids, positions = packed_row(lengths)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, **packed_kwargs(lengths, CPU)).logits
        start = 0
        for n in lengths:
            alone = model(input_ids=ids[:, start:start + n]).logits
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=0, atol=1e-5)
            start += n


def test_packed_attention_matches_transformers_block_mask_with_gradients():
    """The same loss and gradients as transformers' own sdpa over the row with its block-diagonal mask."""
    lengths = (6, 11, 4)
    ids, positions = packed_row(lengths)
    ours, theirs = use_packed_attention(qwen2()), qwen2()
    assert theirs.config._attn_implementation == "sdpa"
    losses = []
    for model, extra in ((ours, packed_kwargs(lengths, CPU)), (theirs, {})):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-5)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_attention_leaves_padded_forwards_and_saved_configs_as_they_were(tmp_path):
    model, plain = use_packed_attention(qwen2()).eval(), qwen2().eval()
    ids = torch.randint(3, 97, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           plain(input_ids=ids, attention_mask=mask).logits)  # bit for bit: transformers' sdpa
    model.save_pretrained(tmp_path / "a")
    plain.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == \
        json.loads((tmp_path / "b" / "config.json").read_text())


def test_a_packed_forward_skips_transformers_search_for_packed_sequences(monkeypatch):
    """Given no mask, transformers' mask preparation scans the position ids for packed sequences and
    branches on the result (on a GPU the host then waits for the queued kernels at every forward). A
    packed row through a model on PACKED_SDPA passes a prepared placeholder instead, which nothing
    reads: the logits are those of each sequence alone, for the causal LM and for the value model's
    backbone. A model on another attention gets no placeholder: transformers' search is what
    separates its sequences."""
    import transformers.masking_utils as masking_utils

    from rlhf.models import ValueModel

    searched = []
    real = masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices",
                        lambda position_ids: searched.append(1) or real(position_ids))
    lengths = (3, 8, 5)
    ids, positions = packed_row(lengths)
    assert prepared_mask(qwen2(), CPU) == {}
    model = use_packed_attention(qwen2()).eval()
    critic = use_packed_attention(ValueModel(copy.deepcopy(model.model), 32)).eval()
    with torch.no_grad():
        model(input_ids=ids, position_ids=positions, use_cache=False)  # no placeholder: transformers searches
        assert len(searched) == 1
        packed = model(input_ids=ids, position_ids=positions, use_cache=False, **packed_kwargs(lengths, CPU),
                       **prepared_mask(model, CPU)).logits
        values = critic(ids, position_ids=positions, **packed_kwargs(lengths, CPU), **prepared_mask(critic, CPU))
        assert len(searched) == 1
        start = 0
        for n in lengths:
            torch.testing.assert_close(packed[:, start:start + n], model(input_ids=ids[:, start:start + n]).logits,
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(values[:, start:start + n], critic(ids[:, start:start + n],
                                       torch.ones(1, n, dtype=torch.long)), rtol=0, atol=1e-5)
            start += n


def test_a_packed_row_of_the_wrong_length_is_refused():
    model = use_packed_attention(qwen2()).eval()
    ids, positions = packed_row((4, 4))
    with pytest.raises(ValueError, match="packed row"):
        model(input_ids=ids, position_ids=positions, **packed_kwargs((4, 5), CPU))


@pytest.mark.parametrize("with_entropy", [True, False])
def test_chunked_lm_head_equals_the_full_computation(with_entropy):
    """Log-probs, entropy and the gradients of hidden states and head weight, chunk by chunk (with
    checkpointed chunks) against the whole [B, K, V] at once; one chunk is the unchunked maths exactly."""
    torch.manual_seed(0)
    B, K, H, V = 3, 7, 16, 50
    hidden = torch.randn(B, K, H, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=False)
    tokens = torch.randint(0, V, (B, K))
    results = []
    for chunk in (4, 10_000):
        out = chunked_head_logprobs(hidden, head.weight, None, tokens, 0.7, with_entropy, False, chunk=chunk)
        out.sum().backward()
        results.append((out.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad, head.weight.grad = None, None
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logprobs, entropy = logprobs_and_entropy(F.linear(hidden, head.weight), tokens, 0.7, with_entropy)
    assert torch.equal(results[1][0][..., 0], logprobs)
    if with_entropy:
        assert torch.equal(results[1][0][..., 1], entropy)


def test_response_logprobs_equal_the_full_logits_path():
    """Padded and packed micro-batches through the chunked head against log-softmax over full logits."""
    from tests.rlhf.test_packing import uneven_batch
    model = use_packed_attention(qwen2(vocab=120)).eval()
    batch = uneven_batch(120)
    mask = batch["response_mask"].float()
    R = batch["response_ids"].shape[1]
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        logits = logits[:, -(R + 1):-1].float() / 0.7
        expected = algos.logprobs_from_logits(logits, batch["response_ids"])
        expected_entropy = algos.entropy_from_logits(logits)
        for micro in (batch, PackedBatch.of(batch)):
            lp, ent = response_logprobs(model, micro, CPU, temperature=0.7)
            torch.testing.assert_close(lp * mask, expected * mask, rtol=0, atol=2e-5)
            torch.testing.assert_close(ent * mask, expected_entropy * mask, rtol=0, atol=2e-5)


def test_model_head_is_restored_after_a_forward():
    model = use_packed_attention(qwen2()).eval()
    from tests.rlhf.test_packing import uneven_batch
    batch = uneven_batch(97)
    with torch.no_grad():
        response_logprobs(model, batch, CPU)
        logits = model(input_ids=batch["prompt_ids"]).logits
    assert logits.shape[-1] == 97  # the head gives logits again


def test_copies_of_a_packed_model_keep_the_implementation():
    model = copy.deepcopy(use_packed_attention(qwen2()))
    assert model.config._attn_implementation == PACKED_SDPA


ON_POLICY = ["ppo.total_steps = 3", "ppo.eval_every = 1000", "ppo.save_every = 1000", "task.eval_size = 16",
             "ppo.adv_estimator = 'grpo'", "ppo.samples_per_prompt = 4", "ppo.kl_mode = 'loss'",
             "ppo.rollout_micro_batch_size = 8", "ppo.num_rollout_batches = 1", "ppo.ppo_epochs = 1",
             "ppo.mini_batch_size = 32", "ppo.micro_batch_size = 8"]


def _run(tmp_path, name, bindings):
    from rlhf import configurable
    from rlhf.trainer import PPOTrainer
    cfg, _ = configurable.resolve("recipes/tiny.gin", bindings)
    trainer = PPOTrainer(cfg, tmp_path / name, log=lambda m: None)
    records = []
    for _ in range(cfg.ppo.total_steps):
        trainer.step += 1
        records.append(trainer.train_step())
    return cfg, trainer, records


@pytest.mark.parametrize("budget", [0, 96])
def test_on_policy_update_skips_the_old_logprob_pass_with_the_same_record(tmp_path, monkeypatch, budget):
    """GRPO with one epoch over one mini-batch (TRL's setting): the update's own log-probs stand in for
    the old ones. Every metric and both runs' weights agree with the run that computes the pass."""
    from rlhf.config import PPOConfig
    bindings = ON_POLICY + [f"ppo.max_tokens_per_micro_batch = {budget}"]
    cfg, skipping, skipped = _run(tmp_path, "skip", bindings)
    assert cfg.ppo.on_policy_update
    monkeypatch.setattr(PPOConfig, "on_policy_update", property(lambda self: False))
    _, computing, computed = _run(tmp_path, "pass", bindings)
    assert all("timing_s/old_logprobs" not in r for r in skipped)
    assert all("timing_s/old_logprobs" in r for r in computed)
    for a, b in zip(skipped, computed):
        a = {k: v for k, v in a.items() if not k.startswith(("timing_s/", "perf/"))}
        b = {k: v for k, v in b.items() if not k.startswith(("timing_s/", "perf/"))}
        assert list(a) == list(b)
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
            elif key == "policy_ratio_hist":  # ratios of 1, or within float rounding of it: the bins at 1.0
                counts_a, counts_b = a[key]["counts"], b[key]["counts"]
                assert sum(counts_a) == sum(counts_b) == counts_a[19] + counts_a[20] == counts_b[19] + counts_b[20]
            else:
                assert a[key] == b[key], key
    sa = skipping.actor.local_roles[0].model.state_dict()
    sb = computing.actor.local_roles[0].model.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-6)


def test_on_policy_update_is_decided_by_the_config():
    from rlhf.config import PPOConfig
    one = dict(rollout_micro_batch_size=8, num_rollout_batches=1, samples_per_prompt=4, mini_batch_size=32)
    assert PPOConfig(**one, kl_mode="loss").on_policy_update
    assert not PPOConfig(**one, kl_mode="reward", kl_coef=0.05).on_policy_update  # advantages need the KL
    assert PPOConfig(**one, kl_mode="reward", kl_coef=0.0).on_policy_update
    assert not PPOConfig(**one, kl_mode="loss", ppo_epochs=2).on_policy_update
    assert not PPOConfig(**{**one, "mini_batch_size": 16}, kl_mode="loss").on_policy_update
