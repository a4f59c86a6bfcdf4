"""What every peer benchmark shares: the same inputs, a GPU memory sampler, versions, JSON output.

Inputs (built once per ASSETS directory, reused by every script that names it; one shape per
directory):
- `model/`: the Qwen2.5-0.5B shape (or with `shape='7b'` the Qwen2.5-7B shape) with random
  weights from `bench/gpu_assets.py` (bf16 safetensors), with the full-vocabulary tokenizer
  saved beside it as well: TRL and verl hand vLLM the model directory, so vLLM must find a
  tokenizer there.
- `tokenizer/`: the same tokenizer in its own folder (this engine's `model.tokenizer_path`).
- the tokenizer is a Qwen2 byte-level BPE with no merges and one entry per model id (151,936
  for 0.5B, 152,064 for 7B:
  `<pad>`, `<bos>`, `<eos>`, `<unk>`, the 256 byte symbols, then filler strings), so every
  sampled id decodes, and a prompt of N letters is exactly N tokens (no BOS/EOS added). Its chat
  template emits the messages' content only (verl applies a chat template to every prompt).
- `prompts.jsonl` (`prompt`, `answer`) and `prompts.parquet` (verl's columns): the same
  prompts, each exactly PROMPT_TOKENS tokens.

`check_assets` loads both copies back with AutoTokenizer and fails fast unless a prompt is
exactly PROMPT_TOKENS ids and decodes back to itself.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

PROMPT_TOKENS = 256
RESPONSE_TOKENS = 256
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0, 1, 2, 3: gpu_assets.model_config's pad/bos/eos
N_PROMPTS = 2048


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # content only: no extra tokens
PROMPT_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # one token each (no merges)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 symbols a byte-level BPE vocabulary starts from."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def build_full_vocab_tokenizer(out_dir: str | Path, vocab_size: int):
    """A Qwen2 tokenizer (byte-level BPE, no merges) with exactly `vocab_size` entries.

    Ids 0-3 are `<pad>`, `<bos>`, `<eos>`, `<unk>`; 4-259 the 256 byte symbols; the rest filler
    strings of two or three byte symbols (they only ever come out of sampling and decode to
    bytes). With no merges, a word of N letters encodes to N tokens. It is the Qwen2 class on
    purpose: transformers loads a tokenizer beside a qwen2 `config.json` as `Qwen2Tokenizer`
    whatever `tokenizer_class` says, so it must be one to encode the same in every peer.
    """
    import itertools

    from transformers import Qwen2Tokenizer

    alphabet = _byte_alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for sym in alphabet:
        vocab[sym] = len(vocab)
    fill = itertools.chain(("".join(p) for p in itertools.product(alphabet, repeat=2)),
                           ("".join(p) for p in itertools.product(alphabet, repeat=3)))
    while len(vocab) < vocab_size:
        vocab[next(fill)] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                         pad_token="<pad>")
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = 32768
    tok.save_pretrained(str(out_dir))
    return tok


def prompt_texts(n: int = N_PROMPTS, length: int = PROMPT_TOKENS, seed: int = 0, vocab_size: int = 151936) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PROMPT_CHARS) for _ in range(length)) for _ in range(n)]


def build_inputs(root: str | Path, tiny: bool = False, shape: str = "0.5b") -> dict:
    """Builds (or reuses) the model, tokenizer and prompt files under root; returns their paths.
    shape: '0.5b' or '7b' (bench/gpu_assets.py; the 7B weights are drawn on the GPU)."""
    import shutil

    from gpu_assets import build_assets, model_config

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    assets = build_assets(root, tiny=tiny, shape=shape)  # model/ (random weights) + a char tokenizer we do not use
    model_dir = Path(assets["model_dir"])
    tok_dir = root / "tokenizer_full"
    vocab = model_config(tiny, shape).vocab_size
    if not (tok_dir / "tokenizer.json").is_file():
        build_full_vocab_tokenizer(tok_dir, vocab)
    for f in tok_dir.iterdir():  # the same tokenizer beside the weights, for TRL's and verl's vLLM
        shutil.copy(f, model_dir / f.name)
    length = 16 if tiny else PROMPT_TOKENS
    prompts = prompt_texts(N_PROMPTS, length, vocab_size=vocab)
    jsonl = root / "prompts.jsonl"
    if not jsonl.is_file():
        with open(jsonl, "w") as f:
            for i, p in enumerate(prompts):
                f.write(json.dumps({"prompt": p, "answer": PROMPT_CHARS[i % 10]}) + "\n")
    out = {"root": str(root), "model_dir": str(model_dir), "tokenizer_dir": str(tok_dir),
           "prompts_jsonl": str(jsonl), "prompt_tokens": length, "vocab_size": vocab,
           "shape": "tiny" if tiny else shape}
    return out


def write_verl_parquet(path: str | Path, prompts: list[str], data_source: str = "peer_bench",
                       ability: str = "bench", answers: list[str] | None = None) -> str:
    """verl's RL dataset columns: data_source, prompt (chat messages), ability, reward_model.ground_truth
    (`answers`, default 'a'), extra_info. `data_source='openai/gsm8k'`, `ability='math'` and numeric
    answers make GSM8K rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    answers = answers if answers is not None else ["a"] * len(prompts)
    rows = [{"data_source": data_source, "prompt": [{"role": "user", "content": p}], "ability": ability,
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
            for i, (p, a) in enumerate(zip(prompts, answers))]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def check_assets(inputs: dict) -> None:
    """Fails fast unless both tokenizer copies load as the word-level tokenizer with exact lengths."""
    from transformers import AutoTokenizer

    p = prompt_texts(1, inputs["prompt_tokens"], vocab_size=inputs["vocab_size"])[0]
    for d in (inputs["tokenizer_dir"], inputs["model_dir"]):
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        ids = tok(p, add_special_tokens=True)["input_ids"]
        if len(ids) != inputs["prompt_tokens"] or len(tok) != inputs["vocab_size"]:
            raise SystemExit(f"tokenizer in {d} ({type(tok).__name__}) gives {len(ids)} ids for a "
                             f"{inputs['prompt_tokens']}-word prompt, vocabulary {len(tok)}")
        if tok.decode(ids) != p or tok.eos_token_id != 2 or tok.pad_token_id != 0:
            raise SystemExit(f"tokenizer in {d} does not round-trip or has other special ids")


def process_name(pid: int, width: int = 160) -> str | None:
    """The command line of process `pid` as one string (cut to `width`), or None where this process
    cannot see it (NVML may report the host's pids inside a container)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:width] or None


def parse_compute_apps(text: str) -> list[tuple[int, float]]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` as (pid, MiB)."""
    out = []
    for line in text.strip().splitlines():
        pid, _, mib = line.partition(",")
        try:
            out.append((int(pid), float(mib)))
        except ValueError:  # "[N/A]" where the driver does not say
            continue
    return out


class GPUMemorySampler:
    """Peak GPU memory in use on the device (NVML or nvidia-smi), sampled every `period` s.

    It sees every process (vLLM's reservation, Ray workers), so it is the figure comparable
    across peers; torch.cuda.max_memory_allocated only sees the calling process's allocator.
    At each new peak it also notes when (`peak_at`, time.perf_counter) and which processes held
    the device (`peak_processes`: pid, MiB, command line), so a peak above a run's own allocation
    can be traced to its process and phase.
    """

    def __init__(self, period: float = 0.5):
        self.period, self.peak_mib, self.source = period, 0.0, None
        self.peak_at: float | None = None
        self.peak_processes: list[dict] = []
        self._stop = threading.Event()
        self._read, self._apps = self._reader()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _reader(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.source = "nvml"
            return (lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
                    lambda: [(p.pid, (p.usedGpuMemory or 0) / 2**20)
                             for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)])
        except Exception:
            pass

        def smi(*query):
            return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits", "-i", "0"],
                                  capture_output=True, text=True, timeout=10).stdout

        def used():
            return float(smi("--query-gpu=memory.used").strip().splitlines()[0])

        try:
            used()
            self.source = "nvidia-smi"
            return used, lambda: parse_compute_apps(smi("--query-compute-apps=pid,used_memory"))
        except Exception:
            return None, None

    def _run(self):
        while not self._stop.is_set():
            try:
                used = self._read()
                if used > self.peak_mib:
                    self.peak_mib, self.peak_at = used, time.perf_counter()
                    self.peak_processes = [{"pid": pid, "mib": round(mib, 1), "command": process_name(pid)}
                                           for pid, mib in self._apps()]
            except Exception:
                pass
            self._stop.wait(self.period)

    def start(self):
        if self._read is not None:
            self._thread.start()
        return self

    def reset(self):
        self.peak_mib, self.peak_at, self.peak_processes = 0.0, None, []

    def stop(self):
        self._stop.set()

    @property
    def peak_gb(self):
        return self.peak_mib / 1024 if self._read is not None else None


