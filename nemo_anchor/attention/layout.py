"""Packed-window layouts: validate document/window boundaries and derive what each backend needs.

Every mode reduces to one shape of mask. The queries are cut into *blocks* of consecutive
tokens; the query at packed position ``p`` of a block sees the keys ``key_start .. p`` and,
when the block has one, its ``anchor`` key (always before ``key_start``):

- ``full``: one block per window, no anchor;
- ``intra_doc``: one block per document, no anchor;
- ``anchor``: one block per document; a document that does not begin its window gets the
  window's first token as anchor (the window's first document holds it already).

``key_start`` may lie before the block's first query: the keys between are visible to every
query of the block. This happens when the queries are only the positions
``[q_offset, q_offset + Tq)`` of the keys' sequence (context parallelism: each block keeps its
rows inside that range), and when a window's first document is the anchor alone (the anchor
and the next document's keys are then one interval).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MODES = ("full", "intra_doc", "anchor")

_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


@dataclass(frozen=True)
class QueryBlock:
    """Queries at packed positions ``[start, end)``; the one at ``p`` sees keys ``key_start..p`` and ``anchor``."""

    key_start: int
    start: int
    end: int
    anchor: int | None


def boundaries(cu: torch.Tensor, total: int, name: str) -> tuple[int, ...]:
    """The values of a ``cu_seqlens``-style tensor, checked to run strictly upwards from 0 to ``total``."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in _INTEGER_DTYPES:
        described = f"shape {tuple(cu.shape)} dtype {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor (int32), got {described}")
    values = tuple(cu.tolist())
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must run from 0 to T={total}, got {list(values[:3])}...{list(values[-2:])}")
    for i in range(len(values) - 1):
        if values[i + 1] <= values[i]:
            raise ValueError(
                f"{name} must be strictly increasing, got {name}[{i}]={values[i]} and {name}[{i + 1}]={values[i + 1]}"
            )
    return values


def layout_blocks(
    cu_seqlens: torch.Tensor, cu_windows: torch.Tensor | None, mode: str, total: int, q_offset: int, q_len: int
) -> tuple[QueryBlock, ...]:
    """Validate the boundaries of a packed sequence of ``total`` tokens and return its query blocks."""
    doc_bounds = boundaries(cu_seqlens, total, "cu_seqlens")
    window_bounds = (0, total) if cu_windows is None else boundaries(cu_windows, total, "cu_windows")
    stray = sorted(set(window_bounds) - set(doc_bounds))
    if stray:
        raise ValueError(f"cu_windows must be a subset of cu_seqlens; window boundaries {stray[:5]} are not document boundaries")
    return query_blocks(doc_bounds, window_bounds, mode, q_offset, q_len)


@functools.lru_cache(maxsize=64)
def query_blocks(
    doc_bounds: tuple[int, ...], window_bounds: tuple[int, ...], mode: str, q_offset: int, q_len: int
) -> tuple[QueryBlock, ...]:
    """The query blocks (see the module docstring) of queries ``[q_offset, q_offset + q_len)``."""
    segments = []  # (key_start, start, end, anchor)
    if mode == "full":
        segments = [(start, start, end, None) for start, end in zip(window_bounds, window_bounds[1:])]
    else:
        window_starts, anchor = set(window_bounds[:-1]), 0
        for start, end in zip(doc_bounds, doc_bounds[1:]):
            anchor = start if start in window_starts else anchor
            if mode == "intra_doc" or anchor == start:
                segments.append((start, start, end, None))
            elif anchor == start - 1:  # the window's first document is its anchor alone: one interval
                segments.append((anchor, start, end, None))
            else:
                segments.append((start, start, end, anchor))
    q_end = q_offset + q_len
    return tuple(
        QueryBlock(key_start, max(start, q_offset), min(end, q_end), anchor)
        for key_start, start, end, anchor in segments
        if start < q_end and end > q_offset
    )


def per_query(blocks: tuple[QueryBlock, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_start, anchor)`` of every query row as int64 tensors of length Tq (anchor -1 when none)."""
    lengths = torch.tensor([b.end - b.start for b in blocks])
    key_start = torch.tensor([b.key_start for b in blocks]).repeat_interleave(lengths)
    anchor = torch.tensor([-1 if b.anchor is None else b.anchor for b in blocks]).repeat_interleave(lengths)
    return key_start.to(device), anchor.to(device)


@dataclass(frozen=True)
class VarlenPlan:
    """Arguments of a varlen kernel (flash-attn, TE THD) whose sequences are the query blocks.

    Sequence ``i`` has the queries of block ``i`` and the keys ``[anchor] + key_start..end-1``,
    gathered from k/v by ``kv_rows``; with bottom-right causal alignment each query then sees
    exactly its keys. ``kv_rows`` is a slice (a view, no copy) when no anchor is inserted.
    """

    cu_seqlens_q: torch.Tensor  # int32 [n + 1]
    cu_seqlens_k: torch.Tensor  # int32 [n + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    kv_rows: slice | torch.Tensor


@functools.lru_cache(maxsize=64)
def varlen_plan(blocks: tuple[QueryBlock, ...], device: torch.device) -> VarlenPlan:
    q_lengths = [b.end - b.start for b in blocks]
    k_lengths = [b.end - b.key_start + (b.anchor is not None) for b in blocks]
    tiled = blocks[0].anchor is None and all(
        b.anchor is None and b.key_start == previous.end for previous, b in zip(blocks, blocks[1:])
    )
    if tiled:  # the keys of the blocks, one after the other, are k[first key_start : last end]
        kv_rows: slice | torch.Tensor = slice(blocks[0].key_start, blocks[-1].end)
    else:
        pieces = []
        for b in blocks:
            if b.anchor is not None:
                pieces.append(torch.tensor([b.anchor]))
            pieces.append(torch.arange(b.key_start, b.end))
        kv_rows = torch.cat(pieces).to(device)

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return VarlenPlan(cumulative(q_lengths), cumulative(k_lengths), max(q_lengths), max(k_lengths), kv_rows)
