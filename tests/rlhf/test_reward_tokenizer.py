"""A reward model scores with the tokenizer it was trained with. A character tokenizer saved as the
generic class beside a qwen2 classifier used to come back from AutoTokenizer as a Qwen2Tokenizer,
which drops spaces and newlines: every id after the first space moved and no warning said so. It
now loads as saved, and the ids its training tokenizer gave a probe text travel with the model, so
a tokenizer that encodes differently (a wrong reward.tokenizer_path) is refused in one line."""

import json

import pytest
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from rlhf.config import RewardConfig, TaskConfig
from rlhf.errors import ConfigError
from rlhf.reward_model.score import PROBE_FILE, PROBE_TEXT, load_reward_tokenizer, write_tokenizer_probe
from rlhf.roles.reward_model import check_reward_model
from rlhf.tiny import build_char_tokenizer
from tests.rlhf.test_reward_model import other_tokenizer


def qwen2_reward_model(path, tok):
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, num_labels=1, pad_token_id=tok.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    write_tokenizer_probe(tok, path)  # what rlhf.reward_model's training writes beside the model
    return path


def test_a_reward_model_loads_the_tokenizer_it_was_trained_with(tmp_path):
    trained = other_tokenizer(tmp_path / "own_tok")  # rm.tokenizer_path: a tokenizer in its own folder
    rm = qwen2_reward_model(tmp_path / "rm", trained)
    loaded = load_reward_tokenizer(rm, "reward.model_path")
    text = "What is 2 + 3?\nIt is 5.\n\nDone"
    assert loaded(text, add_special_tokens=False)["input_ids"] == trained(text, add_special_tokens=False)["input_ids"]
    assert (loaded.pad_token, loaded.eos_token, loaded.chat_template) == (trained.pad_token, trained.eos_token,
                                                                          trained.chat_template)
    assert json.loads((rm / PROBE_FILE).read_text())["text"] == PROBE_TEXT
    check_reward_model(RewardConfig(kind="model", model_path=str(rm)), TaskConfig())  # the model path alone


def test_a_tokenizer_that_encodes_differently_is_refused(tmp_path):
    rm = qwen2_reward_model(tmp_path / "rm", other_tokenizer(tmp_path / "own_tok"))
    build_char_tokenizer(tmp_path / "policy_tok")  # fits the embedding, but other ids
    reward = RewardConfig(kind="model", model_path=str(rm), tokenizer_path=str(tmp_path / "policy_tok"))
    with pytest.raises(ConfigError, match=r"^reward\.tokenizer_path: this tokenizer \(\w+\) encodes text differently "
                                          r"from the one the reward model .* was trained with .*; set "
                                          r"reward\.tokenizer_path to the tokenizer it was trained with$"):
        check_reward_model(reward, TaskConfig())
