"""What Bridge's ``pretrain()`` runs on packed windows: our forward step, and metrics.jsonl like ``nemo-anchor train``.

The forward step is the one our trainer runs (``nemo_anchor.training.forward``): the batch is
sharded for context parallelism and moved to the device by the shared data step
(:func:`nemo_anchor.nemo.mixin.anchor_data_step`), then one THD pack goes through the model; the loss contract (sum, tokens, reported pair) is Megatron's, which
Bridge's loop reduces over the data x context-parallel group.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.bridge.training.callbacks import Callback, CallbackContext
from megatron.core.utils import get_model_config

from nemo_anchor.model.config import ModelConfig
from nemo_anchor.nemo.mixin import anchor_data_step
from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import throughput
from nemo_anchor.training.forward import megatron_forward_step
from nemo_anchor.training.metrics import MetricsLogger


def anchor_forward_step(data_iterator, model):
    """Bridge's ``forward_step_func``: one micro-batch of packed windows (``(output, loss function)``)."""
    attention_type = get_model_config(model).anchor_attention_type
    return megatron_forward_step(iter([anchor_data_step(data_iterator, attention_type)]), model)


def flops_model_config(provider) -> ModelConfig:
    """Our ``model:`` section for the provider's shape, as :mod:`nemo_anchor.model.flops` counts it."""
    recompute = {"selective": "selective", "full": "full"}.get(provider.recompute_granularity, "none")
    return ModelConfig(
        attention_type=provider.attention_type, num_layers=provider.num_layers, hidden_size=provider.hidden_size,
        ffn_hidden_size=provider.ffn_hidden_size, num_attention_heads=provider.num_attention_heads,
        num_query_groups=provider.num_query_groups or provider.num_attention_heads, head_dim=provider.kv_channels,
        seq_length=provider.seq_length, recompute=recompute,
        recompute_num_layers=provider.recompute_num_layers if recompute == "full" else None,
        pipeline_model_parallel_size=provider.pipeline_model_parallel_size)


class MetricsCallback(Callback):
    """``metrics.jsonl`` (and TensorBoard) under ``checkpoint.save``: step, loss, lr, tokens/s, TFLOP/s, MFU."""

    def __init__(self, peak_tflops: float | None = None):
        self.peak_tflops = peak_tflops
        self.logger = None

    def on_train_start(self, context: CallbackContext) -> None:
        cfg = context.state.cfg
        if not cfg.checkpoint.save:
            raise ValueError("checkpoint.save is not set: metrics.jsonl and checkpoints are written there")
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        precision = "bf16" if cfg.model.bf16 else "fp32"
        self.peak, source = throughput.resolve_peak_tflops(self.peak_tflops, device, precision)
        self.model_config = flops_model_config(cfg.model)
        self.stream = cfg.dataset.stream(0)
        self.devices = dist.get_world_size()
        # Megatron's last rank (is_last_rank) is on the last pipeline stage, which alone holds the loss
        self.writes = dist.get_rank() == dist.get_world_size() - 1
        Path(cfg.checkpoint.save).mkdir(parents=True, exist_ok=True)
        self.logger = MetricsLogger(RunDir(cfg.checkpoint.save), total_steps=cfg.train.train_iters,
                                    start_step=context.state.train_state.step, enabled=self.writes,
                                    progress_bar=False)
        self.logger.write(f"MFU against {self.peak:.4g} TFLOP/s per device ({source})")

    def on_train_step_start(self, context: CallbackContext) -> None:
        self.step = context.state.train_state.step + 1
        self.lr = context.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
        self.started = time.perf_counter()

    def on_train_step_end(self, context: CallbackContext) -> None:
        if not self.writes:
            return
        elapsed = time.perf_counter() - self.started
        cfg = context.state.cfg
        batch = cfg.train.global_batch_size
        windows = [self.stream.window(i) for i in range((self.step - 1) * batch, self.step * batch)]
        flops = throughput.global_batch_flops(self.model_config, cfg.model.vocab_size, self.stream.dataset, windows)
        tokens = batch * cfg.model.seq_length
        record = {"step": self.step, "loss": float(context.loss_dict["loss"]), "lr": self.lr,
                  "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
                  "tokens": tokens, "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                  **throughput.rates(flops, elapsed, self.devices, self.peak)}
        self.logger.log_step(record)

    def on_train_end(self, context: CallbackContext) -> None:
        if self.logger is not None:
            self.logger.close()
