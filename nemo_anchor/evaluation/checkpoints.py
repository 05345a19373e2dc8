"""The checkpoints of a training run, for averaging evaluations over the last K (paper, Section 4.2).

The layout is the trainer's (``nemo_anchor.run_dir``): ``OUTPUT_DIR/checkpoints/iter_NNNNNNN/``,
one directory per saved step, each loadable by ``nemo_anchor.export.inference.load_hf_model``.
"""
from __future__ import annotations

from pathlib import Path

from nemo_anchor.run_dir import RunDir, checkpoint_step


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``(iteration, directory)`` of every checkpoint of a training run, oldest first."""
    root = RunDir(output_dir).checkpoints
    if not root.is_dir():
        raise ValueError(f"{output_dir} is not a training output_dir: {root} does not exist")
    found = RunDir(output_dir).list_checkpoints()
    if not found:
        raise ValueError(f"no iter_NNNNNNN checkpoint directories in {root}")
    return [(checkpoint_step(path), path) for path in found]


def last_checkpoints(output_dir: str | Path, count: int) -> list[tuple[int, Path]]:
    """The ``count`` most recent checkpoints, oldest first (all of them if there are fewer)."""
    if count < 1:
        raise ValueError(f"the number of checkpoints to average must be >= 1, got {count}")
    return list_checkpoints(output_dir)[-count:]
