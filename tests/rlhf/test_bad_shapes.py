"""Bad model shapes, architectures, LoRA bindings and GPU sizes: `python -m rlhf.memory` and the trainer's
start (`python -m rlhf.train`) refuse exactly the same inputs, each with the same one line (exit 2) naming
the file, flag or binding and what is allowed, before anything is built (rlhf/models.py
`check_policy_dir`, through rlhf/memory/plan.py `check_policy`). Config files only, no weights."""

import json
import subprocess
import sys

import pytest
from transformers import BertConfig, LlamaConfig, LlamaForCausalLM

from rlhf.errors import ConfigError
from rlhf.models import add_lora, check_lora_targets, check_policy_dir
from tests.conftest import REPO

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, vocab_size=100)
"""A Llama of the tiny default's widths (64): its attention projections are 64 x 64."""


def model_dir(tmp_path, name, config) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-3000:]
    return lines[0]


def plan(capsys, *args) -> tuple:
    """(exit code, the error line) of `python -m rlhf.memory`, in this process."""
    from rlhf.memory.__main__ import main
    capsys.readouterr()
    rc = main([str(a) for a in args])
    return rc, one_line(capsys) if rc else None


def train(capsys, tmp_path, *args) -> tuple:
    """(exit code, the error line) of `python -m rlhf.train`, in this process."""
    from rlhf.train import main
    capsys.readouterr()
    out = tmp_path / "run"
    rc = main([str(a) for a in args] + ["--out", str(out), "--quiet"])
    assert not (out / "metrics.jsonl").exists()  # nothing ran
    return rc, one_line(capsys)


def bindings(*items) -> list:
    return [x for b in items for x in ("-b", b)]


# ---------------------------------------------------------------- config.json: shape and architecture
@pytest.mark.parametrize("name, config, expected", [
    ("zero_width", {**LLAMA, "hidden_size": 0}, "config.json says hidden_size = 0; allowed: a positive integer"),
    ("text_width", {**LLAMA, "hidden_size": "big"},
     "config.json says hidden_size = 'big'; allowed: a positive integer"),
    ("empty", {}, "config.json has no hidden_size, num_hidden_layers, num_attention_heads, vocab_size; allowed: each "
                  "a positive integer (the model's shape)"),
    ("type_only", {"model_type": "llama"}, "config.json has no hidden_size, num_hidden_layers, num_attention_heads, "
                                           "vocab_size; allowed: each a positive integer"),
    ("a_list", [LLAMA], "config.json is not a JSON object (it holds a list); allowed: a model config object with "
                        "model_type, hidden_size"),
    ("negative_layers", {**LLAMA, "num_hidden_layers": -1},
     "config.json says num_hidden_layers = -1; allowed: a positive integer"),
    ("bool_heads", {**LLAMA, "num_attention_heads": True},
     "config.json says num_attention_heads = True; allowed: a positive integer"),
    ("indivisible", {**LLAMA, "hidden_size": 60, "num_attention_heads": 8},
     "config.json says hidden_size = 60, not a multiple of num_attention_heads = 8; allowed: a hidden_size that "
     "num_attention_heads divides"),
    ("kv_heads", {**LLAMA, "num_key_value_heads": 3},
     "config.json says num_attention_heads = 4, not a multiple of num_key_value_heads = 3; allowed: a "
     "num_key_value_heads that divides num_attention_heads"),
    ("no_model_type", {k: v for k, v in LLAMA.items() if k != "model_type"},
     "config.json has no model_type; allowed: a model type with a causal LM in transformers"),
    ("unknown_type", {**LLAMA, "model_type": "gpt9"},
     "config.json says model_type = 'gpt9', which this transformers does not know; allowed: a model type with a "
     "causal LM in transformers"),
])
def test_a_bad_config_json_is_one_line_in_the_memory_plan_and_the_trainer_alike(tmp_path, capsys, name, config,
                                                                                 expected):
    path = model_dir(tmp_path, name, config)
    rc, line = plan(capsys, "recipes/tiny.gin", "-b", f"model.name_or_path = '{path}'", "--gpu-memory-gib", "80")
    assert rc == 2 and line.startswith(f"error: model.name_or_path = '{path}': {path}/config.json") \
        and expected in line, line
    assert train(capsys, tmp_path, "recipes/tiny.gin", "-b", f"model.name_or_path = '{path}'") == (2, line)
    with pytest.raises(ConfigError):  # what load_policy checks too, before any weights load
        check_policy_dir(path)


