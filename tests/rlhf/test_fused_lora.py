"""LoRA adapters added by one matmul into their base layer's output (rlhf/roles/compiled.py
`fuse_lora`, every LoRA run on a GPU): the same outputs and gradients as peft's own forward, the
adapter switched off and on as peft switches it."""

import copy

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.models import add_lora
from rlhf.roles.compiled import fuse_lora


def peft_and_fused(seed: int, hidden: int, layers: int, b_std: float):
    """A tiny Qwen2 with peft LoRA adapters (B drawn, not peft's zeros) and its copy with `fuse_lora`."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    peft_model = add_lora(Qwen2ForCausalLM(config), 8, 16.0, 0.0, "all-linear")
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the adapters something to add
            torch.nn.init.normal_(p, std=b_std)
    fused = copy.deepcopy(peft_model)
    return peft_model, fused, fuse_lora(fused)


def test_fused_adapters_compute_what_peft_computes():
    peft_model, fused, count = peft_and_fused(0, 32, 2, 1.0)
    assert count == 2 * 7  # every adapted projection of both blocks
    ids = torch.randint(0, 64, (2, 10))
    a, b = peft_model(ids).logits, fused(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    a.square().sum().backward()
    b.square().sum().backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert set(grads) == set(fused_grads) and len(grads) == 2 * 2 * 7  # A and B of each adapter
    for name in grads:
        torch.testing.assert_close(grads[name], fused_grads[name], rtol=1e-5, atol=1e-6)
    with peft_model.disable_adapter(), fused.disable_adapter():  # the reference pass: the base alone
        off_a, off_b = peft_model(ids).logits, fused(ids).logits
    torch.testing.assert_close(off_a, off_b, rtol=0, atol=0)
    assert (off_b - b).abs().max() > 1e-3  # the adapters did add something


def test_fused_adapters_under_bf16_autocast_stay_within_bf16_rounding():
    peft_model, fused, _ = peft_and_fused(1, 64, 1, 0.1)
    ids = torch.randint(0, 64, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = peft_model(ids).logits.float(), fused(ids).logits.float()
    exact = peft_model(ids).logits
    assert (b - exact).abs().max() <= 2 * (a - exact).abs().max() + 1e-2  # one rounding, not three
