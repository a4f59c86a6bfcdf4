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

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "ray", "vllm", "gin-config", "numpy",
            "scipy", "wandb", "dvc")


def _git(*args: str, cwd: Path = REPO_ROOT) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def git_info(root: Path = REPO_ROOT) -> Dict:
    """SHA, dirty flag and the diff of tracked files (untracked files are listed, not diffed)."""
    sha = _git("rev-parse", "HEAD", cwd=root)
    if sha is None:
        return {"sha": None, "dirty": None, "diff": None, "diff_sha256": None}
    diff = _git("diff", "HEAD", "--", ".", cwd=root) or ""
    untracked = (_git("ls-files", "--others", "--exclude-standard", cwd=root) or "").split()
    return {"sha": sha.strip(), "dirty": bool(diff.strip()), "diff": diff,
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest(), "untracked": untracked[:200]}


def package_versions() -> Dict[str, Optional[str]]:
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> Dict:
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": platform.processor()
            or platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import torch
        info["torch_threads"] = torch.get_num_threads()
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
    return info


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


def collect(argv, seed: int, data_hash: str, start_checkpoint: str, operative_config: str) -> Dict:
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
        "config_sha256": hashlib.sha256(operative_config.encode()).hexdigest(),
    }
