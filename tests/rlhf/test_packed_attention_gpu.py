"""The packed fast path on a GPU (skipped without one): torch's variable-length flash attention over
a packed row gives the padded forward's log-probs and gradients in bf16, within bf16's rounding."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_varlen_packed_row_matches_padded_rows_forward_and_backward():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.attention import _varlen, can_use_varlen, use_packed_attention
    from rlhf.packing import PackedBatch
    from rlhf.roles.forward import response_logprobs
    from tests.rlhf.test_packing import uneven_batch

    assert _varlen() is not None, "torch.nn.attention.varlen is missing from this torch"
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = use_packed_attention(Qwen2ForCausalLM(Qwen2Config(
        vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False))).to(device)
    assert can_use_varlen(torch.zeros(1, 8, 4, 32, device=device, dtype=torch.bfloat16))
    batch = uneven_batch(300)
    mask = batch["response_mask"].float().to(device)
    results = []
    for micro in (batch, PackedBatch.of(batch)):
        model.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(model, micro, device, temperature=0.7, autocast_dtype=torch.bfloat16)
        ((lp * mask).sum() + (ent * mask).sum()).backward()
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        results.append((lp * mask, ent * mask, grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=0.05)
    torch.testing.assert_close(ent_b, ent_a, rtol=0, atol=0.05)
    assert torch.nn.functional.cosine_similarity(g_a, g_b, dim=0) > 0.999


def _attention_gradients(strict: bool, repeats: int = 4) -> list:
    """The query/key/value gradients of the packed flash kernel at the Qwen2.5-7B attention shape (28
    query heads, 4 key/value heads, head dim 128) over uneven sequences, `repeats` times."""
    from rlhf.attention import varlen_attention
    from rlhf.determinism import deterministic_backward

    device = torch.device("cuda")
    lengths = [700, 512, 1024, 300, 768]
    total = sum(lengths)
    cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 28, total, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 4, total, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    grad_out = torch.randn(1, total, 28, 128, device=device, dtype=torch.bfloat16, generator=gen)
    grads = []
    for _ in range(repeats):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, cu, max(lengths), None)
        with deterministic_backward(strict):
            out.backward(grad_out)
        grads.append(torch.cat([t.grad.flatten() for t in leaves]))
    return grads


def test_deterministic_backward_makes_flash_attention_gradients_repeat_bit_for_bit():
    """`ppo.deterministic` (the default): flash attention's backward without atomic adds, so the same
    inputs give the same gradient bytes every time. Under the engine's warn-only mode alone (False)
    torch keeps the atomic kernel; how far its repeats drift is in bench/results/determinism_h200.md."""
    torch.use_deterministic_algorithms(True, warn_only=True)  # what every engine process sets
    first, *rest = _attention_gradients(strict=True)
    assert all(torch.equal(first, g) for g in rest)


def test_merged_lora_in_compiled_layers_matches_peft_forward_and_backward():
    """The 7B recipe's LoRA path on a GPU: a bf16 base with fp32 adapters, `fuse_lora`'s merged weight
    inside compiled decoder layers, bf16 autocast, strict deterministic backward. Its log-probs, with
    and without gradients, and the adapters' gradients are peft's own (eager, fp32 model) within
    bf16's rounding, and a second backward gives the same bits."""
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.attention import use_packed_attention
    from rlhf.determinism import deterministic_backward
    from rlhf.models import add_lora
    from rlhf.packing import PackedBatch
    from rlhf.roles.compiled import compile_layers, fuse_lora
    from rlhf.roles.forward import response_logprobs
    from tests.rlhf.test_packing import uneven_batch

    device = torch.device("cuda")
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                        tie_word_embeddings=False))
    reference = use_packed_attention(add_lora(copy.deepcopy(base), 16, 32.0, 0.0, "all-linear")).to(device)
    for name, p in reference.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    fused = use_packed_attention(add_lora(base.to(torch.bfloat16), 16, 32.0, 0.0, "all-linear")).to(device)
    fused.load_state_dict({k: v.to(torch.bfloat16) if "lora_" not in k else v
                           for k, v in reference.state_dict().items()})
    assert fuse_lora(fused) == 3 * 7 and compile_layers(fused) == 3
    batch = PackedBatch.of(uneven_batch(300))
    mask = batch["response_mask"].float().to(device)

    def run(model, autocast):
        model.zero_grad(set_to_none=True)
        logp, _ = response_logprobs(model, batch, device, autocast_dtype=autocast, fused=autocast is not None)
        with deterministic_backward(True):
            (logp * mask).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp.detach().float(), grads

    want, want_grads = run(reference, None)
    got, got_grads = run(fused, torch.bfloat16)
    again, again_grads = run(fused, torch.bfloat16)
    with torch.no_grad():
        no_grad, _ = response_logprobs(fused, batch, device, autocast_dtype=torch.bfloat16, fused=True)
    assert (got - want).mul(mask).abs().max() < 0.1  # log-probs of a 300-token vocabulary, bf16 layers
    assert (no_grad.float() - got).mul(mask).abs().max() < 0.05
    assert set(got_grads) == set(want_grads) and len(got_grads) == 2 * 3 * 7
    for name, grad in got_grads.items():
        cos = torch.nn.functional.cosine_similarity(grad.flatten(), want_grads[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))
        assert torch.equal(grad, again_grads[name]), name
    assert torch.equal(got, again)


