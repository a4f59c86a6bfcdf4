"""LoRA adapters computed by `fuse_lora` (rlhf/roles/compiled.py, every LoRA run on a GPU), in each of
its modes (the merged weight, or one addmm into the base layer's output): the same outputs and
gradients as peft's own forward, the adapter switched off and on as peft switches it."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhf.models import add_lora
from rlhf.roles.compiled import LORA_FORWARDS, fuse_lora


def peft_and_fused(seed: int, hidden: int, layers: int, b_std: float, mode: str = "merged", dropout: float = 0.0):
    """A tiny Qwen2 with peft LoRA adapters (B drawn, not peft's zeros) and its copy with `fuse_lora`."""
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    peft_model = add_lora(Qwen2ForCausalLM(config), 8, 16.0, dropout, "all-linear")
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: give the adapters something to add
            torch.nn.init.normal_(p, std=b_std)
    fused = copy.deepcopy(peft_model)
    return peft_model, fused, fuse_lora(fused, mode)


@pytest.mark.parametrize("mode", LORA_FORWARDS)
def test_fused_adapters_compute_what_peft_computes(mode):
    peft_model, fused, count = peft_and_fused(0, 32, 2, 1.0, mode)
    assert count == 2 * 7  # every adapted projection of both blocks
    ids = torch.randint(0, 64, (2, 10))
    a, b = peft_model(ids).logits, fused(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    a.square().sum().backward()
    b.square().sum().backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert set(grads) == set(fused_grads) and len(grads) == 2 * 2 * 7  # A and B of each adapter
    for name in grads:  # fp32 roundings in another order: the merged weight sums W and s B A first
        scale = float(grads[name].abs().max())
        torch.testing.assert_close(grads[name], fused_grads[name], rtol=1e-5, atol=3e-5 * scale)
    with peft_model.disable_adapter(), fused.disable_adapter():  # the reference pass: the base alone
        off_a, off_b = peft_model(ids).logits, fused(ids).logits
    torch.testing.assert_close(off_a, off_b, rtol=0, atol=0)
    assert (off_b - b).abs().max() > 1e-3  # the adapters did add something
    with torch.no_grad():  # the forward-only passes (old log-probs, values) compute the same
        torch.testing.assert_close(fused(ids).logits, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", LORA_FORWARDS)
def test_fused_adapters_under_bf16_autocast_stay_within_bf16_rounding(mode):
    peft_model, fused, _ = peft_and_fused(1, 64, 1, 0.1, mode)
    ids = torch.randint(0, 64, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = peft_model(ids).logits.float(), fused(ids).logits.float()
    exact = peft_model(ids).logits
    assert (b - exact).abs().max() <= 2 * (a - exact).abs().max() + 1e-2  # one rounding, not three


def test_merged_adapters_with_dropout_run_peft_s_own_forward():
    """Dropout drops the adapter's input, not the base layer's: no merged weight computes that, so
    a layer with dropout runs peft's forward (the same dropout masks from the same generator)."""
    peft_model, fused, _ = peft_and_fused(2, 32, 1, 1.0, "merged", dropout=0.5)
    peft_model.train(), fused.train()
    ids = torch.randint(0, 64, (2, 10))
    torch.manual_seed(3)
    a = peft_model(ids).logits
    torch.manual_seed(3)
    b = fused(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="one of"):
        fuse_lora(torch.nn.Linear(2, 2), "fast")


def test_a_merged_layer_whose_base_trains_runs_peft_s_own_forward():
    """The merged weight's backward gives the adapter's gradients only: a base layer that trains (peft's
    `modules_to_save`-style unfreezing by hand) keeps its gradient through peft's forward."""
    peft_model, fused, _ = peft_and_fused(4, 32, 1, 1.0, "merged")
    for model in (peft_model, fused):
        model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.requires_grad_(True)
    ids = torch.randint(0, 64, (2, 10))
    peft_model(ids).logits.square().sum().backward()
    fused(ids).logits.square().sum().backward()
    name = "base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"
    want, got = dict(peft_model.named_parameters())[name].grad, dict(fused.named_parameters())[name].grad
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-5 * float(want.abs().max()))


def _graphs_for_a_step(layers: int, monkeypatch) -> int:
    """Graphs Dynamo builds for the actor's layers, set up as a LoRA run on a GPU sets them up
    (`TrainedRole`: checkpointing, packed attention, `fuse_lora`, `compile_layers`), over what a step
    runs: forward-only micro-batches and update micro-batches, each at two token counts."""
    import functools

    from rlhf.attention import packed_kwargs, use_packed_attention
    from rlhf.models import enable_gradient_checkpointing
    from rlhf.roles.compiled import compile_layers
    # Dynamo's graphs and guards are what is counted; the eager backend spares the CPU inductor's builds.
    monkeypatch.setattr(torch.nn.Module, "compile", functools.partialmethod(torch.nn.Module.compile, backend="eager"))
    torch._dynamo.reset()
    _, model, _ = peft_and_fused(5, 32, layers, 0.1)
    enable_gradient_checkpointing(model)
    model = use_packed_attention(model)
    fuse_lora(model)  # a second call leaves the layers as they are
    assert compile_layers(model) == layers
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for grad in (False, True):
        for tokens in (24, 40, 33):
            ids = torch.randint(0, 64, (1, tokens))
            with torch.set_grad_enabled(grad):
                out = model(input_ids=ids, position_ids=torch.arange(tokens)[None], use_cache=False,
                            **packed_kwargs((tokens,), "cpu")).logits
            if grad:
                out.square().sum().backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] - before


def test_compiled_layers_share_their_graphs_whatever_the_depth(monkeypatch):
    """Every fused layer has one forward function, not one per layer: Dynamo would guard on a per-layer
    object's identity and build a graph per decoder layer, and at 28 layers pass its recompile limit
    within a step, after which every layer runs eagerly (the 7B LoRA recipe lost about 7 s an iteration)."""
    two, four = _graphs_for_a_step(2, monkeypatch), _graphs_for_a_step(4, monkeypatch)
    assert two == four, f"{two} graphs for 2 layers, {four} for 4: the layers' graphs are not shared"
    assert 0 < four <= 8


def test_fused_layers_copy_and_pickle():
    import pickle
    _, fused, _ = peft_and_fused(6, 32, 1, 0.1, "addmm")
    layer = fused.base_model.model.model.layers[0].mlp.down_proj
    assert type(layer).__name__ == "AddmmLoraLinear"
    again = pickle.loads(pickle.dumps(fused))
    ids = torch.randint(0, 64, (1, 6))
    torch.testing.assert_close(again(ids).logits, fused(ids).logits, rtol=0, atol=0)
    assert type(copy.deepcopy(layer)) is type(layer)


def test_a_subclass_of_peft_s_layer_keeps_its_own_forward_and_a_second_call_switches_the_mode():
    from peft.tuners.lora.layer import Linear as LoraLinear

    class Custom(LoraLinear):  # a user's own variant of peft's layer: fuse_lora cannot know its maths
        def forward(self, x, *args, **kwargs):
            return super().forward(x, *args, **kwargs) * 0.5

    _, fused, _ = peft_and_fused(7, 32, 1, 0.1)  # fused "merged"
    layers = fused.base_model.model.model.layers[0]
    layers.mlp.up_proj.__class__ = Custom
    assert fuse_lora(fused, "addmm") == 6
    assert type(layers.mlp.up_proj) is Custom and type(layers.mlp.down_proj).__name__ == "AddmmLoraLinear"