def versions(*names: str) -> dict:
    from importlib import metadata
    out = {"python": platform.python_version()}
    for n in ("torch", "transformers", "accelerate", "vllm", "ray", *names):
        try:
            out[n] = metadata.version(n)
        except Exception:
            out[n] = None
    try:
        import torch
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    try:  # the content of the engine's files, as the manager's run hash reads it: right whatever .git says
        from experiments.plan import code_version
        out["engine_sha256"] = code_version()["engine_sha256"]
    except Exception:
        out["engine_sha256"] = None
    # The device's copy of the tree may carry a stale .git: ENGINE_COMMIT, set by whoever sends the
    # command (`ENGINE_COMMIT=$(git rev-parse HEAD)` here), names the tree's commit; else git's HEAD.
    out["engine_git"] = os.environ.get("ENGINE_COMMIT") or None
    if out["engine_git"] is None:
        try:
            out["engine_git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                               text=True, timeout=10).stdout.strip() or None
        except Exception:
            out["engine_git"] = None
    return out


def command_line(argv=None) -> str:
    args = sys.argv if argv is None else [sys.argv[0], *argv]
    script = os.path.relpath(os.path.abspath(args[0]), REPO) if args and args[0].endswith(".py") else args[0]
    return "python " + " ".join(shlex.quote(a) for a in [script, *args[1:]])


def run_plan(run_dir: str | Path) -> dict:
    """The GPU and the memory plan a `python -m rlhf.train` run recorded (its provenance.json): what it
    takes to recompute the plan of the run's recipe file on the same GPU. Nones where the run recorded
    none (a CPU run, or one stopped before its start was written)."""
    path = Path(run_dir) / "provenance.json"
    provenance = json.loads(path.read_text()) if path.is_file() else {}
    predicted = (provenance.get("placement") or {}).get("memory_predicted") or {}
    return {"gpu_total_gib": (provenance.get("hardware") or {}).get("gpu_memory_gb"),
            "gpu_available_gib": predicted.get("available_gb"),
            "longest_prompt": (predicted.get("settings") or {}).get("prompt_tokens"),  # the data's, as measured
            "memory_plan_verdict": predicted.get("verdict")}


def summarize(step_times: list[float], warmup: int) -> dict:
    import statistics
    timed = step_times[warmup:]
    return {"warmup_steps": warmup, "timed_steps": len(timed), "all_step_s": step_times,
            "median_step_s": statistics.median(timed) if timed else None,
            "mean_step_s": statistics.mean(timed) if timed else None}


def write_json(path: str | Path, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def now() -> float:
    return time.perf_counter()
