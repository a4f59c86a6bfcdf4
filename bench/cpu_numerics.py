"""Benchmark: do CPU runs give the same numbers on another machine, and at what cost?

    python bench/cpu_numerics.py [--steps 30] [--settings portable,native,...] [--json PATH]
    python bench/cpu_numerics.py compare A.json B.json
    python bench/cpu_numerics.py probe [--settings portable,avx2,native] [--out DIR]
    python bench/cpu_numerics.py probe-compare DIR_A DIR_B
    python bench/cpu_numerics.py demo [--steps 50] [--json PATH]
    python bench/cpu_numerics.py demo-compare A.json B.json

Default mode: for each named setting of the CPU numerics (rlhf/numerics.py), runs `python -m
rlhf.train recipes/tiny.gin -b 'ppo.total_steps = N'` on the CPU with a fresh cache (so the SFT warm
start is built under the same setting) and records: the sha256 of metrics.jsonl without its timing
and perf fields (the numeric path of the whole run), the SFT warm start's and the final checkpoint's
hashes, the seconds per PPO step (median) and of the SFT build, the settings in force and the
machine's fingerprint (rlhf.provenance). `compare` lines up two such files (two machines) and says,
setting by setting, whether the numbers agree.

`probe` finds where two machines part: per setting, in a fresh process, it saves every output of
each stage of the embedded default on fixed inputs (data, token ids, torch's RNG, the initial
weights, single ops: matmuls, softmax, SDPA, the unary ops ATen hands to MKL's vector maths, AdamW op
by op and its three implementations, sampling; then one forward and backward, and SFT after 1, 10
and all steps). `probe-compare` names, stage by stage, the outputs that differ and by how many ulps
(from the JSON hashes alone when the .npz files are not there).

`demo` runs the demo pipeline's numeric chain (dvc.yaml's data, sft and rm stages, then PPO of
recipes/demo.gin against that reward model) in a scratch directory and hashes each stage's output:
what a fresh clone's `dvc repro` on that machine would give, without DVC and the study layer.

On the GPU machine's CPU (Python 3.12, torch 2.11, transformers 5.17; no gin, rich or pydantic):
carry them and hide the GPU:
    echo '/.carry/' >> .git/info/exclude
    pip download --no-deps gin-config==0.5.0 rich markdown-it-py mdurl pygments -d .carry
    pip install --target .carry/site --python-version 3.12 --platform manylinux2014_x86_64 \
        --only-binary=:all: --implementation cp pydantic
    device run, carry [".carry"]: export PYTHONPATH=$(ls $PWD/.carry/*.whl | tr '\n' ':')$PWD/.carry/site;
        python3 bench/cpu_numerics.py demo --json $OUT/demo.json   (or probe --out $OUT/probe, or the default mode)
and on this machine the same under torch 2.11 (a venv with torch==2.11.0 and transformers==5.17.0).
Results: bench/results/cpu_numerics_*_{epyc,xeon_h200host}_torch211.json and cpu_probe_*/.
Not a test: figures go to stdout and the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rlhf.metrics import read_metrics  # noqa: E402  (joins perf.jsonl's timings back by step)

# name -> environment; every setting starts from an environment without numerics variables.
SETTINGS = {
    "portable": {},  # the engine's default profile
    "avx2": {"RLHF_NUMERICS": "avx2"},  # MKL's AVX2 branch: free, reproducible across Intel CPUs
    "native": {"RLHF_NUMERICS": "native"},
    "native_threads1": {"RLHF_NUMERICS": "native", "RLHF_CPU_THREADS": "1"},  # native kernels, portable's thread count
    "native_aten_avx2": {"RLHF_NUMERICS": "native", "ATEN_CPU_CAPABILITY": "avx2"},
    "native_mkl_compatible": {"RLHF_NUMERICS": "native", "MKL_CBWR": "COMPATIBLE"},
    "aten_avx2_mkl_avx2": {"RLHF_NUMERICS": "native", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
    "portable_mkl_nonstrict": {"MKL_CBWR": "COMPATIBLE"},
    "portable_threads2": {"RLHF_CPU_THREADS": "2", "@bindings": ["ppo.torch_threads = 2"]},
    "aten_default_mkl_compatible": {"RLHF_NUMERICS": "native", "ATEN_CPU_CAPABILITY": "default",
                                    "MKL_CBWR": "COMPATIBLE"},
}
DEFAULT_SETTINGS = "portable,avx2,native,native_aten_avx2,native_mkl_compatible"


def _children_cpu() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def weights_sha256(model_dir: Path) -> str:
    """sha256 over a checkpoint's tensors (names, dtypes, shapes, bytes): unlike the directory hash,
    blind to the library versions written into config.json and the safetensors header."""
    from safetensors.numpy import load_file
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        for name in sorted(tensors):
            t = tensors[name]
            h.update(f"{name}:{t.dtype}:{t.shape}".encode() + t.tobytes())
    return h.hexdigest()


def metrics_sha256(path: Path) -> str:
    """sha256 of metrics.jsonl with timing_s/ and perf/ fields dropped (they vary run to run)."""
    h = hashlib.sha256()
    for line in path.read_text().splitlines():
        if line.strip():
            rec = {k: v for k, v in json.loads(line).items() if not k.startswith(("timing_s/", "perf/"))}
            h.update(json.dumps(rec, sort_keys=True).encode() + b"\n")
    return h.hexdigest()


def run_setting(name: str, steps: int, recipe: str, extra_bindings: list) -> dict:
    from rlhf.numerics import NUMERIC_ENV
    from rlhf.provenance import hash_directory
    spec = dict(SETTINGS[name])
    bindings = spec.pop("@bindings", [])
    env = {k: v for k, v in os.environ.items() if k not in NUMERIC_ENV}
    env.update(spec)
    env.update(CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAY_USAGE_STATS_ENABLED="0")
    with tempfile.TemporaryDirectory(prefix=f"cpu_numerics_{name}_") as tmp:
        env["RLHF_CACHE"] = str(Path(tmp) / "cache")
        out = Path(tmp) / "run"
        argv = [sys.executable, "-m", "rlhf.train", recipe, "--quiet", "--out", str(out),
                "-b", f"ppo.total_steps = {steps}", "-b", f"ppo.save_every = {steps}",
                *[x for b in bindings + extra_bindings for x in ("-b", b)]]
        start, cpu_start = time.perf_counter(), _children_cpu()
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - start, _children_cpu() - cpu_start
        if proc.returncode != 0:
            return {"setting": name, "error": proc.stderr.strip().splitlines()[-1:], "exit_code": proc.returncode}
        records = read_metrics(out / "metrics.jsonl")  # joined with perf.jsonl's timings
        sft_root = next(Path(env["RLHF_CACHE"]).glob("tiny-*/sft_info.json")).parent
        prov = json.loads((out / "provenance.json").read_text())
        summary = json.loads((out / "summary.json").read_text())
        step_times = [r["timing_s/step"] for r in records if "timing_s/step" in r]
        return {
            "setting": name, "env": spec, "bindings": bindings + extra_bindings, "steps": steps,
            "metrics_sha256": metrics_sha256(out / "metrics.jsonl"),
            "sft_sha256": hash_directory(sft_root / "sft_model"),
            "sft_weights_sha256": weights_sha256(sft_root / "sft_model"),
            "final_actor_weights_sha256": weights_sha256(out / "checkpoints" / f"step_{steps}" / "actor"),
            "final_checkpoint_sha256": hash_directory(out / "checkpoints" / f"step_{steps}"),
            "seconds_per_step_median": statistics.median(step_times),
            "seconds_per_step_mean": statistics.fmean(step_times),
            "sft_seconds": json.loads((sft_root / "sft_info.json").read_text())["seconds"],
            "wall_s": wall,
            "cpu_s": cpu,  # user + system CPU seconds of the whole run: steadier than wall time on a busy machine
            "initial": summary["initial"], "final": summary["final"],
            "numerics": prov.get("numerics"),
            "fingerprint": prov.get("hardware", {}).get("fingerprint"),
        }


def machine() -> dict:
    from rlhf.provenance import hardware, hardware_fingerprint, package_versions
    info = hardware()
    return {"hardware": info, "fingerprint": hardware_fingerprint({"hardware": info}),
            "versions": package_versions()}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    print(f"A: {a['machine']['fingerprint']}  torch {a['machine']['versions'].get('torch')}")
    print(f"B: {b['machine']['fingerprint']}  torch {b['machine']['versions'].get('torch')}")
    by_name = {r["setting"]: r for r in b["results"]}
    same_all = True
    for ra in a["results"]:
        rb = by_name.get(ra["setting"])
        if rb is None or "error" in ra or "error" in rb:
            print(f"{ra['setting']:30s} not comparable")
            continue
        # Weights where both files have them (library versions change config.json, not the numbers).
        sft = "sft_weights_sha256" if "sft_weights_sha256" in ra and "sft_weights_sha256" in rb else "sft_sha256"
        final = ("final_actor_weights_sha256"
                 if "final_actor_weights_sha256" in ra and "final_actor_weights_sha256" in rb
                 else "final_checkpoint_sha256")
        same = {k: ra[k] == rb[k] for k in (sft, "metrics_sha256", final)}
        same_all &= all(same.values())
        print(f"{ra['setting']:30s} sft {'same' if same[sft] else 'DIFFERS'}, metrics "
              f"{'same' if same['metrics_sha256'] else 'DIFFER'}, final weights "
              f"{'same' if same[final] else 'DIFFER'}; s/step A {ra['seconds_per_step_median']:.3f} "
              f"B {rb['seconds_per_step_median']:.3f}, cpu s A {ra.get('cpu_s', float('nan')):.1f} "
              f"B {rb.get('cpu_s', float('nan')):.1f}")
    return 0 if same_all else 1


PROBE_SETTINGS = "portable,avx2,native"


def _fixed(shape, seed, scale=64.0):
    """Inputs that are the same bits on every machine: small integers over a power of two (numpy's
    PCG64 integers are specified exactly; no libm, no vector RNG kernel involved)."""
    import numpy as np
    import torch
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(-256, 257, size=shape).astype(np.float32) / np.float32(scale))


def probe_worker(out_npz: str) -> None:
    """In a process whose numerics variables are set: computes each stage of the embedded default
    on fixed inputs (data, RNG, single ops, one forward/backward, SFT steps) and saves every output,
    so two machines' files show the first stage at which they part."""
    from rlhf import numerics
    numerics.apply()
    import numpy as np
    import torch
    import torch.nn.functional as F

    from rlhf.config import SFTConfig, TaskConfig, TinyModelConfig
    from rlhf.data import load_task
    from rlhf.tiny import build_char_tokenizer, build_tiny_model, sft_batch, train_sft

    numerics.set_threads()
    out: dict = {}

    def put(name, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().contiguous().numpy().copy()
        out[name] = np.asarray(value)

    task, tiny = TaskConfig(), TinyModelConfig()
    train, held_out = load_task(task)
    put("data/train", np.frombuffer(json.dumps([[e.prompt, e.answer] for e in train]).encode(), dtype=np.uint8))
    put("data/eval", np.frombuffer(json.dumps([[e.prompt, e.answer] for e in held_out]).encode(), dtype=np.uint8))
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_char_tokenizer(tmp)
    put("data/token_ids", np.array(sum((tok(e.prompt)["input_ids"] for e in train[:256]), []), dtype=np.int64))
    torch.manual_seed(0)
    put("rng/randn", torch.randn(4099))
    put("rng/rand", torch.rand(4099))
    put("rng/normal_inplace", torch.empty(64, 129).normal_(0.0, 0.02))

    a, b, c = _fixed((640, 64), 1), _fixed((64, 256), 2), _fixed((256, 64), 3)
    w, bias = _fixed((88, 64), 4), _fixed((88,), 5)
    put("op/matmul_640x64x256", a @ b)
    put("op/matmul_640x256x64", (a @ b) @ c)
    put("op/linear_bias", F.linear(a, w, bias))
    put("op/matmul_t", a.t() @ a)
    put("op/bmm", torch.bmm(a.view(10, 64, 64), a.view(10, 64, 64).transpose(1, 2)))
    x = _fixed((64, 88), 6)
    put("op/exp", torch.exp(x))
    put("op/log", torch.log(x.abs() + 1))
    put("op/tanh", torch.tanh(x))
    put("op/sigmoid", torch.sigmoid(x))
    put("op/silu", F.silu(x))
    put("op/rsqrt", torch.rsqrt(x.abs() + 1))
    put("op/pow", torch.pow(x, 2))
    put("op/softmax", torch.softmax(x, dim=-1))
    put("op/log_softmax", torch.log_softmax(x, dim=-1))
    put("op/sum_all", _fixed((100003,), 7, scale=1000.0).sum())
    put("op/mean_dim", x.pow(2).mean(-1, keepdim=True))
    put("op/cross_entropy", F.cross_entropy(x, torch.arange(64) % 88))
    q, k, v = (_fixed((8, 4, 24, 16), s) for s in (8, 9, 10))
    put("op/sdpa_causal", F.scaled_dot_product_attention(q, k, v, is_causal=True))
    put("op/sdpa_plain", torch.softmax((q @ k.transpose(-1, -2)) / 4.0, dim=-1) @ v)
    p = torch.nn.Parameter(_fixed((64, 64), 11))
    p.grad = _fixed((64, 64), 12, scale=4096.0)
    torch.optim.AdamW([p], lr=3e-3, weight_decay=0.0).step()
    put("op/adamw_step", p)

    # AdamW's step, op by op (torch.optim's single-tensor path on CPU), and its other implementations.
    g = _fixed((4099,), 13, scale=4096.0)
    v = g * g * 0.001
    put("adam/py_scalars", np.array([(1 - 0.999) ** 0.5, (1 - 0.999 ** 2) ** 0.5, 3e-3 / (1 - 0.9)], dtype=np.float64))
    put("adam/lerp", torch.zeros_like(g).lerp_(g, 1 - 0.9))
    put("adam/addcmul", torch.zeros_like(g).mul_(0.999).addcmul_(g, g, value=1 - 0.999))
    put("adam/sqrt", v.sqrt())
    put("adam/div_scalar", v.sqrt() / (1 - 0.999) ** 0.5)
    put("adam/add_scalar", (v.sqrt() / (1 - 0.999) ** 0.5).add_(1e-8))
    put("adam/addcdiv", _fixed((4099,), 14).addcdiv_(g * 0.1, (v.sqrt() / (1 - 0.999) ** 0.5).add_(1e-8), value=-0.03))
    for impl in ("single", "foreach", "fused"):
        prm = torch.nn.Parameter(_fixed((4099,), 14))
        opt = torch.optim.AdamW([prm], lr=3e-3, weight_decay=0.0, foreach=impl == "foreach",
                                fused=impl == "fused" or None)
        for step in range(3):
            prm.grad = _fixed((4099,), 20 + step, scale=4096.0)
            opt.step()
        put(f"adam/adamw_{impl}", prm)
    # The unary ops ATen hands to MKL's vector maths (VML, in its high-accuracy mode), on inputs spread
    # over their domains (exact float32s: random mantissas and exponents), at a long and short length.
    def spread(seed, lo_exp, hi_exp, signed, n=65537):
        rng = np.random.default_rng(seed)
        m = rng.integers(0, 2 ** 23, size=n).astype(np.float64) / 2.0 ** 23 + 1.0
        x = np.ldexp(m, rng.integers(lo_exp, hi_exp + 1, size=n))
        if signed:
            x = x * np.where(rng.integers(0, 2, size=n) == 1, 1.0, -1.0)
        return torch.from_numpy(x.astype(np.float32))
    domains = {"sqrt": (-30, 30, False), "exp": (-10, 4, True), "log": (-30, 30, False), "tanh": (-10, 3, True),
               "sin": (-10, 6, True), "cos": (-10, 6, True), "erf": (-10, 2, True), "log2": (-30, 30, False),
               "expm1": (-10, 4, True), "log1p": (-30, 30, False), "sigmoid": (-10, 4, True),
               "rsqrt": (-30, 30, False)}
    for i, (op, (lo, hi, signed)) in enumerate(domains.items()):
        x = spread(100 + i, lo, hi, signed)
        put(f"vml/{op}", getattr(torch, op)(x))
        put(f"vml/{op}_short", torch.stack([getattr(torch, op)(x[j:j + 7]) for j in range(0, 700, 7)]))
    # Sampling as the rollout does it (softmax, top-p's sort and cumsum, multinomial) and the RNG kernels behind it.
    logits = _fixed((64, 88), 15, scale=16.0)
    torch.manual_seed(1)
    put("sample/multinomial", torch.multinomial(torch.softmax(logits, -1), 1))
    sorted_logits, _ = torch.sort(logits, descending=True)
    put("sample/top_p_cumsum", torch.softmax(sorted_logits, -1).cumsum(-1))
    torch.manual_seed(2)
    put("sample/exponential", torch.empty(4099).exponential_())
    put("sample/bernoulli", torch.bernoulli(torch.full((4099,), 0.3)))
    put("sample/randperm", torch.randperm(4099))

    sft = SFTConfig()
    model = build_tiny_model(tiny, tok, seed=sft.seed)
    for name, t in sorted(model.state_dict().items()):
        put(f"init/{name}", t)
    ids, mask, labels = sft_batch(train[:64], tok)
    model.train()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    put("fwd/loss", loss)
    loss.backward()
    for name, prm in sorted(model.named_parameters()):
        put(f"grad/{name}", prm.grad)
    put("grad/clip_norm", torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    for steps in (1, 10, sft.steps):
        m = build_tiny_model(tiny, tok, seed=sft.seed)
        losses = train_sft(m, tok, train, dataclasses.replace(sft, steps=steps), log=lambda *_: None)
        put(f"sft{steps}/losses", np.array(losses, dtype=np.float64))
        for name, t in sorted(m.state_dict().items()):
            put(f"sft{steps}/{name}", t)
    put("meta/settings", np.frombuffer(json.dumps(numerics.settings(), default=str).encode(), dtype=np.uint8))
    np.savez(out_npz, **out)


def probe(settings: str, out_dir: str) -> int:
    """Runs probe_worker once per setting (each in its own process, its variables set before torch
    loads) and writes OUT_DIR/probe_<setting>.npz plus OUT_DIR/probe.json (machine, hashes)."""
    from rlhf.numerics import NUMERIC_ENV
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(), "results": {}}
    for name in [s.strip() for s in settings.split(",") if s.strip()]:
        spec = {k: v for k, v in SETTINGS[name].items() if not k.startswith("@")}
        env = {k: v for k, v in os.environ.items() if k not in NUMERIC_ENV}
        env.update(spec, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        path = Path(out_dir) / f"probe_{name}.npz"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "_probe-worker", str(path)], cwd=REPO, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: failed: {proc.stderr.strip().splitlines()[-1:]}")
            report["results"][name] = {"error": proc.stderr[-2000:]}
            continue
        import numpy as np
        arrays = np.load(path)
        report["results"][name] = {"seconds": time.perf_counter() - start,
                                   "sha256": {k: hashlib.sha256(arrays[k].tobytes()).hexdigest() for k in arrays.files
                                              if not k.startswith("meta/")}}
        print(f"{name}: {len(arrays.files)} outputs in {time.perf_counter() - start:.1f} s")
    (Path(out_dir) / "probe.json").write_text(json.dumps(report, indent=1))
    return 0


def probe_compare(a_dir: str, b_dir: str) -> int:
    """Lines up two probe directories: per setting, each stage's outputs equal or, where they part,
    the largest difference in units of the values' spacing (ulps)."""
    import numpy as np
    a_rep, b_rep = (json.loads((Path(d) / "probe.json").read_text()) for d in (a_dir, b_dir))
    print(f"A: {a_rep['machine']['fingerprint']}  python {a_rep['machine']['versions'].get('python')} "
          f"numpy {a_rep['machine']['versions'].get('numpy')} torch {a_rep['machine']['versions'].get('torch')}")
    print(f"B: {b_rep['machine']['fingerprint']}  python {b_rep['machine']['versions'].get('python')} "
          f"numpy {b_rep['machine']['versions'].get('numpy')} torch {b_rep['machine']['versions'].get('torch')}")
    all_same = True
    for name in a_rep["results"]:
        pa, pb = Path(a_dir) / f"probe_{name}.npz", Path(b_dir) / f"probe_{name}.npz"
        ha, hb = a_rep["results"][name].get("sha256"), b_rep["results"].get(name, {}).get("sha256")
        if not (ha and hb):
            print(f"{name}: not on both")
            continue
        if not (pa.is_file() and pb.is_file()):  # only the JSONs (as committed): equal or not, no ulps
            differ = sorted(k for k in ha if ha[k] != hb.get(k))
            all_same &= not differ
            print(f"{name}: {len(ha)} outputs, {len(differ)} differ{': ' if differ else ''}{', '.join(differ)}")
            continue
        a, b = np.load(pa), np.load(pb)
        differ = []
        for key in a.files:
            if key.startswith("meta/"):
                continue
            x, y = a[key], b[key]
            if x.shape != y.shape or x.tobytes() != y.tobytes():
                if x.dtype.kind == "f" and x.shape == y.shape:
                    ulp = np.spacing(np.maximum(np.abs(x), np.abs(y))).astype(np.float64)
                    worst = float(np.max(np.abs(x.astype(np.float64) - y) / np.where(ulp > 0, ulp, 1)))
                    frac = float(np.mean(x != y))
                    differ.append(f"{key} ({frac:.0%} of values, up to {worst:.0f} ulp)")
                else:
                    differ.append(f"{key} (shape/bytes)")
        all_same &= not differ
        stages = sorted({k.split("/")[0] for k in a.files if not k.startswith("meta/")})
        print(f"{name}: {len(a.files) - 1} outputs, {len(differ)} differ")
        for stage in stages:
            bad = [d for d in differ if d.startswith(stage + "/")]
            verdict = "same" if not bad else "DIFFERS: " + "; ".join(bad[:6]) + (" ..." if len(bad) > 6 else "")
            print(f"  {stage:8s} {verdict}")
    return 0 if all_same else 1


def demo_chain(steps: int, out_json: str) -> int:
    """The demo pipeline's numeric chain (dvc.yaml's data, sft and rm stages, then one PPO run of
    recipes/demo.gin against that reward model) in a scratch directory under the default numerics,
    without DVC or the study layer (which run the same commands); records each stage's hash, so two
    machines' files say whether a fresh clone's `dvc repro` there gives the committed figures."""
    from rlhf.numerics import NUMERIC_ENV
    env = {k: v for k, v in os.environ.items() if k not in NUMERIC_ENV}
    env.update(CUDA_VISIBLE_DEVICES="", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    import yaml
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    py = sys.executable
    # dvc.yaml's own commands (its rm stage is two: the pairs, then the reward model), run from a
    # scratch directory that sees the repository's recipes; then one PPO run of the demo recipe.
    commands = [("data", stages["data"]["cmd"]), ("sft", stages["sft"]["cmd"]),
                *zip(("rm_pairs", "rm"), stages["rm"]["cmd"].split(" && ")),
                ("ppo", f"python -m rlhf.train recipes/demo.gin --quiet --out run -b 'ppo.total_steps = {steps}' "
                        f"-b 'ppo.save_every = {steps}'")]
    commands = [(name, cmd.replace("python ", f"{py} ", 1)) for name, cmd in commands]
    report = {"machine": machine(), "steps": steps, "stages": {}}
    with tempfile.TemporaryDirectory(prefix="cpu_numerics_demo_") as tmp:
        env["RLHF_CACHE"] = str(Path(tmp) / "cache")
        (Path(tmp) / "recipes").symlink_to(REPO / "recipes")
        for name, cmd in commands:
            start = time.perf_counter()
            proc = subprocess.run(cmd, shell=True, cwd=tmp, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                report["stages"][name] = {"error": proc.stderr[-2000:], "exit_code": proc.returncode}
                print(f"{name}: failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
                break
            root = Path(tmp)
            if name in ("data", "rm_pairs"):
                d = root / ("data/arithmetic" if name == "data" else "data/rm_pairs")
                digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.jsonl"))}
            elif name == "sft":
                digest = {"weights": weights_sha256(root / "models/sft/model")}
            elif name == "rm":
                digest = {"weights": weights_sha256(root / "models/rm")}
            else:
                records = [json.loads(x) for x in (root / "run/metrics.jsonl").read_text().splitlines() if x.strip()]
                final = json.loads((root / "run/summary.json").read_text())["final"]
                digest = {"metrics": metrics_sha256(root / "run/metrics.jsonl"),
                          "final_actor_weights": weights_sha256(root / "run/checkpoints" / f"step_{steps}" / "actor"),
                          "final": final, "records": len(records)}
            report["stages"][name] = {"seconds": time.perf_counter() - start, **digest}
            print(f"{name:8s} {time.perf_counter() - start:6.1f} s  " +
                  " ".join(f"{k} {v[:12]}" for k, v in digest.items() if isinstance(v, str)))
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(report, indent=1))
    return 0 if all("error" not in v for v in report["stages"].values()) else 1


def demo_compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    print(f"A: {a['machine']['fingerprint']}\nB: {b['machine']['fingerprint']}")
    same_all = True
    for name, sa in a["stages"].items():
        sb = b["stages"].get(name, {})
        keys = [k for k, v in sa.items() if isinstance(v, str) and k != "error"]
        same = bool(keys) and all(sa.get(k) == sb.get(k) for k in keys) and "error" not in sb
        same_all &= same
        print(f"{name:8s} {'same' if same else 'DIFFERS'} ({', '.join(keys)})")
    return 0 if same_all else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        return compare(*argv[1:3])
    if argv[:1] == ["_probe-worker"]:
        probe_worker(argv[1])
        return 0
    if argv[:1] == ["probe"]:
        p = argparse.ArgumentParser(prog="cpu_numerics.py probe")
        p.add_argument("--settings", default=PROBE_SETTINGS)
        p.add_argument("--out", default=str(REPO / "bench" / "results" / "cpu_probe"))
        args = p.parse_args(argv[1:])
        return probe(args.settings, args.out)
    if argv[:1] == ["probe-compare"]:
        return probe_compare(*argv[1:3])
    if argv[:1] == ["demo"]:
        p = argparse.ArgumentParser(prog="cpu_numerics.py demo")
        p.add_argument("--steps", type=int, default=50)
        p.add_argument("--json", default=str(REPO / "bench" / "results" / "cpu_numerics_demo.json"))
        args = p.parse_args(argv[1:])
        return demo_chain(args.steps, args.json)
    if argv[:1] == ["demo-compare"]:
        return demo_compare(*argv[1:3])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--recipe", default="recipes/tiny.gin")
    p.add_argument("-b", "--binding", action="append", default=[])
    p.add_argument("--json", default=str(REPO / "bench" / "results" / "cpu_numerics.json"))
    args = p.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"error: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    report = {"machine": machine(), "recipe": args.recipe, "steps": args.steps, "results": []}
    print(f"machine: {report['machine']['fingerprint']}")
    for name in names:
        r = run_setting(name, args.steps, args.recipe, args.binding)
        report["results"].append(r)
        if "error" in r:
            print(f"{name:30s} failed: {r['error']}")
        else:
            print(f"{name:30s} sft {r['sft_sha256'][:12]} metrics {r['metrics_sha256'][:12]} "
                  f"{r['seconds_per_step_median']:.3f} s/step (mean {r['seconds_per_step_mean']:.3f}), "
                  f"sft {r['sft_seconds']:.1f} s, cpu {r['cpu_s']:.1f} s, "
                  f"eval/accuracy {r['initial']['eval/accuracy']:.4f} -> "
                  f"{r['final']['eval/accuracy']:.4f}")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
