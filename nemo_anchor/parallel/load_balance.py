"""Megatron's load-balanced context-parallel layout of a packed sequence.

Every window of the pack is cut into ``2 * cp`` equal chunks and rank r holds chunks r and
``2cp - 1 - r`` of each window, window after window. Causal attention costs grow along a window,
so pairing an early chunk with a late one gives every rank the same work. Megatron slices RoPE
the same way per ``cu_seqlens_q`` segment (``_get_thd_freqs_on_this_cp_rank``), so a rank's
tokens get their positions without any exchange.
"""
from __future__ import annotations

import functools

import torch


def check_windows(window_bounds: tuple[int, ...], cp_size: int) -> None:
    """Raise ValueError unless every window length is a positive multiple of ``2 * cp_size``."""
    for i, (start, end) in enumerate(zip(window_bounds, window_bounds[1:])):
        if end <= start or (end - start) % (2 * cp_size):
            raise ValueError(
                f"window {i} ([{start}, {end}), {end - start} tokens) cannot be split for context "
                f"parallelism: each window is cut into 2 x context_parallel_size = {2 * cp_size} equal "
                f"chunks, so its length must be a multiple of {2 * cp_size} (set model.seq_length accordingly)")


@functools.lru_cache(maxsize=64)
def rank_chunks(window_bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` position ranges rank ``cp_rank`` holds, in its local order."""
    check_windows(window_bounds, cp_size)
    chunks = []
    for start, end in zip(window_bounds, window_bounds[1:]):
        size = (end - start) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            chunks.append((start + chunk * size, start + (chunk + 1) * size))
    return tuple(chunks)


def rank_positions(window_bounds: tuple[int, ...], cp_size: int, cp_rank: int) -> torch.Tensor:
    """int64 ``[total / cp]``: the position in the whole pack of each of the rank's local rows."""
    return torch.cat([torch.arange(a, b) for a, b in rank_chunks(window_bounds, cp_size, cp_rank)])


@functools.lru_cache(maxsize=64)
def rank_major_order(window_bounds: tuple[int, ...], cp_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``, int64 ``[total]`` on ``device``.

    Stacking every rank's local rows (rank 0's first) gives the rows at positions ``order``;
    ``stacked[inverse]`` puts them back in position order, and ``in_order[order]`` stacks them.
    """
    order = torch.cat([rank_positions(window_bounds, cp_size, rank) for rank in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    return order.to(device, non_blocking=True), inverse.to(device, non_blocking=True)
