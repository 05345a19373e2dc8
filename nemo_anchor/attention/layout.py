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

A :class:`PackLayout` holds the boundaries of one pack, read from their tensors once (on a GPU a
host sync) and validated; the model builds it once per micro-batch and every layer reuses it and
the query blocks it derives, so no layer reads the boundaries again. What the backends derive
from the blocks goes to the device with ``non_blocking=True`` (CUDA stages pageable memory at once,
where a blocking copy would wait for the stream), from pinned memory (:func:`to_device`: CUDA-graph capture
refuses pageable copies), so deriving it does not sync either. What is derived is kept on the
:class:`QueryBlocks` it was derived from (:meth:`QueryBlocks.derived`): a layer finds it by attribute, without
hashing the blocks.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar

import numpy as np
import torch

MODES = ("full", "intra_doc", "anchor")

_INTEGER_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
T = TypeVar("T")


@dataclass(frozen=True)
class QueryBlock:
    """Queries at packed positions ``[start, end)``; the one at ``p`` sees keys ``key_start..p`` and ``anchor``."""

    key_start: int
    start: int
    end: int
    anchor: int | None


class QueryBlocks(tuple):
    """The query blocks of one (layout, mode, query range): a tuple of :class:`QueryBlock`, and what the backends
    derived from it (varlen plans, anchor plans, block masks), kept beside it. The layout hands every layer the
    same object, so a layer finds what the first one built by attribute: no per-layer hashing of the blocks (an
    ``lru_cache`` on the tuple hashes each block in Python on every call)."""

    def __new__(cls, blocks=()):
        self = super().__new__(cls, blocks)
        self._derived = {}
        return self

    def derived(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``'s result, built on first use for ``key`` (e.g. the kind of plan and the device) and kept."""
        try:
            return self._derived[key]
        except KeyError:
            value = self._derived[key] = build()
            return value


def derived(blocks: tuple[QueryBlock, ...], key: Hashable, build: Callable[[], T]) -> T:
    """``blocks.derived(key, build)`` for :class:`QueryBlocks`; for a plain tuple (built by hand: tests, tools)
    ``build()`` every time."""
    return blocks.derived(key, build) if isinstance(blocks, QueryBlocks) else build()


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for it: on CUDA copied from pinned memory, ``non_blocking`` (a
    pageable copy is staged synchronously, and CUDA-graph capture refuses it); elsewhere ``x`` itself."""
    if device.type == "cuda":
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def boundaries(cu: torch.Tensor, total: int | None, name: str) -> tuple[int, ...]:
    """The values of a ``cu_seqlens``-style tensor, checked to run strictly upwards from 0 to ``total``
    (to its own last value when ``total`` is None)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in _INTEGER_DTYPES:
        described = f"shape {tuple(cu.shape)} dtype {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor (int32), got {described}")
    values = tuple(cu.tolist())
    if total is None and values:
        total = values[-1]
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must run from 0 to T={total}, got {list(values[:3])}...{list(values[-2:])}")
    for i in range(len(values) - 1):
        if values[i + 1] <= values[i]:
            raise ValueError(
                f"{name} must be strictly increasing, got {name}[{i}]={values[i]} and {name}[{i + 1}]={values[i + 1]}"
            )
    return values


