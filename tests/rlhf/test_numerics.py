"""The CPU numerics profile (rlhf/numerics.py): pinned kernels by default, the user's settings win,
and every process that computes (the engine, the warm start, Ray ranks) gets the same settings."""

import ast
import json
import os
import subprocess
import sys

import pytest

from rlhf import numerics
from rlhf.provenance import cpu_info, hardware_fingerprint
from tests.conftest import REPO, run_train

HAS_AVX2 = "avx2" in cpu_info()["kernel_flags"]


def test_apply_sets_only_what_the_user_left_unset():
    env = {"MKL_CBWR": "AUTO"}
    added = numerics.apply(env)
    assert env["MKL_CBWR"] == "AUTO"  # the user's value wins
    assert added == {k: v for k, v in numerics.PORTABLE_ENV.items() if k != "MKL_CBWR"}
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert numerics.apply(env) == {}  # idempotent


def test_native_profile_pins_nothing_and_bad_values_are_refused():
    env = {"RLHF_NUMERICS": "native"}
    assert numerics.apply(env) == {} and env == {"RLHF_NUMERICS": "native"}
    assert numerics.pinned_threads(env) is None
    env = {"RLHF_NUMERICS": "avx2"}
    numerics.apply(env)
    assert env["MKL_CBWR"] == "AVX2,STRICT" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert numerics.pinned_threads({}) == numerics.DEFAULT_THREADS
    assert numerics.pinned_threads({"RLHF_CPU_THREADS": "3"}) == 3
    with pytest.raises(numerics.NumericsError,
                       match="RLHF_NUMERICS = 'fast' is invalid: must be one of 'portable', 'avx2', 'native'"):
        numerics.apply({"RLHF_NUMERICS": "fast"})
    with pytest.raises(numerics.NumericsError, match="RLHF_CPU_THREADS = '0' is invalid"):
        numerics.apply({"RLHF_CPU_THREADS": "0"})


def test_bad_profile_is_one_line_exit_2(tmp_path):
    env = dict(os.environ, RLHF_NUMERICS="fast")
    proc = subprocess.run([sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", "--out", str(tmp_path / "run")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: RLHF_NUMERICS = 'fast' is invalid: must be one of "
                                   "'portable', 'avx2', 'native'")


@pytest.mark.skipif(not HAS_AVX2, reason="the portable profile needs AVX2")
def test_torch_takes_the_pinned_kernels_unless_the_user_says_otherwise():
    probe = ("from rlhf import numerics; numerics.apply(); import torch; "
             "print(torch.backends.cpu.get_cpu_capability())")
    env = {k: v for k, v in os.environ.items() if k not in numerics.NUMERIC_ENV}

    def capability(**extra):
        return subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={**env, **extra}, capture_output=True,
                              text=True, check=True, timeout=120).stdout.strip()

    assert capability() == "AVX2"
    assert capability(ATEN_CPU_CAPABILITY="default") == "DEFAULT"


def test_fixed_threads_pins_and_restores(monkeypatch):
    import torch
    monkeypatch.setenv("RLHF_CPU_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with numerics.fixed_threads():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_ray_ranks_receive_the_numerics_settings(monkeypatch):
    from rlhf.placement.cluster import forwarded_env, rank_env
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE,STRICT")
    monkeypatch.setenv("RLHF_NUMERICS", "portable")
    env = rank_env()
    assert env["MKL_CBWR"] == "COMPATIBLE,STRICT" and env["RLHF_NUMERICS"] == "portable"
    assert forwarded_env({"MKL_CBWR": "AVX2", "OMP_NUM_THREADS": "4"}) == {"MKL_CBWR": "AVX2"}


def test_run_provenance_records_the_settings_and_the_machine(tmp_path):
    run_train(["recipes/tiny.gin", "-b", "ppo.total_steps = 1", "-b", "task.eval_size = 16", "--quiet",
               "--out", tmp_path])
    prov = json.loads((tmp_path / "provenance.json").read_text())
    num = prov["numerics"]
    assert num["profile"] == os.environ.get("RLHF_NUMERICS", "portable")
    if num["profile"] == "portable" and HAS_AVX2:
        assert num["torch_cpu_capability"] == "AVX2" and num["env"]["MKL_CBWR"]
    assert num["torch_threads"] == 1  # recipes/models/tiny_llama.gin: ppo.torch_threads = 1
    hw = prov["hardware"]
    assert hw["cpu_info"]["kernel_flags"] == cpu_info()["kernel_flags"]
    assert hw["blas"].get("blas_info")  # e.g. "mkl"
    assert hw["fingerprint"] and hw["fingerprint"] == hardware_fingerprint(prov)


def _calls(attr):
    """(file, line) of every call to `<something>.<attr>(...)` or `<attr>(...)` in the engine."""
    found = []
    for path in sorted((REPO / "rlhf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                owner = getattr(getattr(f, "value", None), "id", None)
                if name == attr and owner not in ("math", "np", "numpy"):  # exact scalar / numpy maths
                    found.append((str(path.relative_to(REPO)), node.lineno))
    return found


def test_every_trained_model_uses_the_engines_fused_adamw():
    # torch's per-tensor AdamW takes its square root from MKL's vector maths, which rounds
    # differently on Intel and AMD CPUs (bench/cpu_numerics.py probe); the fused kernel does not.
    assert [c for c in _calls("AdamW") if c[0] != "rlhf/models.py"] == []
    assert _calls("sqrt") == [], "torch.sqrt on a CPU tensor goes to MKL's vector maths: use rsqrt or a reduction"
    import torch

    from rlhf.models import adamw
    opt = adamw([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    assert opt.defaults["fused"] is True


def test_adamw_steps_like_the_reference_adam_update():
    import torch

    from rlhf.models import adamw
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64).float())
    g = torch.tensor([0.1, -0.3, 0.02])
    opt = adamw([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    m = v = torch.zeros(3, dtype=torch.float64)
    ref = p.detach().double().clone()
    for step in range(1, 4):
        p.grad = g * step
        opt.step()
        gd = (g * step).double()
        ref = ref * (1 - 0.01 * 0.1)
        m, v = 0.9 * m + 0.1 * gd, 0.99 * v + 0.01 * gd * gd
        ref = ref - 0.01 * (m / (1 - 0.9 ** step)) / ((v / (1 - 0.99 ** step)).sqrt() + 1e-8)
    assert torch.allclose(p.detach().double(), ref, rtol=0, atol=1e-6)
