"""Fast CPU backend: torch's CPU flash-attention kernel on documents batched by length, merged through the log-sum-exp.

The keys a block sees split into parts that need no mask: the causal diagonal (its queries
against their own positions: a square, where the kernel's top-left causal mask is the right
one), the keys before its first query (all visible: with ``q_offset``, or a BOS-only first
document), and the anchor column (one key).

Diagonals of similar length go through the kernel together: a *bucket* gathers its blocks'
rows into one padded ``[n, H, L, D]`` batch (padding at each block's end, so the causal mask
keeps real queries off padded keys; padded query rows are dropped, and in the backward carry a
zero output gradient and an infinite log-sum-exp, so they contribute nothing). Lengths within a
bucket differ by at most ``_BUCKET_RATIO``, which bounds the padded work; a bucket of one block
reads its rows as views, without a copy. This turns one kernel call per document into about a
dozen per window, whatever the number of documents. The prefix parts (rare) run per block; the
anchor column is computed for all rows of a window at once in a handful of vectorised ops.

The kernel returns its log-sum-exp without a gradient, hence this ``autograd.Function``: its
backward runs the kernel's backward on each part with the *merged* output and log-sum-exp,
which gives the exact gradients of the merged softmax (the identity ring attention relies on).
Memory O(T * H * D): no mask or score matrix is ever built; the padded buckets are O(T) too.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nemo_anchor.attention.layout import QueryBlock

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# a bucket's blocks are at least 1 / _BUCKET_RATIO of its longest: padded work <= 1 - 1/ratio^2 of the bucket's
_BUCKET_RATIO = 1.25
# diagonals up to this length share one bucket whatever their ratio: per-call overhead dominates there
_SHORT = 32


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return None if q.device.type == "cpu" else f"it runs on CPU tensors only, got device {q.device}"


def attention(q, k, v, blocks, q_offset, scale):
    return _BlockwiseFlashAttention.apply(q, k, v, blocks, q_offset, scale)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` -> the kernel's ``[1, H, n, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


@dataclass(frozen=True)
class _Bucket:
    """Diagonals padded to ``length`` and batched: one kernel call.

    ``rows`` (a slice for one unpadded block, else int64 ``[count * length]``) are the q rows
    of the padded slots, padding pointing at row 0; the keys are the same positions + q_offset.
    ``slots``/``real_rows`` (None without padding): the real slots and their q rows.
    """

    count: int
    length: int
    rows: slice | torch.Tensor
    slots: torch.Tensor | None
    real_rows: torch.Tensor | None

    def gather(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``x[rows + offset]`` as the kernel's ``[count, H, length, D]`` (a view for a slice)."""
        if isinstance(self.rows, slice):
            return _bhsd(x[self.rows.start + offset:self.rows.stop + offset])
        picked = x.index_select(0, self.rows + offset if offset else self.rows)
        return picked.view(self.count, self.length, *x.shape[1:]).transpose(1, 2)

    def gather_rows(self, x: torch.Tensor, pad_value: float) -> torch.Tensor:
        """Like :meth:`gather` for per-row tensors (``[Tq, H, D]`` or ``[Tq, H]``), padded slots set to ``pad_value``."""
        if isinstance(self.rows, slice):
            return x[self.rows].transpose(0, 1).unsqueeze(0)
        picked = x.index_select(0, self.rows)
        if self.slots is not None:
            padded = torch.ones(picked.shape[0], dtype=torch.bool)
            padded[self.slots] = False
            picked[padded] = pad_value
        return picked.view(self.count, self.length, *x.shape[1:]).transpose(1, 2)

    def scatter(self, target: torch.Tensor, part: torch.Tensor, offset: int = 0, add: bool = False) -> None:
        """Write (or add) the real slots of ``part`` ``[count, H, length, ...]`` into ``target`` at rows + offset."""
        flat = part.transpose(1, 2).reshape(self.count * self.length, *part.shape[1:2], *part.shape[3:])
        if isinstance(self.rows, slice):
            rows = slice(self.rows.start + offset, self.rows.stop + offset)
            if add:
                target[rows] += flat
            else:
                target[rows] = flat
            return
        index = self.rows if self.slots is None else self.real_rows
        if self.slots is not None:
            flat = flat.index_select(0, self.slots)
        index = index + offset if offset else index
        if add:
            target.index_add_(0, index, flat.to(target.dtype))
        else:
            target.index_copy_(0, index, flat.to(target.dtype))


@functools.lru_cache(maxsize=64)
def _buckets(blocks: tuple[QueryBlock, ...], q_offset: int) -> tuple[_Bucket, ...]:
    """The diagonals of ``blocks`` grouped by length (see the module docstring)."""
    diagonals = sorted(((b.end - b.start, b.start - q_offset) for b in blocks), reverse=True)
    groups: list[list[tuple[int, int]]] = []
    for length, start in diagonals:
        if groups and (length * _BUCKET_RATIO >= groups[-1][0][0] or groups[-1][0][0] <= _SHORT):
            groups[-1].append((length, start))
        else:
            groups.append([(length, start)])
    buckets = []
    for group in groups:
        width = group[0][0]
        if len(group) == 1:
            buckets.append(_Bucket(1, width, slice(group[0][1], group[0][1] + width), None, None))
            continue
        rows = torch.zeros(len(group), width, dtype=torch.long)
        real = torch.zeros(len(group), width, dtype=torch.bool)
        for i, (length, start) in enumerate(group):
            rows[i, :length] = torch.arange(start, start + length)
            real[i, :length] = True
        rows, real = rows.reshape(-1), real.reshape(-1)
        padded = not bool(real.all())
        slots = real.nonzero().squeeze(1) if padded else None
        buckets.append(_Bucket(len(group), width, rows, slots, rows[slots] if padded else None))
    return tuple(buckets)


