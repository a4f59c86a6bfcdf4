"""The start gate of a shared GPU (rlhf/gpu_gate.py): engines start one at a time, and an engine
that ends waits while another is still starting (vLLM's memory profile would see the freed
memory as its own and fail)."""

import os
import subprocess
import sys
import time
from pathlib import Path

from rlhf import gpu_gate


def test_engines_sharing_a_gpu_start_one_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    first, second, third = (tmp_path / n for n in ("a", "b", "c"))
    assert gpu_gate.wait_to_start(first, 0.6, str(tmp_path)) < 0.3  # nothing started on this GPU lately
    assert 0.5 < gpu_gate.wait_to_start(second, 0.6, str(tmp_path)) < 3  # waits out the gap after the first
    second.mkdir()
    (second / "metrics.jsonl").write_text('{"step": 0}\n')  # the second engine has started up
    assert gpu_gate.wait_to_start(third, 30, str(tmp_path)) < 3  # no need to wait the full gap
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_gate.wait_to_start(first, 30, str(tmp_path)) == 0  # no GPU: no gate
    assert gpu_gate.engine_env(30, str(tmp_path)) == {}


def test_an_ending_engine_waits_while_another_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    ending, starting = tmp_path / "ending", tmp_path / "starting"
    for d in (ending, starting):
        d.mkdir()
    gpu_gate.wait_to_start(ending, 0.8, str(tmp_path))
    env = gpu_gate.engine_env(0.8, str(tmp_path))
    assert env[gpu_gate.GATE_ENV] == str(gpu_gate.gate_path("1", str(tmp_path))) and float(env[gpu_gate.GAP_ENV]) == 0.8
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert gpu_gate.wait_for_starter(ending) == 0  # it started last itself: nobody to wait for
    time.sleep(0.8)
    gpu_gate.wait_to_start(starting, 0.8, str(tmp_path))  # another engine starts now
    assert 0.6 < gpu_gate.wait_for_starter(ending) < 3  # the ending one waits out the other's start
    # It starts again (the gate records it anew); its earlier start's gap is over, so nothing waits.
    assert gpu_gate.wait_to_start(starting, 0.8, str(tmp_path)) < 0.5
    (starting / "metrics.jsonl").write_text('{"step": 0}\n')
    assert gpu_gate.wait_for_starter(ending) < 0.5  # the other has logged a step: its start is over
    monkeypatch.delenv(gpu_gate.GATE_ENV)
    assert gpu_gate.wait_for_starter(ending) == 0  # outside a study nothing waits


def test_the_engine_waits_at_its_end(tmp_path):
    """`python -m rlhf.train` itself waits, after its results are written, while the gate names
    another engine that is starting."""
    gate = tmp_path / "gate.json"
    other = tmp_path / "other"
    other.mkdir()
    out = tmp_path / "run"
    env = dict(os.environ, **{gpu_gate.GATE_ENV: str(gate), gpu_gate.GAP_ENV: "600"})
    cmd = [sys.executable, "-m", "rlhf.train", "recipes/tiny.gin", "-b", "ppo.total_steps = 1",
           "-b", "ppo.eval_every = 1", "-b", "ppo.save_every = 1", "--quiet", "--out", str(out)]
    gate.write_text('{"run_dir": "%s", "time": %r}' % (other, time.time()))
    child = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[2],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "summary.json").exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert (out / "summary.json").exists(), child.communicate()[1][-2000:]
    time.sleep(2)
    assert child.poll() is None  # results written, and still waiting for the other engine's start
    (other / "metrics.jsonl").write_text('{"step": 0}\n')
    assert child.wait(timeout=30) == 0
