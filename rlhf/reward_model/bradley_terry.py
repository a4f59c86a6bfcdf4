"""Reward-model training: the Bradley-Terry loss on chosen / rejected pairs.

    loss = -log sigmoid(r(chosen) - r(rejected) [- margin])

Pairs are encoded once with the model's tokenizer and chat template (`rlhf/reward_model/score.py`),
scored at the last token, and walked in a seeded permutation per epoch that depends only on
(seed, step), so a resumed run sees the same pairs in the same order as an uninterrupted one.
Output: `OUT/` is an ordinary checkpoint (`AutoModelForSequenceClassification.from_pretrained(OUT)`
loads it, tokenizer included), beside `metrics.jsonl`, `summary.json` and `checkpoints/step_N/`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from rlhf import checkpoint as ckpt_io
from rlhf.chat import PromptRenderer, prompt_key
from rlhf.data import PreferencePair, _unit_hash, load_pairs
from rlhf.errors import ConfigError
from rlhf.lr_schedule import lr_schedule
from rlhf.models import (
    adamw,
    check_vocab_fits,
    config_architectures,
    config_num_labels,
    enable_gradient_checkpointing,
    read_model_config,
)
from rlhf.reward_model.config import RMTrainConfig
from rlhf.reward_model.score import (
    encode_conversation,
    ensure_pad_id,
    last_token_scores,
    load_reward_tokenizer,
    pack_left,
    write_tokenizer_probe,
)


def pair_key(pair: PreferencePair) -> str:
    """The prompt (or, implicit, the chosen conversation) a pair is split on."""
    return prompt_key(pair.prompt) if pair.prompt is not None else prompt_key(pair.chosen)


def split_pairs(pairs: Sequence[PreferencePair], fraction: float, items: Sequence | None = None) -> Tuple[list, list]:
    """(train, held-out): a deterministic hash split on each pair's prompt; `items` (one per pair,
    e.g. its encoding) are split instead of the pairs when given."""
    train, held = [], []
    for p, item in zip(pairs, pairs if items is None else items):
        (held if _unit_hash("rm:" + pair_key(p)) < fraction else train).append(item)
    return train, held


def encode_pairs(renderer: PromptRenderer, pairs: Sequence[PreferencePair]) -> List[Tuple[List[int], List[int], float]]:
    return [(encode_conversation(renderer, p.prompt, p.chosen), encode_conversation(renderer, p.prompt, p.rejected),
             p.margin) for p in pairs]


def load_encoded_pairs(renderer: PromptRenderer, path: str, binding: str, prompt_key_: str, log=print):
    """The pairs of a file and their encodings. A pair whose chosen and rejected sides are the same
    token ids teaches nothing (its loss is ln 2 whatever the weights) and would count as a miss in
    pair accuracy: such pairs are left out with a one-line notice naming the first row and how many
    (public preference sets carry a few); a file of nothing else is a ConfigError."""
    pairs = load_pairs(path, prompt_key_=prompt_key_)
    encoded = encode_pairs(renderer, pairs)
    same = {i for i, (chosen, rejected, _) in enumerate(encoded) if chosen == rejected}
    if same and len(same) == len(pairs):
        raise ConfigError(f"{binding} = {path!r}: every row has chosen == rejected (the same token ids): a pair "
                          f"must prefer one response over another")
    if same:
        log(f"{binding} = {path!r}: {len(same)} of {len(pairs)} rows have chosen == rejected (the same token ids; "
            f"the first is row {min(same)}); they carry no preference and are left out")
        pairs = [p for i, p in enumerate(pairs) if i not in same]
        encoded = [e for i, e in enumerate(encoded) if i not in same]
    return pairs, encoded


def load_base_model(path: str, seed: int, dtype: torch.dtype):
    """A sequence classifier with one output: a causal LM gets a fresh head (seeded); a one-output
    classifier keeps its head; a classifier with another number of outputs is refused."""
    config = read_model_config(path, "rm.base_model", "use a local checkpoint dir (a causal LM such as the SFT "
                               "policy, or a one-output sequence classifier)")
    archs = config_architectures(config)
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = config_num_labels(config)
        if labels != 1:
            raise ConfigError(f"rm.base_model = {path!r} is invalid: a sequence classifier with num_labels = {labels}; "
                              f"a reward model has one output")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "some weights were not initialized": the new head, expected
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype,
                                                                       local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"rm.base_model = {path!r}: cannot load it as AutoModelForSequenceClassification ({first})") \
            from None
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.problem_type = "regression"
    return model


class Progress:
    """A live line on a terminal (rich), a plain line per evaluation otherwise."""

    def __init__(self, total: int, start: int):
        self.tty = sys.stderr.isatty()
        self.total, self.start = total, start
        self._bar = None
        if self.tty:
            from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress
            self._bar = RichProgress(TextColumn("rm step {task.completed}/{task.total}"), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("rm", total=total, completed=start, info="")
            self._bar.start()

    def update(self, step: int, record: Dict) -> None:
        info = f"loss {record.get('loss', float('nan')):.4f}"
        if "eval/pair_accuracy" in record:
            info += f" | held-out pair acc {record['eval/pair_accuracy']:.3f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif "eval/pair_accuracy" in record or step == self.total:
            print(f"rm step {step}/{self.total} | {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class RewardModelTrainer:
    def __init__(self, cfg: RMTrainConfig, out: str | Path, log: Callable[[str], None] = print):
        self.cfg, self.out, self.log = cfg, Path(out), log
        hf_logging.disable_progress_bar()
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("rm.device = 'cuda' is invalid: no CUDA device is visible; use 'cpu' or 'auto'")
        self.device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if cfg.device == "auto" else cfg.device))
        self.autocast = torch.bfloat16 if cfg.dtype == "bfloat16" and self.device.type == "cuda" else None
        tokenizer_binding = "rm.tokenizer_path" if cfg.tokenizer_path else "rm.base_model"
        self.tokenizer = load_reward_tokenizer(cfg.tokenizer_path or cfg.base_model, tokenizer_binding)
        check_vocab_fits(self.tokenizer, tokenizer_binding, cfg.tokenizer_path or cfg.base_model, "rm.base_model",
                         cfg.base_model)
        ckpt_io.check_weights(cfg.base_model, "rm.base_model")
        self.renderer = PromptRenderer(self.tokenizer, cfg.chat_template, cfg.system_prompt, cfg.instruction_suffix,
                                       binding="rm.chat_template")
        log(f"reward model: {self.renderer.describe()}")
        pairs, encoded = load_encoded_pairs(self.renderer, cfg.train_path, "rm.train_path", cfg.prompt_key, log)
        if cfg.eval_path:
            self.train = encoded
            self.held = load_encoded_pairs(self.renderer, cfg.eval_path, "rm.eval_path", cfg.prompt_key, log)[1]
        else:
            self.train, self.held = split_pairs(pairs, cfg.eval_fraction, encoded)
        if not self.train:
            raise ConfigError(f"rm.train_path = {cfg.train_path!r}: no training pairs left after the held-out split")
        if not self.held:
            raise ConfigError("the held-out pairs are empty: set rm.eval_path or raise rm.eval_fraction")
        self.data_hash = hashlib.sha256(json.dumps([self.train, self.held]).encode()).hexdigest()
        self.model = load_base_model(cfg.base_model, cfg.seed, torch.float32 if self.autocast is None else
                                     torch.float32).to(self.device)
        ensure_pad_id(self.model, self.tokenizer)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.model.train()
        self.optimizer = adamw(self.model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                               betas=(0.9, 0.95))
        # Warmup from lr / rm.warmup_steps at the first step, then rm.lr_schedule over rm.steps.
        self.scheduler = lr_schedule(self.optimizer, cfg.lr_schedule, cfg.warmup_steps, cfg.steps, warmup_offset=1)
        self.step = 0

    def batch_indices(self, step: int) -> np.ndarray:
        """Pairs of optimizer step `step` (0-based): a seeded permutation per epoch, from (seed, step) alone."""
        n, bs = len(self.train), self.cfg.batch_size
        out = []
        for k in range(step * bs, (step + 1) * bs):
            epoch, pos = divmod(k, n)
            out.append(np.random.default_rng([self.cfg.seed, epoch]).permutation(n)[pos])
        return np.array(out)

    def _scores(self, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        pad_id = cast(int, self.tokenizer.pad_token_id)  # load_reward_tokenizer sets one
        ids, mask, pos = pack_left(seqs, pad_id, self.cfg.max_length)
        with torch.autocast(device_type=self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            return last_token_scores(self.model, ids.to(self.device), mask.to(self.device), pos.to(self.device))

    def _loss(self, items) -> Tuple[torch.Tensor, torch.Tensor]:
        seqs = [c for c, _, _ in items] + [r for _, r, _ in items]
        scores = self._scores(seqs)
        chosen, rejected = scores[:len(items)], scores[len(items):]
        margin = torch.tensor([m for _, _, m in items], device=scores.device) if self.cfg.use_margin else 0.0
        diff = chosen - rejected
        return -torch.nn.functional.logsigmoid(diff - margin), diff.detach()

    def train_step(self) -> Dict[str, float]:
        cfg = self.cfg
        items = [self.train[i] for i in self.batch_indices(self.step)]
        self.optimizer.zero_grad(set_to_none=True)
        losses, diffs = [], []
        for start in range(0, len(items), cfg.micro_batch_size):
            loss, diff = self._loss(items[start:start + cfg.micro_batch_size])
            (loss.sum() / len(items)).backward()
            losses.append(loss.detach())
            diffs.append(diff)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        loss, diff = torch.cat(losses), torch.cat(diffs)
        record = {"loss": float(loss.mean()), "pair_accuracy": float((diff > 0).float().mean()),
                  "reward_margin": float(diff.mean()), "grad_norm": float(grad_norm),
                  "lr": float(self.scheduler.get_last_lr()[0])}
        if not all(math.isfinite(v) for v in record.values()):
            raise FloatingPointError(f"reward-model training diverged at step {self.step}: {record}")
        return record

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        was = self.model.training
        self.model.eval()
        losses, diffs = [], []
        for start in range(0, len(self.held), self.cfg.micro_batch_size):
            loss, diff = self._loss(self.held[start:start + self.cfg.micro_batch_size])
            losses.append(loss)
            diffs.append(diff)
        self.model.train(was)
        loss, diff = torch.cat(losses), torch.cat(diffs)
        return {"eval/loss": float(loss.mean()), "eval/pair_accuracy": float((diff > 0).float().mean()),
                "eval/reward_margin": float(diff.mean()), "eval/pairs": len(self.held)}

    # ------------------------------------------------------------------ checkpoints
    def save_model(self, path: Path) -> None:
        self.model.save_pretrained(str(path), safe_serialization=True)
        tok = self.tokenizer
        if self.cfg.chat_template != "auto":  # the template it was trained with (none for 'none') travels with it
            tok.chat_template = self.renderer.template
        tok.save_pretrained(str(path))
        write_tokenizer_probe(tok, path)

    def save_final(self) -> None:
        """The trained model into OUT itself: written into a temporary folder first, so a failed
        write (a full disk) leaves no half-written file in OUT; then moved in file by file."""
        tmp = self.out / f".tmp_model_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with ckpt_io.writing(tmp, f"the trained model into {self.out}"):
            tmp.mkdir(parents=True)
            self.save_model(tmp)
        for path in sorted(tmp.iterdir()):
            os.replace(path, self.out / path.name)
        tmp.rmdir()

    def save_checkpoint(self) -> Path:
        root = self.out / "checkpoints"
        final = root / f"step_{self.step}"
        tmp = root / f".tmp_step_{self.step}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with ckpt_io.writing(tmp, f"checkpoint {final}"):
            tmp.mkdir(parents=True)
            self.save_model(tmp / "model")
            tensors, meta = ckpt_io.optimizer_to_flat(self.optimizer.state_dict())
            save_file(tensors, str(tmp / "optim.safetensors"))
            (tmp / "state.json").write_text(json.dumps({"step": self.step, "optimizer": meta,
                                                        "scheduler": self.scheduler.state_dict()}, indent=1))
            ckpt_io.write_manifest(tmp)  # verified before a --resume trusts it
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if self.cfg.keep_checkpoints:
            for _, old in ckpt_io.list_checkpoints(root)[:-self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self, path: Path) -> None:
        ckpt_io.load_weights(self.model, path / "model" / "model.safetensors")
        state = json.loads((path / "state.json").read_text())
        self.optimizer.load_state_dict(ckpt_io.optimizer_from_flat(load_file(str(path / "optim.safetensors")),
                                                                   state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]

    # ------------------------------------------------------------------ run
    def run(self, resume: bool = False) -> Dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        metrics_path = self.out / "metrics.jsonl"
        latest = ckpt_io.resume_checkpoint(self.out / "checkpoints", log=self.log) if resume else None
        if resume and latest is None:
            self.log(f"--resume: no checkpoint in {self.out}: starting from step 0")
        if latest is not None:
            self.restore(latest)
            self.log(f"resumed from {latest} at step {self.step}")
            kept = [r for r in _read_jsonl(metrics_path) if r["step"] <= self.step]
        else:
            kept = [{"step": 0, **self.evaluate()}]
        initial = kept[0]
        with open(metrics_path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        progress = Progress(cfg.steps, self.step)
        final = None
        start = time.time()
        try:
            with open(metrics_path, "a") as f:
                while self.step < cfg.steps:
                    record = {"step": self.step + 1, **self.train_step()}
                    if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                        final = self.evaluate()
                        record.update(final)
                    f.write(json.dumps(record) + "\n")
                    f.flush()
                    progress.update(self.step, record)
                    if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                        self.save_checkpoint()
        finally:
            progress.close()
        if final is None:
            final = {k: v for k, v in _read_jsonl(metrics_path)[-1].items() if k.startswith("eval/")}
        self.save_final()
        summary = {"status": "completed", "steps": self.step, "seed": cfg.seed, "train_pairs": len(self.train),
                   "held_out_pairs": len(self.held), "data_sha256": self.data_hash,
                   "initial": {k: v for k, v in initial.items() if k.startswith("eval/")}, "final": final,
                   "chat": self.renderer.describe()}
        # No wall time in the checkpoint: the same seed and data give the same bytes (a DVC output).
        tmp = self.out / f".summary.json.tmp{os.getpid()}"  # written last and atomically: the run is complete
        try:
            tmp.write_text(json.dumps(summary, indent=1))
            os.replace(tmp, self.out / "summary.json")
        finally:
            tmp.unlink(missing_ok=True)
        self.log(f"reward model trained in {time.time() - start:.0f} s")
        return summary


def _read_jsonl(path: Path) -> List[Dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
