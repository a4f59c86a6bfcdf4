"""Models, tokenizers, pairs and disks that do not fit: a model dir without a tokenizer, a sequence
classifier as the policy, tokenizer ids past the embedding, a truncated start or reward checkpoint,
pairs with chosen == rejected, bindings of another CLI are each one line (exit 2) before any
compute; a full disk is one line (exit 4) that leaves nothing half-written, and --resume then
continues from the last intact checkpoint to the numbers of an uninterrupted run."""

import errno
import json
import re
import shutil

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from rlhf import checkpoint
from rlhf.config import RewardConfig, TaskConfig, TinyModelConfig
from rlhf.errors import ConfigError
from rlhf.metrics import read_metrics
from rlhf.reward_model.score import RewardModelScorer
from rlhf.roles.reward_model import check_reward_model
from rlhf.tiny import build_tiny_model
from tests.rlhf.test_checkpoint_integrity import comparable
from tests.rlhf.test_reward_model import other_tokenizer, rm_data, save_rm, setup  # noqa: F401 (fixtures)

SMALL = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
PPO_ARGS = ["recipes/tiny.gin", "-b", "ppo.total_steps = 4", "-b", "ppo.eval_every = 2", "-b", "ppo.save_every = 2",
            "-b", "task.eval_size = 16", "--quiet"]
RM_SHORT = ["rm.steps = 4", "rm.save_every = 2", "rm.eval_every = 2", "rm.warmup_steps = 1", "rm.keep_checkpoints = 2"]


