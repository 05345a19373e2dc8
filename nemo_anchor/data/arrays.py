"""Vectorised index helpers shared by the document store and the packer."""
from __future__ import annotations

import numpy as np


def exclusive_cumsum(lengths: np.ndarray) -> np.ndarray:
    """``[0, l0, l0+l1, ...]`` without the total: the start of each run when runs are laid end to end."""
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + l) for s, l in zip(starts, lengths)])`` without a Python loop (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    shift = np.asarray(starts, dtype=np.int64) - exclusive_cumsum(lengths)
    return np.repeat(shift, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def runs_of_false(flags: np.ndarray) -> np.ndarray:
    """``[R, 2]`` int64 ``[start, end)`` of every maximal run of False in a 1-D bool array."""
    edges = np.diff(np.concatenate(([True], flags, [True])).astype(np.int8))
    return np.stack([np.flatnonzero(edges == -1), np.flatnonzero(edges == 1)], axis=1).astype(np.int64)
