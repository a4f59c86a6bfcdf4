"""vLLM rollout backend: an in-process vLLM engine on the GPU, fed token ids, returning `Batch`es.

Why these choices (vLLM 0.24.0):
- In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the trainer's tensors load straight
  into the running model with `load_weights`, and the engine's sampler draws from this process's
  CUDA generator, which `per_request_seeds=False` uses for cheap, reproducible seeding.
- Prompts are encoded by the trainer's tokenizer and passed as token ids; responses come back as
  token ids (`detokenize=False`), so vLLM never decodes ids the tokenizer does not know (a model's
  vocabulary may be larger than its tokenizer's) and the Batch matches the HF backend's exactly.
- Stopping follows the trainer's tokenizer: `ignore_eos` with `stop_token_ids=[eos]`, as HF
  generate is called, so the model config's own EOS ids do not end a response early.
- Seeds: by default this process's generators, which the in-process engine samples with, are
  seeded once per call from the call's seed (run seed, step, call): the CUDA generator (vLLM's
  first model runner draws its noise from it) and numpy's global one (its second model runner
  gives each unseeded request a seed from it); the same call gives the same tokens
  (tests/rlhf/test_rollout_vllm_gpu.py, run by bench/gpu_tests.sh). `per_request_seeds=True`
  gives each request its own seed (`derive_seed(seed, index)`);
  vLLM then draws each seeded request's noise in a Python loop (one kernel per request per
  token), a cost measured in bench/results/gpu_h200.md, and the tokens still depend on the batch in
  practice (bf16 kernels differ with the batch size).
- One continuous batch: `generate_calls` hands vLLM every call of an iteration at once (the trainer's
  `ppo.rollout_micro_batch_size` x `ppo.num_rollout_batches` prompts); vLLM keeps up to 256 sequences
  in flight (`max_num_seqs`) within the KV cache of `ppo.vllm_gpu_memory_utilization`. On vLLM,
  `ppo.rollout_micro_batch_size` therefore sets how many prompts an iteration samples (with
  `ppo.num_rollout_batches`), not how many run at once.
- Memory: with `sleep=True` the engine offloads its weights to CPU and frees its KV cache between
  rollouts (`LLM.sleep(level=1)`); `sync_weights` and `generate` wake it first.
- `own_process=True` (`ppo.vllm_own_process`) runs vLLM's engine core in a process of its own (vLLM's
  multiprocessing mode): its scheduler and model runner no longer share this process's interpreter
  with the trainer's output handling, while the trainer's weights reach it through a staging buffer
  shared by a CUDA IPC handle and its samplers are seeded in its process (rlhf/rollout/vllm_worker.py).
  Its scheduler is held while a rollout's requests are queued (`_generate`), so that its first step
  sees the whole batch, as in-process. The same seeds give the same tokens in both modes.
- `model_runner` (`ppo.vllm_model_runner`): vLLM 0.24 drives the model with one of two runners, chosen
  by architecture ('v2' for Llama, Mistral, Qwen3; 'v1' for Qwen2 and the rest: `uses_runner_v2`). 'v2' prepares a
  decoding step's inputs on the GPU, which matters where the rollout waits on the host (a small model
  with hundreds of sequences in flight). Both runners seed from this process's generators as above.

vLLM is imported only here, and only when the backend is built: it is an optional GPU extra.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

import numpy as np
import torch

from rlhf.batch import Batch
from rlhf.rollout.base import SamplingParams, derive_seed, encode_prompts, response_batch


def batch_from_token_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                           responses: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int,
                           pad_token_id: int, logprobs: Optional[Sequence[Sequence[float]]] = None) -> Batch:
    """The rollout `Batch` from per-request response token lists (and their sampling log-probs).

    The lists are right-padded to `max_new_tokens` and masked as the HF backend's ids are
    (rlhf/rollout/base.py `response_batch`): up to and including the first EOS; `finished` says
    whether an EOS was produced. Log-probs, when given, align with the response tokens and are 0
    where the mask is 0 ([B, R] float32, key `rollout_logprobs`).
    """
    n = len(responses)
    ids = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long)
    lengths = torch.zeros(n, dtype=torch.long)
    lps = torch.zeros((n, max_new_tokens), dtype=torch.float32)
    for i, tokens in enumerate(responses):
        tokens = list(tokens)[:max_new_tokens]
        lengths[i] = len(tokens)
        if tokens:
            ids[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if logprobs is not None:
                lps[i, :len(tokens)] = torch.tensor(list(logprobs[i])[:len(tokens)], dtype=torch.float32)
    out = response_batch(prompt_ids, prompt_mask, ids, eos_token_id, pad_token_id, lengths)
    if logprobs is not None:
        out["rollout_logprobs"] = lps * out["response_mask"]
    return out


def sampled_logprobs(token_ids: Sequence[int], position_logprobs) -> List[float]:
    """The sampled token's log-prob at each position, from vLLM's per-position {token: Logprob}."""
    return [float(position_logprobs[t][tok].logprob) for t, tok in enumerate(token_ids)]


MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
MODEL_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
RUNNER_VALUES = {"v1": "0", "v2": "1"}  # ppo.vllm_model_runner -> the variable's value
RUNNER_V2_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
                                     "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM", "DeepseekV2ForCausalLM"})
"""The architectures vLLM 0.24 drives with its second model runner unless told otherwise (its
`DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`; tests/rlhf/test_rollout_vllm_gpu.py checks the two agree where
vLLM is installed), so that a plan made without vLLM knows the runner too."""


def _truthy(value: str) -> bool:
    return value.strip().lower() not in ("0", "false", "")


def environment_conflict(own: bool, model_runner: str = "auto",
                         environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Why the environment contradicts `ppo.vllm_own_process` or `ppo.vllm_model_runner`, or None.
    A user's own VLLM_ENABLE_V1_MULTIPROCESSING (verl and OpenRLHF users often export it) would put the
    engine in a process of its own, where the in-process path's direct weight loads cannot reach it; a
    VLLM_USE_V2_MODEL_RUNNER that names the other runner than the recipe's would be overridden without a
    word."""
    value = environ.get(MULTIPROCESSING)
    if not own and value is not None and value.strip() != "0":
        return (f"ppo.vllm_own_process = False is invalid with {MULTIPROCESSING}={value} in the environment, which "
                f"puts vLLM's engine in a process of its own: set ppo.vllm_own_process = True for that, or unset "
                f"{MULTIPROCESSING}")
    runner = environ.get(MODEL_RUNNER)
    if model_runner in RUNNER_VALUES and runner is not None and runner.strip() \
            and _truthy(runner) != (model_runner == "v2"):
        return (f"ppo.vllm_model_runner = {model_runner!r} is invalid with {MODEL_RUNNER}={runner} in the "
                f"environment, which asks vLLM for the other runner: set ppo.vllm_model_runner = 'auto' to follow "
                f"the variable, or unset {MODEL_RUNNER}")
    return None