def test_a_masked_lm_or_a_classifier_as_the_policy_is_refused_by_the_memory_plan_as_by_the_trainer(tmp_path, capsys):
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    bert = BertConfig(**small, architectures=["BertForMaskedLM"])
    bert.save_pretrained(str(tmp_path / "bert"))
    classifier = LlamaConfig(**small, architectures=["LlamaForSequenceClassification"], num_labels=1)
    classifier.save_pretrained(str(tmp_path / "classifier"))
    for name, kind in (("bert", "['BertForMaskedLM'], not a causal LM"),
                       ("classifier", "['LlamaForSequenceClassification'], a sequence classifier (a reward model?)")):
        path = tmp_path / name
        rc, line = plan(capsys, "recipes/tiny.gin", "-b", f"model.name_or_path = '{path}'", "--gpu-memory-gib", "80")
        assert rc == 2 and line == (f"error: model.name_or_path = '{path}' is invalid: its config.json says "
                                    f"architectures = {kind}; loading it as the policy would start from an untrained "
                                    f"LM head. Use a causal LM checkpoint (architectures ending in ForCausalLM)"), line
        assert train(capsys, tmp_path, "recipes/tiny.gin", "-b", f"model.name_or_path = '{path}'") == (2, line)


def test_a_good_config_json_still_plans(tmp_path, capsys):
    path = model_dir(tmp_path, "good", LLAMA)
    assert plan(capsys, "recipes/tiny.gin", "-b", f"model.name_or_path = '{path}'", "--gpu-memory-gib", "80",
                *bindings("ppo.device = 'cuda'", "ppo.lora_rank = 64")) == (0, None)
    assert "verdict: the run needs" in capsys.readouterr().out


