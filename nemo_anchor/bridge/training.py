"""What Bridge's ``pretrain()`` runs on packed windows: our forward step, and metrics.jsonl like ``nemo-anchor train``.

The forward step is the one our trainer runs (``nemo_anchor.training.forward``): the batch is
sharded for context parallelism and moved to the device by the shared data step
(:func:`nemo_anchor.training.mixin.anchor_data_step`), then one THD pack goes through the model; the loss contract (sum, tokens, reported pair) is Megatron's, which
Bridge's loop reduces over the data x context-parallel group.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.bridge.training.callbacks import Callback, CallbackContext
from megatron.core.utils import get_model_config

from nemo_anchor.convert.megatron_config import model_config_from_megatron
from nemo_anchor.training.mixin import anchor_data_step
from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import throughput
from nemo_anchor.training.forward import megatron_forward_step
from nemo_anchor.training.metrics import MetricsLogger


def anchor_forward_step(data_iterator, model):
    """Bridge's ``forward_step_func``: one micro-batch of packed windows (``(output, loss function)``)."""
    attention_type = get_model_config(model).anchor_attention_type
    return megatron_forward_step(iter([anchor_data_step(data_iterator, attention_type)]), model)


class MetricsCallback(Callback):
    """``metrics.jsonl`` (and TensorBoard) under ``checkpoint.save``: step, loss, lr, tokens/s, TFLOP/s, MFU, HFU."""

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
        # FLOPs do not depend on the model family, which a provider's class does not name
        self.model_config = model_config_from_megatron(cfg.model, default_architecture="llama")
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
        values = {"loss": float(context.loss_dict["loss"]), "lr": self.lr,
                  "grad_norm": None if context.grad_norm is None else float(context.grad_norm), "tokens": tokens}
        self.logger.log_train_step(self.step, values, seconds=elapsed, flops=flops, devices=self.devices,
                                   peak_tflops=self.peak)

    def on_train_end(self, context: CallbackContext) -> None:
        if self.logger is not None:
            self.logger.close()
