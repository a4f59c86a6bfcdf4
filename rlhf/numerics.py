"""CPU numerics pinned so that the same run gives the same numbers on any x86-64 CPU.

On x86-64 the same torch op is routed to different kernels by the machine it runs on:
- ATen's own vectorised kernels (softmax, attention, reductions, activations) are compiled for
  several ISAs and picked at start by the CPU (`ATEN_CPU_CAPABILITY`: default/avx2/avx512);
- MKL's BLAS (every fp32 matmul) picks a code branch by CPU vendor and ISA; only its
  conditional numerical reproducibility (`MKL_CBWR`) pins one, and of its branches only
  `COMPATIBLE` (SSE2 without the approximate rcpps/rsqrtps) is documented to give the same
  results on Intel and non-Intel CPUs (`AVX2` is honoured on Intel CPUs only and silently
  falls back to the automatic branch elsewhere);
- oneDNN (used by torch for some ops) dispatches on the ISA too (`ONEDNN_MAX_CPU_ISA`);
- parallel reductions split their work by the number of threads, so the thread count changes
  the order of additions (measured: a full `sum()` differs between 1 and 2 threads);
- MKL's vector maths (VML), which ATen calls for sqrt, exp, log, tanh, sin, cos, erf and a few more,
  follows `MKL_CBWR` for all of them but `sqrt`: under COMPATIBLE it still rounds ~5% of square
  roots differently on Intel and AMD CPUs. So the engine calls no `torch.sqrt` and trains with
  torch's fused AdamW (`rlhf.models.adamw`), whose square root is the ISA's exact one.

The `portable` profile (the default) pins all four: ATen's AVX2 kernels (every x86-64 CPU of
the last decade has AVX2), MKL's COMPATIBLE branch in strict mode, oneDNN capped at AVX2, and
a fixed thread count for the embedded default's SFT warm start and for CPU runs that do not set
one. `RLHF_NUMERICS=avx2` is the same with MKL on its AVX2 branch (no slower than native; MKL
documents it as reproducible across Intel CPUs only), `RLHF_NUMERICS=native` turns pinning off
(each machine's fastest kernels).

Measured with `bench/cpu_numerics.py` (results in bench/results/): under `portable` an AMD EPYC
(Zen 4, AVX-512) and an Intel Xeon (Sapphire Rapids, AVX-512 + AMX) give bit-identical data,
initial weights, gradients, SFT warm start and PPO metrics; under `avx2` and `native` they part at
the first matmul. A variable the user set always wins over the profile. The variables are read
when torch loads its libraries, so `apply()` must run before `import torch`: the engine's entry points
(`python -m rlhf.train`, the pipeline's SFT stage), the tests' conftest and the Ray ranks (through the forwarded
environment) call it or inherit its result. `settings()` is what provenance records.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Dict, Mapping, MutableMapping, Optional

PROFILE_ENV = "RLHF_NUMERICS"
DEFAULT_PROFILE = "portable"
THREADS_ENV = "RLHF_CPU_THREADS"
"""Threads of a CPU run that sets no `ppo.torch_threads` (and of the SFT warm start)."""
DEFAULT_THREADS = 1

PORTABLE_ENV: Dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
}
# Each profile's variables. 'avx2' keeps MKL on its AVX2 branch: as fast as native, the same on
# Intel CPUs with AVX2 (MKL's documented guarantee), unknown between Intel and AMD (MKL ignores the
# branch on other vendors); 'portable' pays MKL's slower COMPATIBLE branch for the vendor guarantee.
PROFILES: Dict[str, Dict[str, str]] = {
    "portable": PORTABLE_ENV,
    "avx2": {**PORTABLE_ENV, "MKL_CBWR": "AVX2,STRICT"},
    "native": {},
}
# Every variable that changes which CPU kernel runs or how its work is split; provenance records
# them and the Ray ranks receive them.
NUMERIC_ENV = (PROFILE_ENV, THREADS_ENV, *PORTABLE_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "MKL_DYNAMIC", "MKL_ENABLE_INSTRUCTIONS", "OMP_DYNAMIC")

# What a process that starts engines elsewhere (Ray ranks, a study's runs) hands on: the profile and
# its pins; thread counts are set per rank or per run by whoever starts it.
FORWARDED_ENV = (PROFILE_ENV, THREADS_ENV, *PORTABLE_ENV, "MKL_ENABLE_INSTRUCTIONS")

_defaulted: list = []  # variables apply() set in this process (the rest came from the user)


class NumericsError(ValueError):
    """A numerics variable has a value that is not allowed."""


def profile(environ: Mapping[str, str] = os.environ) -> str:
    value = environ.get(PROFILE_ENV, "").strip().lower() or DEFAULT_PROFILE
    if value not in PROFILES:
        raise NumericsError(f"{PROFILE_ENV} = {environ.get(PROFILE_ENV)!r} is invalid: must be one of "
                            f"{', '.join(map(repr, PROFILES))}")
    return value


def pinned_threads(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The thread count the profile pins (None for `native`: torch's own default)."""
    raw = environ.get(THREADS_ENV, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise NumericsError(f"{THREADS_ENV} = {raw!r} is invalid: must be an integer >= 1")
        return int(raw)
    return DEFAULT_THREADS if PROFILES[profile(environ)] else None


def apply(environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Sets the profile's variables that are not set yet; returns those it set. Call before torch
    is imported: torch reads them when it loads (a warning says so if it is already loaded)."""
    pinned = PROFILES[profile(environ)]
    pinned_threads(environ)  # validates RLHF_CPU_THREADS
    added = {k: v for k, v in pinned.items() if not environ.get(k)}
    if added and environ is os.environ and "torch" in sys.modules:
        warnings.warn(f"rlhf.numerics.apply() after torch was imported: {', '.join(added)} may not take effect",
                      stacklevel=2)
    environ.update(added)
    if environ is os.environ:
        _defaulted.extend(k for k in added if k not in _defaulted)
    return added


def set_threads(torch_threads: int = 0) -> int:
    """Sets torch's intra-op threads: `torch_threads` when given (a `ppo.torch_threads` binding),
    else the profile's pinned count, unless the user set OMP_NUM_THREADS; returns the count."""
    import torch
    n = torch_threads or (None if os.environ.get("OMP_NUM_THREADS") else pinned_threads())
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


class fixed_threads:
    """Runs a block with torch's intra-op threads at the profile's pinned count (and restores it):
    a result shared by every run, such as the cached SFT warm start, must not depend on the
    thread count of whichever run happened to build it."""

    def __enter__(self):
        import torch
        self._saved = torch.get_num_threads()
        n = pinned_threads()
        if n:
            torch.set_num_threads(n)
        return self

    def __exit__(self, *exc):
        import torch
        torch.set_num_threads(self._saved)
        return False


def settings() -> Dict:
    """The numeric settings in force in this process, for provenance."""
    out: Dict = {"profile": profile(), "env": {k: os.environ.get(k) for k in NUMERIC_ENV},
                 "defaulted_by_engine": list(_defaulted), "pinned_threads": pinned_threads()}
    if "torch" in sys.modules:
        import torch
        out["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        out["torch_threads"] = torch.get_num_threads()
        out["torch_interop_threads"] = torch.get_num_interop_threads()
        out["mkldnn_enabled"] = bool(torch.backends.mkldnn.enabled)
        out["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    return out


def cache_tag() -> str:
    """What of the numeric settings shapes a cached artefact (the tiny default's SFT warm start)."""
    name = profile()
    if not PROFILES[name]:
        return name
    return f"{name}:" + ",".join(f"{k}={os.environ.get(k)}" for k in PORTABLE_ENV) + f",threads={pinned_threads()}"