@dataclass(frozen=True, eq=False)
class PackLayout:
    """The document and window boundaries of a pack of ``total`` tokens, validated, as host integers.

    Build it with :func:`pack_layout` (from tensors) or :meth:`of` (from integers), once per
    micro-batch, and pass it to ``anchor_attention(layout=...)`` in every layer: the query blocks
    of each (mode, query range) are derived on first use and kept here.
    """

    doc_bounds: tuple[int, ...]
    window_bounds: tuple[int, ...]
    _blocks: dict = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def of(cls, doc_bounds: tuple[int, ...], window_bounds: tuple[int, ...] | None = None) -> "PackLayout":
        """A layout from increasing integer boundaries (``window_bounds`` None: one window)."""
        window_bounds = (0, doc_bounds[-1]) if window_bounds is None else tuple(window_bounds)
        stray = sorted(set(window_bounds) - set(doc_bounds))
        if stray:
            raise ValueError(f"cu_windows must be a subset of cu_seqlens; window boundaries {stray[:5]} are not "
                             f"document boundaries")
        return cls(tuple(doc_bounds), window_bounds)

    @property
    def total(self) -> int:
        return self.doc_bounds[-1]

    def blocks(self, mode: str, q_offset: int = 0, q_len: int | None = None) -> tuple[QueryBlock, ...]:
        """The query blocks of queries ``[q_offset, q_offset + q_len)`` (default: to the end) under ``mode``."""
        key = (mode, q_offset, self.total - q_offset if q_len is None else q_len)
        if key not in self._blocks:
            self._blocks[key] = query_blocks(self.doc_bounds, self.window_bounds, *key)
        return self._blocks[key]

    def kept_pairs(self, mode: str) -> int:
        """The (query, key) pairs the mask of ``mode`` keeps over the whole pack: the useful work of
        attention. Each query sees the keys from its block's ``key_start`` up to itself and the
        block's anchor."""
        pairs = 0
        for block in self.blocks(mode):
            n, before = block.end - block.start, block.start - block.key_start
            pairs += n * (n + 1) // 2 + n * before + n * (block.anchor is not None)
        return pairs


def pack_layout(cu_seqlens: torch.Tensor, cu_windows: torch.Tensor | None = None, total: int | None = None) -> PackLayout:
    """Read and validate the boundaries of a pack of ``total`` tokens (default: where ``cu_seqlens`` ends).

    The one place the boundaries go to the host: call it once per micro-batch, not per layer.
    """
    doc_bounds = boundaries(cu_seqlens, total, "cu_seqlens")
    window_bounds = None if cu_windows is None else boundaries(cu_windows, doc_bounds[-1], "cu_windows")
    return PackLayout.of(doc_bounds, window_bounds)


def lognormal_documents(total: int, seed: int, mean_tokens: float, sigma: float = 1.0,
                        window: int | None = None) -> tuple[int, ...]:
    """Document boundaries ``(0, ..., total)`` of a synthetic pack, for checks and benchmarks: seeded
    log-normal lengths of mean ``mean_tokens`` (as real corpora have), every ``window`` tokens a new
    window whose first document starts there (default: one window); a window's last document is cut to fit."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean_tokens) - sigma**2 / 2
    bounds = [0]
    for window_end in range(window or total, total + 1, window or total):
        while bounds[-1] < window_end:
            bounds.append(min(window_end, bounds[-1] + max(1, int(rng.lognormal(mu, sigma)))))
    return tuple(bounds)


def layout_blocks(
    cu_seqlens: torch.Tensor, cu_windows: torch.Tensor | None, mode: str, total: int, q_offset: int, q_len: int
) -> tuple[QueryBlock, ...]:
    """Validate the boundaries of a packed sequence of ``total`` tokens and return its query blocks."""
    return pack_layout(cu_seqlens, cu_windows, total).blocks(mode, q_offset, q_len)


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
    return QueryBlocks(
        QueryBlock(key_start, max(start, q_offset), min(end, q_end), anchor)
        for key_start, start, end, anchor in segments
        if start < q_end and end > q_offset
    )


def per_query(blocks: tuple[QueryBlock, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key_start, anchor)`` of every query row as int64 tensors of length Tq (anchor -1 when none)."""
    lengths = torch.tensor([b.end - b.start for b in blocks])
    key_start = torch.tensor([b.key_start for b in blocks]).repeat_interleave(lengths)
    anchor = torch.tensor([-1 if b.anchor is None else b.anchor for b in blocks]).repeat_interleave(lengths)
    return to_device(key_start, device), to_device(anchor, device)


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


def varlen_plan(blocks: tuple[QueryBlock, ...], device: torch.device) -> VarlenPlan:
    """The plan of ``blocks`` on ``device``, built once per :class:`QueryBlocks` and device."""
    return derived(blocks, ("varlen_plan", device), lambda: _varlen_plan(blocks, device))


def _varlen_plan(blocks: tuple[QueryBlock, ...], device: torch.device) -> VarlenPlan:
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
        kv_rows = to_device(torch.cat(pieces), device)

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return to_device(torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)

    return VarlenPlan(cumulative(q_lengths), cumulative(k_lengths), max(q_lengths), max(k_lengths), kv_rows)
