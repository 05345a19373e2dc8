"""The training loop: packed windows -> Megatron GPT with AnchorAttention -> AdamW.

One process or many under torchrun (data x context parallel). BF16 runs compute with bf16 parameters
while master weights, gradient accumulation and optimizer state stay fp32, as Megatron does
(``MixedPrecisionOptimizer``). The loss of a step is the mean over every loss token of the global batch, so data- and
context-parallel runs reproduce the single-process loss.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_anchor.data import PackedDataset, WindowSampler, collate_windows
from nemo_anchor.model.gpt import build_gpt_model, packed_forward
from nemo_anchor.parallel.distributed import ParallelContext, initialize_parallel
from nemo_anchor.training import checkpoint as ckpt
from nemo_anchor.training.config import RunConfig, to_yaml
from nemo_anchor.training.metrics import MetricsLogger
from nemo_anchor.training.optim import MixedPrecisionOptimizer, learning_rate


@dataclass
class TrainSummary:
    output_dir: str
    steps: int
    final_loss: float | None
    valid_loss: float | None
    checkpoint: str | None
    tokens_per_s: float
    stopped_by_signal: bool


class _StopRequest:
    """SIGTERM/SIGINT -> finish the current step, save a checkpoint, exit cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _all_reduce_sum(value: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def _all_reduce_gradients(grads: list[torch.Tensor], group) -> None:
    if group is None or dist.get_world_size(group) == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


class Trainer:
    def __init__(self, config: RunConfig):
        self.config = config
        self.output_dir = Path(config.output_dir)
        m, t = config.model, config.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        self.ctx: ParallelContext = initialize_parallel(m.context_parallel_size, seed=t.seed)
        from megatron.core import parallel_state

        self.grad_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.cp_group = parallel_state.get_context_parallel_group() if m.context_parallel_size > 1 else None
        per_step = t.micro_batch_size * self.ctx.data_parallel_size
        if t.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size x "
                f"data-parallel size = {t.micro_batch_size} x {self.ctx.data_parallel_size}")
        self.accumulation = t.global_batch_size // per_step

        self.dataset = PackedDataset(config.data.path)
        if self.dataset.seq_length != m.seq_length:
            raise ValueError(f"model.seq_length={m.seq_length} but the packed dataset {config.data.path} has "
                             f"windows of {self.dataset.seq_length} tokens: repack or set model.seq_length")
        vocab_size = m.vocab_size or self.dataset.tokenizer.vocab_size
        torch.manual_seed(t.seed)
        bf16 = t.precision == "bf16"
        self.model = build_gpt_model(m, vocab_size, bf16=bf16).to(self.ctx.device)
        saved = ckpt.list_checkpoints(self.output_dir / "checkpoints")
        self._resumable = [p for p in saved if ckpt.has_training_state(p)] if config.checkpoint.resume else []
        # a weights-only checkpoint in output_dir (import-hf output) is a starting point like init_from_hf
        start_from = m.init_from_hf or (saved[-1] if saved and not self._resumable else None)
        if start_from and not self._resumable:
            from nemo_anchor.export.hf import init_model_from_hf

            init_model_from_hf(self.model, start_from)
        if bf16:
            self.model.bfloat16()
        self.optimizer = MixedPrecisionOptimizer(self.model, config.optim)
        self.sampler = WindowSampler(len(self.dataset), rank=self.ctx.data_parallel_rank,
                                     world_size=self.ctx.data_parallel_size, seed=t.seed,
                                     shuffle=config.data.shuffle)
        self.step = 0
        self._prepare_output_dir(vocab_size)
        self._resume()
        self._windows = iter(self.sampler)  # counts what it yields: its state is what was consumed

    # ----------------------------------------------------------------- setup
    def _prepare_output_dir(self, vocab_size: int) -> None:
        self.config.model.vocab_size = vocab_size
        self.config_yaml = to_yaml(self.config)
        if self.ctx.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.output_dir / ".config.yaml.tmp"
            tmp.write_text(self.config_yaml)
            os.replace(tmp, self.output_dir / "config.yaml")
            tokenizer_dir = self.output_dir / "tokenizer"
            if not tokenizer_dir.exists():
                staging = self.output_dir / ".tokenizer.tmp"
                shutil.rmtree(staging, ignore_errors=True)
                self.dataset.tokenizer.save(staging)
                os.replace(staging, tokenizer_dir)
        if dist.is_initialized():
            dist.barrier()

    def _extra_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "sampler": self.sampler.state_dict(), "step": self.step}

    def _resume(self) -> None:
        self._resumed_from = None
        if not self._resumable:
            return
        latest = self._resumable[-1]
        self.optimizer.materialise_state()  # shapes for dist_checkpointing to load into
        weights, extra = ckpt.load_checkpoint_state(latest, self.model, self._extra_state(),
                                                    self.optimizer.master_weights())
        self.optimizer.load_weights(weights)
        self.optimizer.load_state_dict(extra["optimizer"])
        self.sampler.load_state_dict(extra["sampler"])
        self.step = int(extra["step"])
        self._resumed_from = latest

    # ----------------------------------------------------------------- steps
    def _load(self, dataset: PackedDataset, indices) -> dict:
        """Collate windows, keep this context-parallel rank's share, move to the device."""
        batch = collate_windows([dataset[i] for i in indices])
        if self.cp_group is not None:
            from nemo_anchor.parallel.context_parallel import shard_batch

            batch = shard_batch(batch, self.cp_group, attention_type=self.config.model.attention_type)
        return {k: v.to(self.ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _loss_sum(self, batch: dict) -> torch.Tensor:
        token_loss = packed_forward(self.model, batch, self.cp_group)
        return (token_loss * batch["loss_mask"]).sum()

    def train_step(self) -> dict:
        t = self.config.trainer
        lr = learning_rate(self.step, self.config.optim, t.max_steps)
        batches = [self._load(self.dataset, itertools.islice(self._windows, t.micro_batch_size))
                   for _ in range(self.accumulation)]
        loss_tokens = _all_reduce_sum(
            torch.stack([b["loss_mask"].sum() for b in batches]).sum().double(), self.grad_group)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            loss = self._loss_sum(batch)
            (loss / loss_tokens.float()).backward()
            self.optimizer.accumulate_gradients()
            loss_sum += loss.detach().double()
        _all_reduce_gradients(self.optimizer.gradients(), self.grad_group)
        grad_norm = self.optimizer.step(lr, self.config.optim.clip_grad)
        self.step += 1
        loss_sum = _all_reduce_sum(loss_sum, self.grad_group)
        return {"loss": float(loss_sum / loss_tokens), "lr": lr, "grad_norm": grad_norm,
                "tokens": t.global_batch_size * self.config.model.seq_length}

    @torch.no_grad()
    def evaluate(self) -> float | None:
        valid_path = self.config.data.valid_path
        if not valid_path:
            return None
        valid = PackedDataset(valid_path)
        self.model.eval()
        per_rank = range(self.ctx.data_parallel_rank, min(len(valid), self.config.trainer.eval_batches),
                         self.ctx.data_parallel_size)
        totals = torch.zeros(2, dtype=torch.float64)
        for index in per_rank:
            batch = self._load(valid, [index])
            totals[0] += self._loss_sum(batch).double()
            totals[1] += batch["loss_mask"].sum().double()
        self.model.train()
        totals = _all_reduce_sum(totals, self.grad_group)
        return float(totals[0] / totals[1]) if totals[1] > 0 else None

    def save(self) -> Path:
        return ckpt.save_checkpoint(self.output_dir, self.step, self.model, self._extra_state(),
                                    self.config_yaml, self.config.checkpoint.keep_last,
                                    self.optimizer.master_weights())

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainSummary:
        t, c = self.config.trainer, self.config.checkpoint
        logger = MetricsLogger(self.output_dir, total_steps=t.max_steps, start_step=self.step,
                               enabled=self.ctx.is_main, progress_bar=t.progress_bar)
        if self._resumed_from is not None:
            logger.write(f"resumed from {self._resumed_from} at step {self.step}")
        self.model.train()
        last, stopped = None, False
        resumed_at_end = self._resumed_from is not None and ckpt.checkpoint_step(self._resumed_from) == self.step
        saved = self._resumed_from if resumed_at_end else None
        started, tokens_seen = time.perf_counter(), 0
        with _StopRequest() as stop:
            while self.step < t.max_steps:
                step_start = time.perf_counter()
                last = self.train_step()
                elapsed = time.perf_counter() - step_start
                tokens_seen += last["tokens"]
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    logger.log_step({"step": self.step, **last, "tokens_per_s": last["tokens"] / elapsed,
                                     "step_time_s": elapsed})
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                    valid_loss = self.evaluate()
                    if valid_loss is not None:
                        logger.log_eval(self.step, {"valid_loss": valid_loss})
                stop_now = self._agree(stop.requested)
                if stop_now or (c.save_every and self.step % c.save_every == 0):
                    saved = self.save()
                if stop_now:
                    stopped = True
                    logger.write(f"stop requested: saved {saved} at step {self.step}")
                    break
        if not stopped and (saved is None or ckpt.checkpoint_step(saved) != self.step):
            saved = self.save()
        valid_loss = None if stopped else self.evaluate()
        if valid_loss is not None:
            logger.log_eval(self.step, {"valid_loss": valid_loss})
        wall = time.perf_counter() - started
        summary = TrainSummary(str(self.output_dir), self.step, last["loss"] if last else None, valid_loss,
                               str(saved) if saved else None, tokens_seen / wall if wall > 0 else 0.0, stopped)
        logger.close()
        return summary

    def _agree(self, flag: bool) -> bool:
        """Every rank stops at the same step when any rank received the signal."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        value = torch.tensor([int(flag)])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


def train(config: RunConfig) -> TrainSummary:
    return Trainer(config).fit()
