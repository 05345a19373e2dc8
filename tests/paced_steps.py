"""A Lightning callback for the NeMo Slurm test's job: each training step lasts at least ``seconds``.

The tiny model trains a step in ~30 ms on the CPU, so a run would end between the test seeing a step and its
signal or node failure arriving. Sleeping paces the run without spending CPU. Imported on the cluster's nodes
(the job's PYTHONPATH has tests/)."""
import time

import lightning.pytorch as pl


class PacedSteps(pl.Callback):
    def __init__(self, seconds: float = 0.5):
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(max(0.0, self.seconds - (time.monotonic() - self._started)))
