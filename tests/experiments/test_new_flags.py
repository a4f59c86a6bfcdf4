"""Every flag, binding and file of the newer surfaces answers a bad value in one line: `error: ...`
naming it and what is allowed, exit 2 before any compute (4 for a full disk), no traceback; and the
commands that take one flag share its check, so `plan` refuses what `run` refuses."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.cli import main
from tests.conftest import REPO
from tests.experiments.test_bad_input import SMOKE, one_line_error

ROUND1 = str(REPO / "recipes" / "studies" / "round1.gin")
GPU_STUDY = str(REPO / "recipes" / "studies" / "gpu_tiny.gin")
TINY = str(REPO / "recipes" / "tiny.gin")


def one_line_process(argv, env=None) -> str:
    """The stderr of a real `python -m ...` that must end in one error line with exit code 2."""
    done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    err = done.stderr.strip()
    assert done.returncode == 2 and err.startswith("error: ") and "\n" not in err, (done.returncode, err)
    return err


ADDRESSES = [("::::", "is not HOST:PORT"), ("foo", "is not HOST:PORT"), ("", "'' is empty"),
             ("localhost:99999", "the port '99999' is not a port number (1..65535)")]


@pytest.mark.parametrize("address, match", ADDRESSES)
def test_a_bad_ray_address_is_one_line_in_the_engine_and_the_manager(capsys, tmp_path, address, match):
    err = one_line_process(["rlhf.train", TINY, "--out", str(tmp_path / "run"), "--ray-address", address])
    assert f"--ray-address {address!r}" in err and match in err
    assert not (tmp_path / "run").exists()  # before the run dir is made
    err = one_line_error(capsys, ["run", SMOKE, "--results", str(tmp_path / "r"), "--ray-address", address])
    assert f"--ray-address {address!r}" in err and match in err and not (tmp_path / "r").exists()


def test_a_bad_ray_address_variable_is_refused_by_train_run_and_plan(capsys, tmp_path, monkeypatch):
    err = one_line_process(["rlhf.train", TINY, "--out", str(tmp_path / "run")], env={"RAY_ADDRESS": "::::"})
    assert "RAY_ADDRESS '::::' is not HOST:PORT" in err
    monkeypatch.setenv("RAY_ADDRESS", "::::")
    for command in ("run", "plan"):  # one check: plan refuses what run refuses
        err = one_line_error(capsys, [command, SMOKE, "--results", str(tmp_path / "r")])
        assert "RAY_ADDRESS '::::' is not HOST:PORT" in err


def test_plan_refuses_the_w_and_b_project_run_refuses(capsys, tmp_path, monkeypatch):
    err = one_line_error(capsys, ["plan", SMOKE, "-b", "study.wandb_project = '   '", "--results", str(tmp_path)])
    assert "study.wandb_project = '   ' is invalid" in err and "may not be blank" in err
    monkeypatch.setenv("WANDB_PROJECT", "team/project")
    for command in ("plan", "run"):
        err = one_line_error(capsys, [command, SMOKE, "--results", str(tmp_path)])
        assert "WANDB_PROJECT = 'team/project' is invalid" in err
    assert not (tmp_path / "smoke").exists()


def test_plan_checks_what_the_recipe_needs_of_the_machine(capsys, tmp_path):
    import importlib.util

    import torch
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        assert main(["plan", GPU_STUDY, "--results", str(tmp_path)]) == 0
        return
    err = one_line_error(capsys, ["plan", GPU_STUDY, "--results", str(tmp_path)])
    assert err.startswith("error: the baseline: ppo.")
    if not torch.cuda.is_available():
        assert "ppo.device = 'cuda' needs a GPU" in err
        assert "ppo.device = 'cpu', ppo.rollout_backend = 'hf', ppo.dtype = 'float32', study.gpus_per_run = 0" in err
    if importlib.util.find_spec("vllm") is None:
        err = one_line_error(capsys, ["plan", SMOKE, "-b", "ppo.rollout_backend = 'vllm'", "--results", str(tmp_path)])
        assert "ppo.rollout_backend = 'vllm' needs the vllm package" in err
    # The quick start's CPU bindings make the same study plan on a CPU.
    cpu = ["-b", "study.gpus_per_run = 0", "-b", "study.cpus_per_run = 1", "-b", "ppo.device = 'cpu'",
           "-b", "ppo.rollout_backend = 'hf'", "-b", "ppo.dtype = 'float32'"]
    assert main(["plan", GPU_STUDY, *cpu, "--results", str(tmp_path)]) == 0


def test_the_engine_checks_the_machine_as_plan_does(tmp_path):
    import importlib.util

    import torch
    if not torch.cuda.is_available():
        err = one_line_process(["rlhf.train", TINY, "-b", "ppo.device = 'cuda'", "--out", str(tmp_path / "run")])
        assert err.startswith("error: ppo.device = 'cuda' needs a GPU") and not (tmp_path / "run").exists()
    if importlib.util.find_spec("vllm") is None:
        err = one_line_process(["rlhf.train", TINY, "-b", "ppo.rollout_backend = 'vllm'", "--out",
                                str(tmp_path / "run")])
        assert err.startswith("error: ppo.rollout_backend = 'vllm' needs the vllm package")


@pytest.mark.parametrize("bindings, variable, value, message", [
    ([], "VLLM_ENABLE_V1_MULTIPROCESSING", "1",
     "ppo.vllm_own_process = False is invalid with VLLM_ENABLE_V1_MULTIPROCESSING=1 in the environment, which puts "
     "vLLM's engine in a process of its own: set ppo.vllm_own_process = True for that, or unset "
     "VLLM_ENABLE_V1_MULTIPROCESSING"),
    (["-b", "ppo.vllm_model_runner = 'v2'"], "VLLM_USE_V2_MODEL_RUNNER", "0",
     "ppo.vllm_model_runner = 'v2' is invalid with VLLM_USE_V2_MODEL_RUNNER=0 in the environment, which asks vLLM "
     "for the other runner: set ppo.vllm_model_runner = 'auto' to follow the variable, or unset "
     "VLLM_USE_V2_MODEL_RUNNER")], ids=["placement", "model_runner"])
def test_a_vllm_switch_the_environment_contradicts_is_one_line_before_compute(tmp_path, capsys, bindings, variable,
                                                                                value, message):
    """verl and OpenRLHF users often export VLLM_ENABLE_V1_MULTIPROCESSING=1 (refused with the in-process
    engine, ppo.vllm_own_process = False); a VLLM_USE_V2_MODEL_RUNNER naming the other runner than the recipe's
    ppo.vllm_model_runner is refused too, never silently overridden: by name, in the engine's command and the
    manager's."""
    vllm = ["-b", "ppo.rollout_backend = 'vllm'", *bindings]
    err = one_line_process(["rlhf.train", TINY, *vllm, "--out", str(tmp_path / "run")], env={variable: value})
    assert err == f"error: {message}", err
    assert not (tmp_path / "run").exists()
    cpu = ["-b", "study.gpus_per_run = 0", "-b", "study.cpus_per_run = 1", "-b", "ppo.device = 'cpu'",
           "-b", "ppo.dtype = 'float32'"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv(variable, value)
        err = one_line_error(capsys, ["plan", GPU_STUDY, *cpu, *vllm, "--results", str(tmp_path)])
    assert err.startswith(f"error: the baseline: {message.split(' in the environment')[0]}"), err


@pytest.mark.parametrize("argv, match", [
    (["heldout", ROUND1, "--test", "t", "--out", "{dir}"], "--out '{dir}' is a directory; give a file"),
    (["summary", ROUND1, "--out", "{dir}"], "--out '{dir}' is a directory; give a file"),
    (["confirm", ROUND1, "--test", "t", "--out", "{dir}"], "--out '{dir}' is a directory; give a file"),
    (["testsplit", "--out", "{file}"], "--out '{file}': {file} is a file, not a directory"),
    (["export", ROUND1, "--out", "{file}"], "{file} is a file, not a directory"),
    (["heldout", ROUND1, ROUND1, "--test", "t", "--out", "{dir}/h.json"], "study 'round1' is listed twice"),
    (["heldout", ROUND1, "--test", "t", "--samples-per-prompt", "100000"],
     "--samples-per-prompt 100000 is invalid: 0 (the run's ppo.eval_samples_per_prompt) to 256"),
    (["confirm", ROUND1, "--test", "t", "--samples-per-prompt", "-1"], "--samples-per-prompt -1 is invalid"),
])
def test_a_stage_output_of_the_wrong_kind_is_one_line_before_any_work(tmp_path, argv, match):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("kept")
    paths = {"dir": str(tmp_path / "adir"), "file": str(tmp_path / "afile")}
    err = one_line_process(["experiments", *(a.format(**paths) for a in argv)])
    assert match.format(**paths) in err
    assert (tmp_path / "afile").read_text() == "kept" and not any((tmp_path / "adir").iterdir())


def test_a_stage_output_that_exists_is_replaced(tmp_path, capsys):
    """The decision the check above rests on: an output of the right kind is rewritten (atomically),
    as a rerun of the stage must, never refused."""
    out = tmp_path / "split"
    for _ in range(2):
        assert main(["testsplit", "--recipe", TINY, "--out", str(out)]) == 0
    assert (out / "test.jsonl").is_file() and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("held, match", [
    ("[]", "--overrides {spec} = [] is invalid: must be a mapping"),
    ("0", "--overrides {spec} = 0 is invalid: must be a mapping"),
    ("{ppo.kl_coef: 0.1, ppo: {kl_coef: 0.2}}", "ppo.kl_coef is given twice, as 0.1 and 0.2"),
])
def test_overrides_that_say_nothing_or_two_things_are_refused(capsys, tmp_path, held, match):
    overrides = tmp_path / "params.yaml"
    overrides.write_text(f"round1: {held}\n")
    spec = f"{overrides}:round1"
    err = one_line_error(capsys, ["plan", SMOKE, "--overrides", spec, "--results", str(tmp_path)])
    assert match.format(spec=spec) in err


def test_a_key_given_twice_in_the_overrides_file_is_refused(capsys, tmp_path):
    overrides = tmp_path / "params.yaml"
    overrides.write_text("round1:\n  ppo:\n    kl_coef: 0.1\n  ppo:\n    clip_range: 0.3\n")
    err = one_line_error(capsys, ["plan", SMOKE, "--overrides", f"{overrides}:round1", "--results", str(tmp_path)])
    assert "is not readable YAML" in err and "the key 'ppo' is given twice" in err and "line 4" in err
    overrides.write_text("round1:\n  ppo.clip_range: 0.3\n  ppo: {clip_range: 0.3}\n")  # one value, two forms: the same
    assert main(["plan", SMOKE, "--overrides", f"{overrides}:round1", "--results", str(tmp_path)]) == 0


@pytest.mark.parametrize("binding, match", [
    ("study.equivalence_margin = 5", "study.equivalence_margin = 5.0 is invalid: must be below 1: eval/accuracy is "
                                     "a fraction in [0, 1]"),
    ("study.metric_resolution = 1e9", "study.metric_resolution = 1000000000.0 is invalid: must be at most 1"),
])
def test_a_margin_or_grid_step_beyond_the_metric_range_is_refused(capsys, tmp_path, binding, match):
    assert match in one_line_error(capsys, ["plan", SMOKE, "-b", binding, "--results", str(tmp_path)])


def test_power_without_a_target_effect_gets_a_notice(capsys, tmp_path):
    assert main(["plan", SMOKE, "-b", "study.power = 0.9", "--results", str(tmp_path)]) == 0
    assert "notice: study.power = 0.9 has no effect without study.target_effect" in capsys.readouterr().out
    assert main(["plan", SMOKE, "--results", str(tmp_path)]) == 0
    assert "study.power" not in capsys.readouterr().out


def test_a_params_file_that_does_not_parse_says_so(capsys, tmp_path):
    out = tmp_path / "params"
    assert main(["params", SMOKE, "--out", str(out)]) == 0
    target = out / "smoke.yaml"
    target.write_text(target.read_text() + "study: {name: [unclosed\n")
    err = one_line_error(capsys, ["params", SMOKE, "--out", str(out)])
    assert f"{target} does not parse as YAML at line" in err and "git checkout" in err


def _disk_full_at(monkeypatch, name: str) -> None:
    """Writing a file called `name` (or a temporary of it) fails as on a full disk."""
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name.startswith(name) or self.name.startswith(f".{name}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", write_text)


def test_the_engine_on_a_full_disk_at_start_names_out_and_the_file(tmp_path, capsys, monkeypatch):
    from rlhf.train import main as train_main
    out = tmp_path / "run"
    _disk_full_at(monkeypatch, ".write_probe_")
    assert train_main([TINY, "--out", str(out)]) == 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: disk full writing {out}/.write_probe_"), err
    assert f"under --out {str(out)!r}" in err and not list(out.iterdir())


def test_a_stage_on_a_full_disk_gives_a_stage_remedy(tmp_path, capsys, monkeypatch):
    _disk_full_at(monkeypatch, "test.jsonl")
    assert main(["testsplit", "--recipe", TINY, "--out", str(tmp_path / "split")]) == 4
    err = capsys.readouterr().err.strip()
    assert err == (f"error: No space left on device writing {tmp_path / 'split' / 'test.jsonl'}: free some space, "
                   f"then run the same command again (its files are written whole or not at all, so nothing "
                   f"half-written is left)"), err