def uses_runner_v2(model_runner: str, architectures: Sequence[str],
                   environ: Mapping[str, str] = os.environ) -> bool:
    """Whether vLLM drives a model of these `architectures` (config.json's) with its second runner under
    `ppo.vllm_model_runner = model_runner`: as named; with 'auto', as the environment's
    VLLM_USE_V2_MODEL_RUNNER says, and without it by architecture (RUNNER_V2_ARCHITECTURES)."""
    if model_runner in RUNNER_VALUES:
        return model_runner == "v2"
    value = environ.get(MODEL_RUNNER)
    if value is not None and value.strip():
        return _truthy(value)
    return any(name in RUNNER_V2_ARCHITECTURES for name in architectures)


@contextlib.contextmanager
def engine_environment(own: bool, model_runner: str = "auto"):
    """While an engine is built: vLLM's multiprocessing switch as `own` asks and its model-runner switch as
    `model_runner` does ('auto': as the environment has it), restored afterwards. vLLM caches its
    environment once an in-process engine has started, so the cache is dropped first."""
    wanted = {MULTIPROCESSING: "1"} if own else {}
    if model_runner in RUNNER_VALUES:
        wanted[MODEL_RUNNER] = RUNNER_VALUES[model_runner]
    if not wanted:
        yield
        return
    with contextlib.suppress(ImportError):
        envs: Any = importlib.import_module("vllm.envs")
        disable = getattr(envs, "disable_envs_cache", None)
        if disable is not None:
            disable()
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def without_deterministic_algorithms():
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)


