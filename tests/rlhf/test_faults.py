"""Bad input the engine meets before any compute: each is one line naming the binding or path and
what is allowed, exit code 2, no traceback, nothing left behind."""

import os
import sys

import pytest

from rlhf import configurable
from rlhf.errors import ConfigError
from tests.conftest import run_train


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


@pytest.mark.parametrize("binding, expected", [
    ("ppo.kl_coef = abc", "error: ppo.kl_coef = abc is invalid: not a value; expected a number, "
                          "e.g. ppo.kl_coef = 0.05"),
    ("ppo.adaptive_kl = yes", "ppo.adaptive_kl = yes is invalid: not a value; expected True or False"),
    ("task.name = file", "expected a quoted string, e.g. task.name = 'arithmetic'"),
    ("ppo.kl_coef = [0.1, 0.2", "cannot parse -b binding: 'ppo.kl_coef = [0.1, 0.2': a bracket or quote is not closed"),
    ("ppo.init_from = '/no/such/run/checkpoints/step_5'",
     "ppo.init_from = '/no/such/run/checkpoints/step_5' is invalid: not a checkpoint dir"),
    ("ppo.max_prompt_length = 100000",
     "ppo.max_prompt_length + ppo.max_response_length = 100000 + 6 = 100006 is invalid: exceeds the model's "
     "position limit (the tiny default's max_position_embeddings = 256)"),
    ("ppo.max_response_length = 250", "= 8 + 250 = 258 is invalid: exceeds the model's position limit"),
])
def test_bad_binding_is_one_line_exit_2(tmp_path, binding, expected):
    line = one_error_line(run_train(["recipes/tiny.gin", "-b", binding, "--out", tmp_path / "run"], check=False))
    assert expected in line, line
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_position_limit_of_a_local_model_comes_from_its_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 64}')
    with pytest.raises(ConfigError, match=r"exceeds the model's position limit \(max_position_embeddings in "
                                          rf"{model / 'config.json'} = 64\)"):
        configurable.resolve("recipes/tiny.gin", [f"model.name_or_path = '{model}'", "task.name = 'file'",
                                                  "task.train_path = 'x.jsonl'", "ppo.max_prompt_length = 60"])


def test_tiny_default_with_a_file_task_is_refused_at_validation(tmp_path, monkeypatch):
    """The plan of a study resolves the same config: it refuses this too, before any run."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cache = tmp_path / "cache"
    monkeypatch.setenv("RLHF_CACHE", str(cache))
    proc = run_train(["recipes/tiny.gin", "-b", "task.name = 'file'", "-b", f"task.train_path = '{data}'",
                      "--out", tmp_path / "run"], check=False)
    line = one_error_line(proc)
    assert "task.name = 'file' is invalid: model.name_or_path = 'tiny' is warm-started on the arithmetic task" in line
    assert not cache.exists() or not any(p.name.startswith("tiny-") for p in cache.iterdir())
    with pytest.raises(ConfigError, match="warm-started on the arithmetic task only"):
        configurable.resolve("recipes/tiny.gin", ["task.name = 'file'", f"task.train_path = '{data}'"])


def test_failed_warm_start_build_leaves_no_tmp_dir(tmp_path, monkeypatch):
    from rlhf import tiny
    from rlhf.config import SFTConfig, TaskConfig, TinyModelConfig

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "train_sft", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny.prepare_tiny(TinyModelConfig(), SFTConfig(steps=1), TaskConfig(), cache_dir=tmp_path, log=lambda m: None)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_unwritable_run_dir_is_one_line_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "run"
    line = one_error_line(run_train(["recipes/tiny.gin", "--out", out], check=False))
    assert line.startswith(f"error: --out {str(out)!r} is not a writable run dir"), line


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() == 0, reason="root writes into read-only dirs")
def test_read_only_run_dir_is_one_line_naming_it(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = one_error_line(run_train(["recipes/tiny.gin", "--out", ro / "run"], check=False))
    finally:
        ro.chmod(0o755)
    assert f"--out {str(ro / 'run')!r} is not a writable run dir (Permission denied" in line, line


def test_a_ray_address_where_nothing_listens_fails_within_seconds_naming_it(tmp_path):
    import socket
    import time
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    line = one_error_line(run_train(["recipes/tiny.gin", "-b", "ppo.placement = 'colocated'",
                                     "--ray-address", f"127.0.0.1:{port}", "--out", tmp_path / "run"],
                                    check=False, timeout=120))
    assert time.monotonic() - start < 20
    assert line.startswith(f"error: --ray-address '127.0.0.1:{port}': no Ray cluster answers there "
                           f"(Connection refused"), line
    assert not (tmp_path / "run").exists()