def _prefix_calls(blocks: tuple[QueryBlock, ...], q_offset: int):
    """``(rows of q, key rows)`` of the blocks whose queries also see all keys before their first one."""
    for block in blocks:
        if block.key_start < block.start:
            yield slice(block.start - q_offset, block.end - q_offset), slice(block.key_start, block.start)


def _anchor_runs(blocks: tuple[QueryBlock, ...], q_offset: int) -> list[tuple[slice, int]]:
    """``(rows of q, anchor)`` for each run of consecutive blocks sharing an anchor (about one per window)."""
    runs: list[tuple[slice, int]] = []
    for block in blocks:
        if block.anchor is None:
            continue
        start, end = block.start - q_offset, block.end - q_offset
        if runs and runs[-1][1] == block.anchor and runs[-1][0].stop == start:
            start = runs.pop()[0].start
        runs.append((slice(start, end), block.anchor))
    return runs


def _per_query_head(x: torch.Tensor, query_heads: int) -> torch.Tensor:
    """``[Hkv, D]`` -> fp32 ``[Hq, D]``: query head h reads key/value head h // group."""
    return x.float().repeat_interleave(query_heads // x.shape[0], 0)


def _merge(out, lse, rows, part_out, part_lse):
    """Fold a partial attention result over other keys into ``out``/``lse`` at ``rows``."""
    a, b = lse[rows], part_lse
    # logaddexp written out: torch.logaddexp rounds differently with tensor size, which would make
    # results depend on the head count and break bitwise context parallelism (a2a splits heads)
    merged = torch.maximum(a, b) + torch.log1p(torch.exp(-(a - b).abs()))
    out[rows] = (out[rows].float() * (lse[rows] - merged).exp().unsqueeze(-1)
                 + part_out.float() * (part_lse - merged).exp().unsqueeze(-1)).to(out.dtype)
    lse[rows] = merged


class _BlockwiseFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, q_offset, scale):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)  # [Tq, Hq]: the kernel's memory order
        for bucket in _buckets(blocks, q_offset):  # every query row has exactly one diagonal
            o, l = _flash(bucket.gather(q), bucket.gather(k, q_offset), bucket.gather(v, q_offset), 0.0, True,
                          scale=scale)
            bucket.scatter(out, o)
            bucket.scatter(lse, l)
        for rows, keys in _prefix_calls(blocks, q_offset):
            o, l = _flash(_bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), 0.0, False, scale=scale)
            _merge(out, lse, rows, o[0].transpose(0, 1), l[0].transpose(0, 1))
        for rows, anchor in _anchor_runs(blocks, q_offset):
            scores = torch.einsum("rhd,hd->rh", q[rows].float(), _per_query_head(k[anchor], q.shape[1])) * scale
            _merge(out, lse, rows, _per_query_head(v[anchor], q.shape[1]), scores)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.q_offset, ctx.scale = blocks, q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, q_offset, scale, (kv_heads, head_dim) = ctx.blocks, ctx.q_offset, ctx.scale, k.shape[1:]
        # fp32 accumulators: a query row and an anchor key collect several parts
        dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
        for bucket in _buckets(blocks, q_offset):
            dq_part, dk_part, dv_part = _flash_backward(
                bucket.gather_rows(grad_out, 0.0), bucket.gather(q), bucket.gather(k, q_offset),
                bucket.gather(v, q_offset), bucket.gather_rows(out, 0.0),
                bucket.gather_rows(lse, float("inf")), 0.0, True, scale=scale,
            )
            bucket.scatter(dq, dq_part, add=True)
            bucket.scatter(dk, dk_part, q_offset, add=True)
            bucket.scatter(dv, dv_part, q_offset, add=True)
        for rows, keys in _prefix_calls(blocks, q_offset):
            dq_part, dk_part, dv_part = _flash_backward(
                _bhsd(grad_out[rows]), _bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), _bhsd(out[rows]),
                lse[rows].T.unsqueeze(0), 0.0, False, scale=scale,
            )
            dq[rows] += dq_part[0].transpose(0, 1)
            dk[keys] += dk_part[0].transpose(0, 1)
            dv[keys] += dv_part[0].transpose(0, 1)
        for rows, anchor in _anchor_runs(blocks, q_offset):
            key, value = (_per_query_head(x[anchor], q.shape[1]) for x in (k, v))
            q_rows, g = q[rows].float(), grad_out[rows].float()
            probs = (torch.einsum("rhd,hd->rh", q_rows, key) * scale - lse[rows]).exp()
            # softmax backward: dS = P * (dP - rowsum(dO * O))
            d_scores = probs * (torch.einsum("rhd,hd->rh", g, value) - (g * out[rows].float()).sum(-1))
            dq[rows] += scale * d_scores.unsqueeze(-1) * key
            dk[anchor] += scale * torch.einsum("rh,rhd->hd", d_scores, q_rows).view(kv_heads, -1, head_dim).sum(1)
            dv[anchor] += torch.einsum("rh,rhd->hd", probs, g).view(kv_heads, -1, head_dim).sum(1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
