"""bench/phase_limits.py: each phase of a recipe run set against the GPU's limits (bench/flops.py)."""

import json
import sys

import pytest

from rlhf.memory import KNOWN_SHAPES, ModelShape
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import flops  # noqa: E402
import phase_limits  # noqa: E402

RESULTS = REPO / "bench" / "results"
SMALL = ModelShape(8, 2, 2, 1, 4, 16, 10, True, name="small")  # hidden, layers, heads, KV heads, head dim, MLP, vocab


def test_a_pass_counts_its_matmuls_causal_attention_and_the_head_where_logits_are_taken():
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16, down 16x8 = 576 weights, 2 layers
    assert SMALL.matmul_params(lm_head=False) == 1152
    # 10 tokens in sequences of 5, logits at 4: matmuls 2 x 1152 x 10, attention 2 x 2 layers x 2 heads
    # x 4 x 5 x 10, head 2 x 10 x 8 x 4
    assert flops.forward_flops(SMALL, 10, 5, 4) == 23040 + 1600 + 640
    assert flops.forward_flops(SMALL, 10, 5, 0) == 23040 + 1600  # a value model: no LM head
    one = flops.forward_flops(SMALL, 10, 5, 4)
    assert flops.training_flops(SMALL, 10, 5, 4, frozen_base=False, checkpointing=False) == 3 * one
    assert flops.training_flops(SMALL, 10, 5, 4, frozen_base=True, checkpointing=False) == 2 * one  # LoRA
    assert flops.training_flops(SMALL, 10, 5, 4, frozen_base=True, checkpointing=True) == 3 * one
    assert flops.kv_bytes_per_token(SMALL) == 2 * 2 * 1 * 4 * 2
    assert flops.gpu_for_memory(79.2) == "h100" and flops.gpu_for_memory(139.8) == "h200"
    assert flops.gpu_for_memory(None) is None


def test_the_0_5b_recipe_on_an_h100_is_held_by_the_host_not_the_gpu(tmp_path, capsys):
    """The shipped 0.5B recipe's run at 27,226 tokens/s: every dense phase under its matmul floor's
    reach, generation far above its bandwidth floor (the host's time per decoding step)."""
    path = RESULTS / "instruct05b_recipe_mb12k_v2_rerun_h100.json"
    assert phase_limits.main([str(path), "--json", str(tmp_path / "limits.json")]) == 0
    out = json.loads((tmp_path / "limits.json").read_text())
    assert out["gpu_key"] == "h100" and out["sequences"] == 256  # from the memory the run recorded, its recipe
    assert out["tokens_per_iteration"] == pytest.approx(256 * (256 + 512), rel=1e-3)
    assert out["response_tokens_mean"] == pytest.approx(512, rel=1e-3)
    phases = out["phases"]
    shape = KNOWN_SHAPES["qwen2.5-0.5b"]
    tokens, seq = out["tokens_per_iteration"], out["tokens_per_iteration"] / 256
    full = flops.training_flops(shape, tokens, seq, 256 * out["response_tokens_mean"], frozen_base=False,
                                checkpointing=False)
    assert phases["update_actor"]["tflop"] == pytest.approx(full / 1e12)  # full fine-tuning, one epoch
    for name in phase_limits.DENSE:
        row = phases[name]
        assert row["bound"] == "bf16 matmul" and 0 < row["floor_s"] < row["measured_s"]
        assert row["share_of_limit"] == pytest.approx(row["floor_s"] / row["measured_s"])
    generate = phases["generate"]
    assert generate["bound"] == "HBM" and generate["decoding_steps"] == 512
    assert generate["measured_ms_per_step"] > 5 * generate["floor_ms_per_step"]
    assert phases["advantages"]["floor_s"] == 0 and phases["advantages"]["bound"] == "host"
    assert out["iteration_floor_s"] == pytest.approx(sum(r["floor_s"] for r in phases.values()))
    assert out["tokens_per_s_ceiling"] > 3 * out["tokens_per_s"]
    printed = capsys.readouterr().out
    assert "generate" in printed and "27,226 tokens/s against a ceiling of" in printed


def test_the_7b_lora_recipe_counts_its_frozen_base_and_checkpointing():
    """The 7B LoRA recipe (lora.gin, checkpointing off): the update is a forward and a backward without
    the base's weight gradients; with checkpointing, a recomputed forward more. Decoding 256 sequences
    at 7B is bound by the matmuls, not by reading the weights."""
    result = json.loads((RESULTS / "lora7b_recipe_h200.json").read_text())
    phases = phase_limits.floors(result, "h200")["phases"]
    assert phases["update_actor"]["tflop"] == pytest.approx(2 * phases["reference"]["tflop"])
    assert phases["generate"]["bound"] == "bf16 matmul"
    assert all(phases[name]["share_of_limit"] < 1 for name in phase_limits.DENSE)
    checkpointed = {**result, "bindings": [*result["bindings"], "ppo.gradient_checkpointing = True"]}
    phases = phase_limits.floors(checkpointed, "h200")["phases"]
    assert phases["update_actor"]["tflop"] == pytest.approx(3 * phases["reference"]["tflop"])


def test_a_run_with_no_gpu_recorded_names_the_option(tmp_path, capsys):
    result = json.loads((RESULTS / "instruct05b_recipe_mb12k_v2_rerun_h100.json").read_text())
    result["gpu_total_gib"] = None
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit) as info:
        phase_limits.main([str(path)])
    assert info.value.code == 2 and "--gpu" in capsys.readouterr().err


def test_what_is_not_a_recipe_run_result_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"steps": []}))
    result = json.loads((RESULTS / "instruct05b_recipe_mb12k_v2_rerun_h100.json").read_text())
    (tmp_path / "short.json").write_text(json.dumps({**result, "steps": result["steps"][:1]}))
    for name, says in (("missing.json", "no such file"), (".", "a directory"), ("broken.json", "is not JSON"),
                       ("other.json", "lacks phase_s_median"), ("short.json", "at least 2")):
        with pytest.raises(SystemExit) as info:
            phase_limits.main([str(tmp_path / name), "--gpu", "h100"])
        err = capsys.readouterr().err
        assert info.value.code == 2 and says in err and "Traceback" not in err, (name, err)
