"""What torch's allocator holds for cuBLAS once a thread or stream has run a matmul (GPU; not a test).

torch gives each (thread, stream) that runs a matmul a cuBLAS handle and a workspace, and takes the
workspace from its caching allocator: it counts in `torch.cuda.memory_allocated`, so it belongs in the
memory plan's allocated figures wherever the trainer's roles run matmuls on more than one thread (a
local placement submits a role's calls to a worker thread of its own, `rlhf/placement/proxy.py`). This
runs one small matmul of each kind (bf16, fp32, fp32 with bias: cuBLAS and cuBLASLt) on the main
thread, then on new threads one by one, then on a side stream, then a backward pass (autograd runs it on
a thread of its own) on the default stream and on the side stream, and prints what stayed allocated after
each (the outputs and the gradient freed). The JSON records `CUBLAS_WORKSPACE_CONFIG`, which sets the workspace's size
(`ppo.deterministic` sets it): run it once with the variable and once without to see both.

    python bench/cublas_workspace.py [--threads 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path


def held_after(fn, torch) -> int:
    """Bytes still allocated after `fn()` ran and its outputs were dropped."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def matmuls(torch):
    a16 = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    a32, bias = torch.randn(256, 256, device="cuda"), torch.randn(256, device="cuda")

    def run():
        (a16 @ a16).sum().item()
        (a32 @ a32).sum().item()
        torch.addmm(bias, a32, a32).sum().item()
    return run


def measure(threads: int) -> dict:
    import torch
    run = matmuls(torch)
    out = {"cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "main_thread_first": held_after(run, torch), "main_thread_again": held_after(run, torch)}
    for i in range(threads):
        box = {}
        t = threading.Thread(target=lambda: box.update(b=held_after(run, torch)))
        t.start()
        t.join()
        out[f"new_thread_{i + 1}"] = box["b"]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out["side_stream"] = held_after(run, torch)
    # Backward runs on autograd's own thread for the device: a matmul's gradient is another thread's.
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    x = torch.randn(256, 256, device="cuda")
    out["backward"] = held_after(lambda: (x @ w).sum().backward(), torch) - w.numel() * 4  # less w.grad
    with torch.cuda.stream(side):
        w.grad = None
        out["backward_side_stream"] = held_after(lambda: (x @ w).sum().backward(), torch) - w.numel() * 4
    out["allocated_total"] = torch.cuda.memory_allocated()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads {args.threads} is invalid: a count of new threads, 0 or more")
    if args.json and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        p.error(f"--json {args.json} is invalid: a file path in an existing directory")
    import torch
    if not torch.cuda.is_available():
        print("bench/cublas_workspace.py needs a CUDA GPU: none is visible here", file=sys.stderr)
        return 2
    result = measure(args.threads)
    for k, v in result.items():
        print(f"{k:28s} {v / 2 ** 20:10.1f} MiB" if isinstance(v, int) else f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
