"""``metrics.jsonl`` for NeMo runs: the rows ``nemo-anchor train`` writes, from a Lightning callback.

One JSON object per optimizer step (``step``, ``loss``, ``lr``, ``tokens``, ``tokens_per_s``,
``step_time_s``, ``tflops_per_device``, ``mfu``, ``hfu``) in NeMo's log directory (``log.log_dir`` /
``log.name``), written by global rank 0 through the project's ``MetricsLogger``; FLOPs and the
peak they are measured against come from ``nemo_anchor.training.throughput``, as in our trainer.
"""
from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl

from nemo_anchor.convert.megatron_config import model_config_from_megatron
from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import throughput
from nemo_anchor.training.metrics import MetricsLogger


class AnchorMetricsCallback(pl.Callback):
    """Writes ``metrics.jsonl`` in the run's log directory (needs ``AnchorPackedDataModule`` data)."""

    def __init__(self, peak_tflops: float | None = None):
        self.peak_tflops = peak_tflops
        self._logger = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep ``metrics.jsonl`` where it is on a resume: NeMo's ``ModelCheckpoint.setup`` (which runs after
        this, checkpoint callbacks run last) moves the log directory's files into ``run_N/``; a resumed run
        continues the file instead, as ``nemo-anchor train`` does."""
        from nemo.utils import AppState

        app_state = AppState()
        moving = getattr(app_state, "files_to_move", None) or []
        app_state.files_to_move = [path for path in moving if Path(path).name != RunDir("").metrics.name]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from nemo.utils import AppState

        config = pl_module.config
        precision = "bf16" if config.bf16 else "fp32"
        self._peak, _ = throughput.resolve_peak_tflops(self.peak_tflops, pl_module.device, precision)
        self._model = model_config_from_megatron(config)
        self._vocab_size = config.vocab_size or pl_module.tokenizer.vocab_size
        self._logger = MetricsLogger(RunDir(AppState().log_dir), total_steps=trainer.max_steps,
                                     start_step=trainer.global_step, enabled=trainer.is_global_zero, progress_bar=False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = time.perf_counter() - self._started
        data = trainer.datamodule
        global_batch = data.global_batch_size
        consumed = data.data_sampler.compute_consumed_samples(trainer.global_step - data.init_global_step)
        stream = data.train_dataset  # sample i is window stream.window(i) of the packed windows
        windows = [stream.window(i) for i in range(consumed - global_batch, consumed)]
        flops = throughput.global_batch_flops(self._model, self._vocab_size, stream.dataset, windows)
        tokens = global_batch * data.seq_length
        loss = trainer.callback_metrics["reduced_train_loss"]
        self._logger.log_train_step(
            trainer.global_step, {"loss": float(loss), "lr": trainer.optimizers[0].param_groups[0]["lr"], "tokens": tokens},
            seconds=elapsed, flops=flops, devices=trainer.world_size, peak_tflops=self._peak)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._logger is not None:
            self._logger.close()
            self._logger = None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.on_train_end(trainer, pl_module)