def one_error(capsys) -> str:
    """The last stderr line, which must be the error line, and no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in err, err[-3000:]
    return lines[-1]


def ppo_main(capsys, *args):
    from rlhf.train import main
    capsys.readouterr()
    return main([str(a) for a in args])


def rm_main(capsys, *args):
    from rlhf.reward_model.__main__ import main
    capsys.readouterr()
    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def models(setup, tmp_path_factory):  # noqa: F811
    """A causal LM without tokenizer files, and a Qwen2 reward model without any (transformers
    builds an empty Qwen2 tokenizer from config.json alone)."""
    root, tok, _ = setup
    out = tmp_path_factory.mktemp("models")
    build_tiny_model(SMALL, tok, seed=0).save_pretrained(str(out / "lm_no_tok"))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(str(out / "qwen_rm_no_tok"))
    return out


def test_model_dir_without_tokenizer_files_names_the_binding_to_set(setup, models, rm_data, tmp_path,  # noqa: F811
                                                                    capsys):
    root, _, _ = setup
    qwen = models / "qwen_rm_no_tok"
    with pytest.raises(ConfigError, match=rf"^reward.model_path = '{qwen}': no tokenizer files in that directory "
                                          r".*; set reward.tokenizer_path to the directory"):
        check_reward_model(RewardConfig(kind="model", model_path=str(qwen)), TaskConfig())
    # A tokenizer_config.json alone: transformers builds a tokenizer with no vocabulary.
    (qwen / "tokenizer_config.json").write_text("{}")
    try:
        with pytest.raises(ConfigError, match=r"the tokenizer there has an empty vocabulary \(1 tokens, all special\); "
                                              r"set reward.tokenizer_path"):
            RewardModelScorer(str(qwen), log=None)
    finally:
        (qwen / "tokenizer_config.json").unlink()
    # Reward-model training on a base model without a tokenizer, rm.tokenizer_path unset.
    assert rm_main(capsys, rm_data, "--out", tmp_path / "rm", "-b", f"rm.base_model = '{models / 'lm_no_tok'}'",
                   "-b", "rm.tokenizer_path = ''") == 2
    line = one_error(capsys)
    assert line.startswith(f"error: rm.base_model = '{models / 'lm_no_tok'}': no tokenizer files in that directory "
                           f"(none of tokenizer.json, tokenizer_config.json") and \
        line.endswith("set rm.tokenizer_path to the directory the model's tokenizer was saved in"), line


def test_policy_dir_without_tokenizer_is_one_line_naming_model_tokenizer_path(models, tmp_path, capsys):
    assert ppo_main(capsys, *PPO_ARGS, "-b", f"model.name_or_path = '{models / 'lm_no_tok'}'",
                    "--out", tmp_path / "run") == 2
    line = one_error(capsys)
    assert line.startswith(f"error: model.name_or_path = '{models / 'lm_no_tok'}': no tokenizer files") and \
        line.endswith("set model.tokenizer_path to the directory the model's tokenizer was saved in"), line


def test_sequence_classifier_as_the_policy_is_refused_before_loading(setup, tmp_path, capsys):  # noqa: F811
    root, _, _ = setup
    assert ppo_main(capsys, *PPO_ARGS, "-b", f"model.name_or_path = '{root / 'same'}'", "--out", tmp_path / "run") == 2
    line = one_error(capsys)
    assert f"model.name_or_path = '{root / 'same'}' is invalid: its config.json says architectures = " \
           f"['LlamaForSequenceClassification'], a sequence classifier" in line, line


def test_tokenizer_ids_past_the_embedding_name_tokenizer_and_model(setup, rm_data, tmp_path, capsys):  # noqa: F811
    root, tok, rm_tok = setup
    assert len(rm_tok) > len(tok)  # the other tokenizer has more ids than the models' embedding rows
    other = root / "other_tok"
    with pytest.raises(ConfigError, match=rf"^reward.tokenizer_path = '{other}': the tokenizer has ids up to "
                                          rf"{len(rm_tok) - 1} \({len(rm_tok)} tokens\), beyond the embedding of "
                                          rf"reward.model_path = '{root / 'same'}' \(vocab_size = {len(tok)} "):
        check_reward_model(RewardConfig(kind="model", model_path=str(root / "same"), tokenizer_path=str(other)),
                           TaskConfig())
    lm = tmp_path / "lm"
    build_tiny_model(SMALL, tok, seed=0).save_pretrained(str(lm))
    assert ppo_main(capsys, *PPO_ARGS, "-b", f"model.name_or_path = '{lm}'", "-b", f"model.tokenizer_path = '{other}'",
                    "--out", tmp_path / "run") == 2
    assert f"model.tokenizer_path = '{other}': the tokenizer has ids up to {len(rm_tok) - 1}" in one_error(capsys)
    assert rm_main(capsys, rm_data, "--out", tmp_path / "rm", "-b", f"rm.tokenizer_path = '{other}'") == 2
    assert "beyond the embedding of rm.base_model = " in one_error(capsys)


def test_pairs_with_chosen_equal_to_rejected_are_left_out_or_refused(rm_data, tmp_path, capsys):  # noqa: F811
    """A few identical pairs (public preference sets carry some) are left out with a notice naming
    the first row and how many; a file of nothing else is one line before training."""
    from rlhf.chat import PromptRenderer
    from rlhf.reward_model.bradley_terry import load_encoded_pairs
    from rlhf.reward_model.score import load_reward_tokenizer
    rows = [json.loads(line) for line in (rm_data.parent / "train.jsonl").read_text().splitlines()][:40]
    some, every = tmp_path / "some.jsonl", tmp_path / "every.jsonl"
    some.write_text("".join(json.dumps({**r, "rejected": r["chosen"]} if i in {3, 8, 20} else r) + "\n"
                            for i, r in enumerate(rows)))
    every.write_text("".join(json.dumps({**r, "rejected": r["chosen"]}) + "\n" for r in rows))
    tokenizer_dir = re.search(r"rm.tokenizer_path = '([^']+)'", rm_data.read_text()).group(1)
    renderer = PromptRenderer(load_reward_tokenizer(tokenizer_dir), "auto")
    notices = []
    pairs, encoded = load_encoded_pairs(renderer, str(some), "rm.train_path", "prompt", notices.append)
    assert len(pairs) == len(encoded) == 37 and all(c != r for c, r, _ in encoded)
    assert notices == [f"rm.train_path = '{some}': 3 of 40 rows have chosen == rejected (the same token ids; the "
                       f"first is row 3); they carry no preference and are left out"]
    assert rm_main(capsys, rm_data, "--out", tmp_path / "rm", "-b", f"rm.eval_path = '{every}'") == 2
    assert one_error(capsys) == (f"error: rm.eval_path = '{every}': every row has chosen == rejected (the same token "
                                 f"ids): a pair must prefer one response over another")


def test_reward_model_cli_takes_rm_bindings_only_and_names_the_real_ones(rm_data, tmp_path, capsys):  # noqa: F811
    assert rm_main(capsys, rm_data, "--out", tmp_path / "rm", "-b", "ppo.kl_coef = 0.1") == 2
    line = one_error(capsys)
    assert line.startswith("error: ppo.kl_coef (-b 'ppo.kl_coef = 0.1') is not a reward-model binding: "
                           "python -m rlhf.reward_model accepts rm.* bindings only; ppo.* configures PPO"), line
    assert rm_main(capsys, rm_data, "--out", tmp_path / "rm", "-b", "rm.lr = 0.1") == 2
    line = one_error(capsys)
    assert "rm.lr is not a known binding (-b binding); did you mean rm.learning_rate? Allowed: rm.{train_path, " \
           "eval_path," in line and "gradient_checkpointing}" in line, line
    recipe = tmp_path / "mixed.gin"
    recipe.write_text(f"include '{rm_data}'\n\nmodel.name_or_path = 'tiny'\n")
    assert rm_main(capsys, recipe, "--out", tmp_path / "rm") == 2
    assert f"model.name_or_path ({recipe}:3) is not a reward-model binding" in one_error(capsys)
    assert not (tmp_path / "rm").exists()


def test_reward_model_out_that_is_a_file_is_one_line(rm_data, tmp_path, capsys):  # noqa: F811
    existing = tmp_path / "a_file"
    existing.write_text("keep me")
    assert rm_main(capsys, rm_data, "--out", existing) == 2
    assert one_error(capsys).startswith(f"error: --out {str(existing)!r} is not a writable run dir")
    assert existing.read_text() == "keep me"


def test_damaged_start_and_reward_checkpoints_are_one_line_naming_the_file(setup, tmp_path, capsys):  # noqa: F811
    root, tok, _ = setup
    # A start checkpoint with a manifest: verified against it, as --resume verifies.
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    build_tiny_model(TinyModelConfig(), tok, seed=0).save_pretrained(str(ckpt / "actor"))
    (ckpt / "state.json").write_text('{"step": 2}')
    checkpoint.write_manifest(ckpt)
    weights = ckpt / "actor" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:size // 2])
    assert ppo_main(capsys, *PPO_ARGS, "-b", f"ppo.init_from = '{ckpt}'", "--out", tmp_path / "new") == 2
    assert one_error(capsys).startswith(f"error: ppo.init_from = '{ckpt}' is damaged: actor/model.safetensors has "
                                        f"{size // 2} bytes, the manifest says {size}")
    (ckpt / "manifest.json").unlink()  # without one: its safetensors headers are read
    with pytest.raises(ConfigError, match=rf"ppo.init_from = '{ckpt}': {weights} is truncated or damaged"):
        checkpoint.check_start_checkpoint(ckpt)
    # A truncated reward model: named before any weights load.
    rm = tmp_path / "rm"
    shutil.copytree(root / "same", rm)
    data = (rm / "model.safetensors").read_bytes()
    (rm / "model.safetensors").write_bytes(data[:len(data) - 100])
    assert ppo_main(capsys, *PPO_ARGS, "-b", "reward.kind = 'model'", "-b", f"reward.model_path = '{rm}'",
                    "--out", tmp_path / "ppo") == 2
    assert one_error(capsys).startswith(f"error: reward.model_path = '{rm}': {rm / 'model.safetensors'} is truncated "
                                        f"or damaged (Error while deserializing header")


def test_rm_resume_says_what_it_skipped_and_when_there_is_nothing(rm_data, tmp_path):  # noqa: F811
    from rlhf.reward_model.bradley_terry import RewardModelTrainer
    from rlhf.reward_model.config import resolve
    cfg, _ = resolve(str(rm_data), RM_SHORT)
    out, logged = tmp_path / "rm", []
    RewardModelTrainer(cfg, out, log=logged.append).run(resume=True)
    assert f"--resume: no checkpoint in {out}: starting from step 0" in logged
    expected, weights = read_metrics(out / "metrics.jsonl"), load_file(str(out / "model.safetensors"))
    assert checkpoint.verify_checkpoint(out / "checkpoints" / "step_4") is None  # it has a manifest
    damaged = out / "checkpoints" / "step_4" / "model" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    logged.clear()
    RewardModelTrainer(cfg, out, log=logged.append).run(resume=True)
    ckpts = out / "checkpoints"
    assert any(m.startswith(f"--resume: skipped damaged checkpoint {ckpts / 'step_4'} (model/model.safetensors has "
                            f"1000 bytes") and m.endswith(f"moved to {ckpts / 'corrupt-step_4'}")
               for m in logged), logged
    assert f"--resume: resuming from {out / 'checkpoints' / 'step_2'}, the newest intact checkpoint" in logged
    assert read_metrics(out / "metrics.jsonl") == expected
    again = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def fill_disk_at(step: int, real, exc):
    """A safetensors save_file that, for checkpoint `step`, writes half a file and raises `exc`."""
    def save_file(tensors, filename, *args, **kwargs):
        if f".tmp_step_{step}" in str(filename):
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise exc
        return real(tensors, filename, *args, **kwargs)
    return save_file


def test_ppo_disk_full_is_one_line_and_resume_continues_exactly(tmp_path, capsys, monkeypatch):
    import safetensors.torch
    out = tmp_path / "run"
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", fill_disk_at(4, safetensors.torch.save_file, full))
    assert ppo_main(capsys, *PPO_ARGS, "--out", out) == 4
    line = one_error(capsys)
    assert line == (f"error: disk full: cannot write checkpoint {out / 'checkpoints' / 'step_4'} (No space left on "
                    f"device; nothing half-written is left); free space, then --resume continues from "
                    f"{out / 'checkpoints' / 'step_2'}"), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert not (out / "summary.json").exists()
    expected = comparable(read_metrics(out / "metrics.jsonl"))  # logged before the save failed
    assert [r["step"] for r in expected] == [0, 1, 2, 3, 4]
    monkeypatch.undo()
    assert ppo_main(capsys, *PPO_ARGS, "--out", out, "--resume") == 0
    assert comparable(read_metrics(out / "metrics.jsonl")) == expected
    assert checkpoint.verify_checkpoint(out / "checkpoints" / "step_4") is None


def test_rm_disk_full_is_one_line_leaves_no_temporary_folder_and_resumes(rm_data, tmp_path, capsys,  # noqa: F811
                                                                         monkeypatch):
    from rlhf.reward_model import bradley_terry
    out = tmp_path / "rm"
    args = [rm_data, "--out", out, *[x for b in RM_SHORT for x in ("-b", b)]]
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(bradley_terry, "save_file", fill_disk_at(4, bradley_terry.save_file, full))
    assert rm_main(capsys, *args) == 4
    assert one_error(capsys) == (f"error: disk full: cannot write checkpoint {out / 'checkpoints' / 'step_4'} (No "
                                 f"space left on device; nothing half-written is left); free space, then --resume "
                                 f"continues from {out / 'checkpoints' / 'step_2'}")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp") or p.name.endswith(".safetensors")]
    expected = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in expected] == [0, 1, 2, 3, 4]
    monkeypatch.undo()
    assert rm_main(capsys, *args, "--resume") == 0
    assert read_metrics(out / "metrics.jsonl") == expected
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
