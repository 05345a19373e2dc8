"""The checkpoints of a training run, for averaging evaluations over the last K (paper, Section 4.2).

Assumed layout (Megatron's naming, written by ``nemo-anchor train``)::

    OUTPUT_DIR/checkpoints/iter_0000100/
    OUTPUT_DIR/checkpoints/iter_0000110/
    ...

Each ``iter_<N>`` directory is one checkpoint, loadable by
``nemo_anchor.export.inference.load_hf_model``; other entries (for example Megatron's
``latest_checkpointed_iteration.txt``) are ignored.
"""
from __future__ import annotations

import re
from pathlib import Path

_ITERATION_DIR = re.compile(r"iter_(\d+)")


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``(iteration, directory)`` of every checkpoint of a training run, oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        raise ValueError(f"{output_dir} is not a training output_dir: {root} does not exist")
    found = []
    for entry in root.iterdir():
        match = _ITERATION_DIR.fullmatch(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    if not found:
        raise ValueError(f"no iter_<N> checkpoint directories in {root}")
    return sorted(found)


def last_checkpoints(output_dir: str | Path, count: int) -> list[tuple[int, Path]]:
    """The ``count`` most recent checkpoints, oldest first (all of them if there are fewer)."""
    if count < 1:
        raise ValueError(f"the number of checkpoints to average must be >= 1, got {count}")
    return list_checkpoints(output_dir)[-count:]
