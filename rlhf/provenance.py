"""What a run depends on: code version, library versions, hardware, data and checkpoint hashes."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

from rlhf import numerics

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "ray", "vllm", "gin-config", "numpy",
            "scipy", "wandb", "dvc")


def run_git(*args: str, cwd: Path = REPO_ROOT) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def git_info(root: Path = REPO_ROOT) -> Dict:
    """SHA, dirty flag and the diff of tracked files (untracked files are listed, not diffed)."""
    sha = run_git("rev-parse", "HEAD", cwd=root)
    if sha is None:
        return {"sha": None, "dirty": None, "diff": None, "diff_sha256": None}
    diff = run_git("diff", "HEAD", "--", ".", cwd=root) or ""
    untracked = (run_git("ls-files", "--others", "--exclude-standard", cwd=root) or "").split()
    return {"sha": sha.strip(), "dirty": bool(diff.strip()), "diff": diff,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest(), "untracked": untracked[:200]}


def package_versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# CPU features that route torch, MKL or oneDNN to other kernels (and so to other rounding).
KERNEL_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
                "amx_fp16")


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> Dict:
    """The CPU's vendor, model and the ISA flags that change kernels (Linux /proc/cpuinfo; elsewhere
    what `platform` knows)."""
    info: Dict = {"arch": platform.machine(), "vendor": None, "model_name": platform.processor() or None,
                  "family": None, "model": None, "stepping": None, "microcode": None, "kernel_flags": []}
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return info
    first = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        first[key.strip()] = value.strip()
    info.update(vendor=first.get("vendor_id"), model_name=first.get("model name") or info["model_name"],
                family=first.get("cpu family"), model=first.get("model"), stepping=first.get("stepping"),
                microcode=first.get("microcode"))
    flags = set(first.get("flags", "").split())
    info["kernel_flags"] = [f for f in KERNEL_FLAGS if f in flags]
    return info


def blas_info() -> Dict:
    """torch's BLAS and oneDNN builds and ISA (torch.__config__), and the thread pools in use
    (threadpoolctl, when installed)."""
    out: Dict = {}
    try:
        import torch
        show = torch.__config__.show()
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["mkl_available"] = torch.backends.mkl.is_available()
        out["mkldnn_available"] = torch.backends.mkldnn.is_available()
        for line in show.splitlines():
            line = line.strip(" -")
            if "Math Kernel Library" in line or line.startswith("Intel(R) MKL-DNN") or line.startswith("OpenMP"):
                out.setdefault("libraries", []).append(line)
            elif line.startswith("CPU capability usage"):
                out["build_cpu_capability"] = line.split(":", 1)[1].strip()
            elif line.startswith("Build settings"):
                for item in line.split(":", 1)[1].split(", "):
                    key, _, value = item.partition("=")
                    if key.strip() in ("BLAS_INFO", "LAPACK_INFO", "USE_MKL", "USE_MKLDNN", "USE_OPENMP"):
                        out[key.strip().lower()] = value.strip()
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_info
        out["threadpools"] = [{k: d.get(k) for k in ("user_api", "internal_api", "version", "num_threads",
                                                     "architecture", "threading_layer")}
                              for d in threadpool_info()]
    except ImportError:
        pass
    return out


def hardware() -> Dict:
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": platform.processor()
            or platform.machine(), "cpu_count": os.cpu_count(), "cpu_info": cpu_info()}
    try:
        import torch
        info["torch_threads"] = torch.get_num_threads()
        info["blas"] = blas_info()
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            # The device this process trains on; the advisor's memory rule reads it.
            info["gpu_memory_gb"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
            try:
                smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=30)
                info["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
            except (OSError, subprocess.SubprocessError):
                info["driver"] = None
    except ImportError:
        pass
    info["fingerprint"] = hardware_fingerprint({"hardware": info})
    return info


def hardware_fingerprint(provenance: Dict) -> str:
    """One line that tells apart machines whose kernels (and so rounding) can differ: CPU vendor,
    model, family/model numbers and kernel-relevant ISA flags, plus the GPUs. Equal strings mean
    the same kind of hardware; a provenance.json without the detailed fields (a machine that does
    not report them) gives what it has. Takes a run's provenance dict (or one with a "hardware" key)."""
    hw = provenance.get("hardware", provenance) if isinstance(provenance, dict) else {}
    cpu = hw.get("cpu_info") or {}
    parts = [cpu.get("vendor") or "", cpu.get("model_name") or hw.get("cpu") or "unknown CPU"]
    if cpu.get("family") is not None:
        parts.append(f"family {cpu.get('family')} model {cpu.get('model')}")
    line = " ".join(p for p in parts if p)
    if cpu.get("kernel_flags") is not None and cpu:
        line += " [" + " ".join(cpu.get("kernel_flags") or []) + "]"
    if hw.get("gpus"):
        line += " + " + ", ".join(hw["gpus"])
    return line


LARGE_FILE = 256 << 20  # files above this are fingerprinted by size, head and tail


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= LARGE_FILE:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(str(size).encode() + f.read(1 << 20))
            f.seek(-(1 << 20), 2)
            h.update(f.read())


def hash_directory(path: str | Path) -> Optional[str]:
    """sha256 over a checkpoint dir's files (relative path + content; files above LARGE_FILE by
    size, first and last MiB, so a multi-GB checkpoint hashes in milliseconds). The engine's
    provenance and the manager's run hashes use this one function, so the two can be matched."""
    root = Path(path)
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0")
            _file_digest(p, h)
    return h.hexdigest()


def collect(argv, seed: int, data_hash: str, start_checkpoint: str, operative_config: str,
            reward_model: str = "") -> Dict:
    """`reward_model`: the reward model's checkpoint dir when the run scores with one."""
    return {
        "command": [sys.executable, "-m", "rlhf.train", *argv],
        "cwd": os.getcwd(),
        "seed": seed,
        "git": git_info(),
        "versions": package_versions(),
        "hardware": hardware(),
        "data_sha256": data_hash,
        "start_checkpoint": start_checkpoint,
        "start_checkpoint_sha256": hash_directory(start_checkpoint),
        **({"reward_model": reward_model, "reward_model_sha256": hash_directory(reward_model)} if reward_model else {}),
        "config_sha256": hashlib.sha256(operative_config.encode()).hexdigest(),
        "numerics": numerics.settings(),
    }