def test_a_micro_batch_s_inputs_reach_the_gpu_without_the_host_waiting():
    """`to_device` (every packed micro-batch's inputs and loss tensors): with the GPU busy, copying a
    micro-batch's host tensors returns at once, where a pageable copy waits for the queued work; the
    values arrive intact."""
    import time

    from rlhf.batch import to_device
    from rlhf.packing import PackedBatch
    from tests.rlhf.test_packing import uneven_batch

    device = torch.device("cuda")
    batch = PackedBatch.of(uneven_batch(300))
    torch.cuda.synchronize()

    def host_seconds(copy):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU work queued ahead of the copies
        start = time.perf_counter()
        out = copy()
        waited = time.perf_counter() - start
        torch.cuda.synchronize()
        return waited, out

    waited, row = host_seconds(lambda: batch.row(device))
    assert waited < 0.2, waited
    assert torch.equal(row.input_ids.cpu(), torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)[
        torch.cat([batch["prompt_mask"], batch["response_mask"]], 1).bool()][None])
    waited, advantages = host_seconds(lambda: to_device(batch["advantages"], device))
    assert waited < 0.2 and torch.equal(advantages.cpu(), batch["advantages"])
    blocked, _ = host_seconds(lambda: batch["advantages"].to(device))  # what a pageable copy costs
    assert blocked > 0.2


def test_a_packed_micro_batch_makes_the_host_wait_nowhere():
    """An update's micro-batch on a packed row, the policy's and the value model's forward and backward,
    queues its work without reading anything back: torch's sync debug mode reports no host wait
    (`rlhf.profiling.sync_sites`; transformers' search for packed sequences was one per forward)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf.attention import use_packed_attention
    from rlhf.batch import to_device
    from rlhf.models import ValueModel
    from rlhf.packing import PackedBatch
    from rlhf.profiling import phase_range, sync_sites
    from rlhf.roles.forward import response_logprobs, response_values
    from tests.rlhf.test_packing import uneven_batch

    device = torch.device("cuda")
    torch.manual_seed(0)
    def config():
        return Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=False)

    policy = use_packed_attention(Qwen2ForCausalLM(config())).to(device)
    critic = use_packed_attention(ValueModel(Qwen2ForCausalLM(config()).model, 128)).to(device)
    micro = PackedBatch.of(uneven_batch(300))

    def step():
        mask = to_device(micro.tensors["response_mask"], device).float()
        logprobs, entropy = response_logprobs(policy, micro, device, temperature=0.7, autocast_dtype=torch.bfloat16)
        ((logprobs * mask).sum() - (entropy * mask).sum()).backward()
        values = response_values(critic, micro, device, autocast_dtype=torch.bfloat16)
        (values * mask).square().sum().backward()

    step()  # the first builds the row on the device and warms the kernels up
    torch.cuda.synchronize()
    with sync_sites() as counts, phase_range("update"):
        for _ in range(2):
            step()
    assert counts == {}