class VLLMRollout:
    """The `RolloutBackend` interface (see rlhf/rollout/base.py) over a `vllm.LLM`, in this process or,
    with `own_process`, in a process of its own."""

    shares_module = False

    @classmethod
    def from_config(cls, ppo, *, model, tokenizer, device, model_dir: str, log=print) -> "VLLMRollout":
        return cls(tokenizer=tokenizer, device=device, model_dir=model_dir, seed=ppo.seed,
                   max_model_len=ppo.max_prompt_length + ppo.max_response_length,
                   return_logprobs=ppo.rollout_logprobs, gpu_memory_utilization=ppo.vllm_gpu_memory_utilization,
                   sleep=ppo.vllm_sleep, per_request_seeds=ppo.vllm_per_request_seeds,
                   own_process=ppo.vllm_own_process, model_runner=ppo.vllm_model_runner, log=log)

    def __init__(self, tokenizer, device: torch.device, model_dir: str, seed: int, max_model_len: int,
                 return_logprobs: bool = False, gpu_memory_utilization: float = 0.3, sleep: bool = False,
                 per_request_seeds: bool = False, max_num_seqs: int = 256, dtype: str = "bfloat16",
                 enforce_eager: bool = False, own_process: bool = False, model_runner: str = "auto", log=print):
        if torch.device(device).type != "cuda":
            from rlhf.errors import ConfigError
            raise ConfigError("ppo.rollout_backend = 'vllm' is invalid on the CPU: vLLM needs a CUDA device; "
                              "use ppo.rollout_backend = 'hf' or run on a GPU")
        # Read by vLLM when the engine is built: where the engine lives follows own_process (see above).
        conflict = environment_conflict(own_process, model_runner)
        if conflict is not None:
            from rlhf.errors import ConfigError
            raise ConfigError(conflict)
        if not own_process:
            os.environ[MULTIPROCESSING] = "0"
        try:
            import vllm
        except ImportError as err:
            raise ImportError("ppo.rollout_backend = 'vllm' needs the vllm package (0.24.0 matches torch 2.11); "
                              "install it or use ppo.rollout_backend = 'hf'") from err
        self.own_process = own_process
        self._staging: Optional[torch.Tensor] = None
        self._vllm: Any = vllm  # the package, typed loosely: where it is not installed the checker reads this file
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.return_logprobs = return_logprobs
        self.sleep_mode = sleep is not False  # 'auto' builds a sleep-capable engine; the placement decides
        self.sleep_between_rollouts = bool(sleep)
        self.per_request_seeds = per_request_seeds
        self.asleep = False
        self.timings: dict = {}
        tok_dir = getattr(tokenizer, "name_or_path", "")
        has_tok_dir = bool(tok_dir) and Path(tok_dir).is_dir()
        t0 = time.perf_counter()
        # The trainer asks for deterministic algorithms (warn only); that also puts Inductor in a
        # deterministic mode which refuses the kernel benchmarking vLLM's start-up compilation does.
        # The flag is lifted while the engine is built (not while it generates: see `generate`).
        extra = {"worker_extension_cls": "rlhf.rollout.vllm_worker.EngineWorker"} if own_process else {}
        with without_deterministic_algorithms(), engine_environment(own_process, model_runner):
            self.llm = vllm.LLM(  # pyright: ignore[reportAttributeAccessIssue]  # vllm's types where it is installed
                model=str(model_dir), tokenizer=tok_dir if has_tok_dir else None, skip_tokenizer_init=not has_tok_dir,
                dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                max_num_seqs=max_num_seqs, enable_sleep_mode=self.sleep_mode, enforce_eager=enforce_eager,
                # Trainer log-probs divide logits by the temperature; vLLM's raw log-probs would not.
                logprobs_mode="processed_logprobs" if return_logprobs else "raw_logprobs", **extra)
        self.timings["engine_start_s"] = time.perf_counter() - t0
        version = vllm.__version__  # pyright: ignore[reportAttributeAccessIssue]  # vllm's types where installed
        log(f"vLLM {version} engine ready in {self.timings['engine_start_s']:.1f} s"
            f"{' (in its own process)' if own_process else ''}"
            f"{'' if model_runner == 'auto' else f', model runner {model_runner}'}")

    # ------------------------------------------------------------------ weights and memory
    def _model(self):
        """The engine's own model module (vLLM's fused layers; `load_weights` takes HF names)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def _wake(self) -> None:
        if self.asleep:
            # The trainer's phases leave free blocks in torch's caching allocator; the engine allocates
            # its weights and KV cache outside it and would find the GPU full.
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self.asleep = False

    def set_sleep(self, enabled: bool) -> None:
        self.sleep_between_rollouts = bool(enabled) and self.sleep_mode
        if not self.sleep_between_rollouts:
            self._wake()

    def release_memory(self) -> None:
        """Frees the KV cache and offloads the weights to CPU until the next sync or rollout."""
        if self.sleep_between_rollouts and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def asleep_bytes(self) -> int:
        """While asleep: the bytes of vLLM's sleep-mode pool, which torch's statistics still count as
        allocated though their memory is released (its weights are on the host, its KV cache gone)."""
        if not self.asleep or self.own_process:  # an engine of its own process is outside torch's count here
            return 0
        cumem: Any = importlib.import_module("vllm.device_allocator.cumem")  # vLLM's own sleep-mode pool
        return int(cumem.CuMemAllocator.get_instance().get_current_usage())

    @torch.no_grad()
    def sync_weights(self, model) -> None:
        """Loads the trainer's HF-named weights into the running engine; no rebuild, no recompile.
        `model`: a module, a state dict, or an iterator of (name, tensor) pairs (merged LoRA weights,
        made one at a time)."""
        t0 = time.perf_counter()
        self._wake()
        if isinstance(model, torch.nn.Module):
            model = model.state_dict()
        pairs = model.items() if isinstance(model, Mapping) else model
        if self.own_process:
            self._send_weights(pairs)
        else:
            self._model().load_weights(((name, tensor.detach()) for name, tensor in pairs))
        # Cached prefixes hold keys/values computed with the old weights.
        self.llm.reset_prefix_cache()
        torch.cuda.synchronize(self.device)
        self.timings["last_sync_s"] = time.perf_counter() - t0

    def _send_weights(self, pairs) -> None:
        """To an engine in its own process: bucket by bucket through the shared staging buffer."""
        from rlhf.rollout.vllm_worker import STAGING_BYTES, open_shared, send_weights

        def grow(nbytes: int) -> torch.Tensor:
            self._staging = None  # closes this process's view before the worker frees the buffer
            blob = self.llm.collective_rpc("rlhf_staging", args=(int(nbytes),))[0]
            self._staging = open_shared(blob, self.device)
            return self._staging

        buffer = self._staging if self._staging is not None else grow(STAGING_BYTES)
        self._staging, buckets = send_weights(
            pairs, buffer, grow=grow, load=lambda entries: self.llm.collective_rpc("rlhf_load", args=(entries,)),
            sync=lambda: torch.cuda.synchronize(self.device))
        self.timings["last_sync_buckets"] = buckets

    # ------------------------------------------------------------------ sampling
    def _sampling_params(self, sampling: SamplingParams, seed: Optional[int]):
        greedy = sampling.greedy
        return self._vllm.SamplingParams(
            n=1, max_tokens=sampling.max_new_tokens, min_tokens=0,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            top_k=0 if greedy or sampling.top_k <= 0 else sampling.top_k,
            seed=seed, ignore_eos=True, stop_token_ids=[self.tokenizer.eos_token_id],
            detokenize=False, logprobs=0 if self.return_logprobs else None)

    def _encode(self, prompts: Sequence[str], sampling: SamplingParams):
        """(prompt ids, mask, vLLM requests) of one call's prompts."""
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, prompts, sampling.max_prompt_length,
                                                 sampling.truncation)
        requests = []
        for i, (ids, mask) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
            tokens = [t for t, m in zip(ids, mask) if m]
            if not tokens:
                raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens; vLLM needs at least one")
            requests.append({"prompt_token_ids": tokens})
        return prompt_ids, prompt_mask, requests

    def _generate(self, requests: list, params) -> list:
        """`LLM.generate` of every request, outputs in request order. An engine in this process steps
        only once all of them are added. An engine in its own process steps on its own as requests
        arrive over its socket one by one, so the first steps would see however many had arrived: the
        batches, hence the draws of vLLM's first runner (one noise tensor over the batch) and the
        logits' kernels of either, would follow timing. Its scheduler is held while the requests are
        queued (vLLM's sleep level 0: requests queue, nothing runs, memory and prefix cache stay) and
        released once all are, so that it starts from the whole batch as in this process."""
        if not self.own_process:
            return self.llm.generate(requests, params, use_tqdm=False)
        self.llm.sleep(level=0, mode="keep")
        try:
            self.llm.enqueue(requests, params, use_tqdm=False)
        finally:
            self.llm.wake_up(tags=["scheduling"])
        return self.llm.wait_for_completion(use_tqdm=False)

    def generate(self, prompts: Sequence[str], sampling: SamplingParams, seed: int) -> Batch:
        return self.generate_calls([(prompts, seed)], sampling)[0]

    @torch.no_grad()
    def generate_calls(self, calls: Sequence[tuple], sampling: SamplingParams) -> List[Batch]:
        """Every call's prompts in one `LLM.generate`, so that vLLM's scheduler keeps up to its
        `max_num_seqs` sequences in flight across calls (the guide's 16-prompt calls one after the
        other leave the GPU mostly idle); the responses are split back into one Batch per call.
        Seeds: the first call's seeds this process's CUDA generator for the whole batch, or with
        `per_request_seeds` each request takes `derive_seed(call seed, index in its call)`."""
        self._wake()
        tok = self.tokenizer
        encoded = [self._encode(prompts, sampling) for prompts, _ in calls]
        requests = [r for _, _, reqs in encoded for r in reqs]
        # A fresh prefix cache per call: the schedule, hence the tokens, depend on this call alone.
        self.llm.reset_prefix_cache()
        # The deterministic-algorithms flag stays as the trainer set it: it is process-wide, and a
        # rollout may run beside the critic's update (ppo.overlap_rollout), whose compiled layers
        # guard on it. Nothing vLLM runs per step depends on it (its model runs the graphs compiled
        # at start-up; sampling is elementwise maths and argmax); its cost was the NaN fill of every
        # new tensor, which every engine process turns off on a GPU (`rlhf.determinism.deterministic_algorithms`).
        if self.per_request_seeds and not sampling.greedy:
            params = [self._sampling_params(sampling, derive_seed(seed, i))
                      for (_, seed), (_, _, reqs) in zip(calls, encoded) for i in range(len(reqs))]
            outputs = self._generate(requests, params)
        elif self.own_process:  # the engine's generators, in its process
            self.llm.collective_rpc("rlhf_seed", args=(int(calls[0][1]),))
            outputs = self._generate(requests, self._sampling_params(sampling, None))
        else:
            params = self._sampling_params(sampling, None)
            numpy_state = np.random.get_state()
            try:
                with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                    # Both of the engine's samplers draw from this process's generators: the
                    # first model runner samples with the CUDA generator, the second gives each
                    # unseeded request a seed from numpy's global generator as it joins the batch.
                    torch.manual_seed(calls[0][1])
                    np.random.seed(calls[0][1] % 2**32)
                    outputs = self._generate(requests, params)
            finally:
                np.random.set_state(numpy_state)
        batches, start = [], 0
        for prompt_ids, prompt_mask, reqs in encoded:
            completions = [out.outputs[0] for out in outputs[start:start + len(reqs)]]
            start += len(reqs)
            responses = [list(c.token_ids) for c in completions]
            logprobs = ([sampled_logprobs(r, c.logprobs) for r, c in zip(responses, completions)]
                        if self.return_logprobs else None)
            batches.append(batch_from_token_lists(prompt_ids, prompt_mask, responses, sampling.max_new_tokens,
                                                  tok.eos_token_id, tok.pad_token_id, logprobs))
        return batches