def test_the_memory_command_process_exits_2_without_a_traceback(tmp_path):
    path = model_dir(tmp_path, "text_width", {**LLAMA, "hidden_size": "big"})
    proc = subprocess.run([sys.executable, "-m", "rlhf.memory", "recipes/tiny.gin", "-b",
                           f"model.name_or_path = '{path}'"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: model.name_or_path = '{path}': {path}/config.json says hidden_size = "
                                   f"'big'; allowed: a positive integer")


# ---------------------------------------------------------------- --gpu-memory-gib
@pytest.mark.parametrize("value", ["nan", "0", "-5", "1e30", "inf", "lots"])
def test_gpu_memory_outside_a_positive_finite_range_is_one_line(capsys, value):
    rc, line = plan(capsys, "recipes/tiny.gin", "--gpu-memory-gib", value, *bindings("ppo.device = 'cuda'"))
    assert rc == 2 and line == (f"error: --gpu-memory-gib {value} is invalid: allowed: the memory of one GPU in GiB, "
                                f"a positive finite number up to 100000 (an H200: 139)"), line


def test_gpu_memory_in_range_is_taken(capsys):
    assert plan(capsys, "recipes/tiny.gin", "--gpu-memory-gib", "1e5", *bindings("ppo.device = 'cuda'")) == (0, None)
    assert "GPU: 100000.0 GiB (--gpu-memory-gib)" in capsys.readouterr().out


# ---------------------------------------------------------------- LoRA bindings against the layers
TINY_LORA = [
    (["ppo.lora_rank = 4096"],
     "error: ppo.lora_rank = 4096 is invalid: above the width of the policy's narrowest adapted layer "
     "(model.layers.0.self_attn.k_proj: 64 in, 64 out features), where a rank above 64 adds nothing; allowed: a rank "
     "from 1 to 64 (or fewer target modules, ppo.lora_target_modules)"),
    (["ppo.lora_rank = 8", "ppo.critic_lora_rank = 100"],
     "error: ppo.critic_lora_rank = 100 is invalid: above the width of the critic's narrowest adapted layer "
     "(layers.0.self_attn.k_proj: 64 in, 64 out features), where a rank above 64 adds nothing; allowed: a rank from "
     "1 to 64"),
    (["ppo.lora_rank = 8", "ppo.lora_target_modules = ['q_proj', 'nonexistent']"],
     "error: ppo.lora_target_modules = ['q_proj', 'nonexistent'] is invalid: the policy has no module named "
     "'nonexistent'; its module names: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, "
     "v_proj"),
    (["ppo.lora_rank = 8", "ppo.lora_target_modules = ['lm_head']"],
     "error: ppo.lora_target_modules = ['lm_head'] is invalid: the critic (the policy's backbone with a value head, "
     "without the LM head) has no module named 'lm_head'; the policy has it, the critic does not: drop 'lm_head' or "
     "set ppo.critic_lora_rank = 0 (the critic trains in full); its module names: down_proj, embed_tokens, gate_proj, "
     "k_proj, o_proj, q_proj, up_proj, v_proj"),
    (["ppo.lora_rank = 8", "ppo.lora_target_modules = ['mlp']"],
     "error: ppo.lora_target_modules = ['mlp'] is invalid: 'mlp' names model.layers.0.mlp of the policy, a LlamaMLP, "
     "which LoRA cannot adapt (linear and embedding layers only); its module names: down_proj, embed_tokens"),
]


@pytest.mark.parametrize("lora, expected", TINY_LORA, ids=["rank", "critic_rank", "unknown", "lm_head", "mlp"])
def test_lora_bindings_the_layers_cannot_take_are_one_line_in_the_memory_plan_and_the_trainer(tmp_path, capsys, lora,
                                                                                            expected):
    """On the tiny default (64-wide attention): what peft would silently accept (a rank above the layer's
    width, a name matching nothing beside one that matches) or say without naming the model."""
    rc, line = plan(capsys, "recipes/tiny.gin", *bindings(*lora))
    assert rc == 2 and line.startswith(expected), line
    assert train(capsys, tmp_path, "recipes/tiny.gin", *bindings(*lora)) == (2, line)


def test_lora_checks_read_the_model_dirs_layers_and_the_published_shapes(tmp_path, capsys):
    path = model_dir(tmp_path, "wide", {**LLAMA, "hidden_size": 256, "intermediate_size": 512})
    lora = bindings(f"model.name_or_path = '{path}'", "ppo.lora_rank = 128", "ppo.critic_lora_rank = 0")
    assert plan(capsys, "recipes/tiny.gin", *lora)[0] == 0  # 256-wide layers take rank 128
    assert train(capsys, tmp_path, "recipes/tiny.gin", *lora, "-b", "ppo.lora_rank = 512")[1].startswith(
        "error: ppo.lora_rank = 512 is invalid: above the width of the policy's narrowest adapted layer "
        "(model.layers.0.self_attn.k_proj: 256 in, 256 out features)")
    # A published shape has no config.json: its layers are checked all the same (the 7B's k_proj is 512 wide).
    rc, line = plan(capsys, "recipes/models/lora.gin", "--shape", "qwen2.5-7b", "-b", "ppo.lora_rank = 1024")
    assert rc == 2 and line.startswith("error: ppo.lora_rank = 1024 is invalid: above the width of the policy's "
                                       "narrowest adapted layer (model.layers.0.self_attn.k_proj: 3584 in, 512 out "
                                       "features)"), line
    assert plan(capsys, "recipes/models/lora.gin", "--shape", "qwen2.5-7b", "--gpu-memory-gib", "139")[0] == 0


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["self_attn.o_proj", "lm_head"],
                                     ["embed_tokens", "down_proj"]])
def test_the_check_finds_the_layers_peft_adapts(targets):
    """The check matches names as peft does (a name or a dotted suffix of one; 'all-linear' without the
    output head), on the policy and on the critic's backbone alike."""
    config = LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("model_type", "architectures")})
    for role in ("policy", "critic"):
        if role == "critic" and "lm_head" in targets:
            continue
        model = LlamaForCausalLM(config)
        model = model if role == "policy" else model.base_model
        checked = check_lora_targets(model, role, 8, "ppo.lora_rank", targets)
        adapted = add_lora(model, 8, 16.0, 0.0, targets)
        assert checked == sorted(adapted.targeted_module_names), role
