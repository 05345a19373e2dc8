"""Progress for people (tqdm) and for tools (metrics.jsonl, TensorBoard), written by rank 0."""
from __future__ import annotations

import json
import os

from tqdm.auto import tqdm

from nemo_anchor.atomic import atomic_file
from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import throughput


def _drop_rows_after(path: os.PathLike, step: int) -> None:
    """Keep the rows of ``metrics.jsonl`` up to ``step``: a resumed run replays the steps after its checkpoint."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as handle:
        kept = [line for line in handle if line.strip() and json.loads(line).get("step", 0) <= step]
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.writelines(kept)


class MetricsLogger:
    """One JSON object per optimizer step in ``metrics.jsonl``, the same scalars in TensorBoard.

    Started at ``start_step`` (a resume), rows and TensorBoard events after it are discarded
    first, so each step appears once however often the run was interrupted.
    """

    def __init__(self, run: RunDir, *, total_steps: int, start_step: int, enabled: bool, progress_bar: bool):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        _drop_rows_after(run.metrics, start_step)
        self._jsonl = open(run.metrics, "a", encoding="utf-8")
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(run.tensorboard), purge_step=start_step + 1)
        if progress_bar:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def log_train_step(self, step: int, values: dict, *, seconds: float, flops: float, devices: int,
                       peak_tflops: float) -> None:
        """One optimizer step's row, the same fields from ``nemo-anchor train``, NeMo and Bridge: ``values``
        (``loss``, ``lr``, ``tokens`` ...), then tokens/s, the step time, TFLOP/s per device and MFU."""
        self.log_step({"step": step, **values, "tokens_per_s": values["tokens"] / seconds, "step_time_s": seconds,
                       **throughput.rates(flops, seconds, devices, peak_tflops)})

    def log_step(self, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(f"train/{key}", value, record["step"])
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                  tflops=f"{record['tflops_per_device']:.3g}", mfu=f"{record['mfu']:.1%}", refresh=False)
            self._bar.update(1)

    def log_eval(self, step: int, record: dict) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **record}) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            self._tb.add_scalar(f"eval/{key}", value, step)
        self.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()))

    def log_memory(self, step: int, per_rank: dict[str, list[int]]) -> None:
        """One row: each rank's bytes of weights, gradients and optimizer state (measured after a step)."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "memory": per_rank}) + "\n")
        self._jsonl.flush()
        gib = {key: max(values) / 1024 ** 3 for key, values in per_rank.items()}
        self.write("state per rank (max): " + ", ".join(f"{k.removesuffix('_bytes')} {v:.2f} GiB" for k, v in gib.items()))

    def write(self, message: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
