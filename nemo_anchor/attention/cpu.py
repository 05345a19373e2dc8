"""Fast CPU backend: torch's CPU flash-attention kernel on documents batched by length.

Each query block (a document) is one *entry* of a kernel call: its queries against their own
positions, a square where the kernel's top-left causal mask is the right one. A block with an
anchor puts the anchor key in front of its keys and a dummy query in front of its queries: query
``i + 1`` then sees the anchor and the block's keys up to its own, exactly the anchor mask, in
one softmax; the dummy row is dropped. Keys a block sees before its first query (with
``q_offset``, or after a BOS-only first document) form a second, unmasked part merged through
the log-sum-exp (rare: per block).

Entries of similar length share one kernel call, a *bucket*: their rows are gathered into one
padded ``[n, H, L, D]`` batch (padding at each entry's end, so the causal mask keeps real queries
off padded keys). Lengths within a bucket differ by at most ``_BUCKET_RATIO`` (entries up to
``_SHORT`` share one bucket), which bounds the padded work; a bucket of one block without anchor
reads its rows as views. A window then costs about a dozen kernel calls, however many documents
it holds.

The kernel returns its log-sum-exp without a gradient, hence this ``autograd.Function``: its
backward runs the kernel's backward on each part with the *merged* output and log-sum-exp,
which gives the exact gradients of the merged softmax (the identity ring attention relies on);
dummy and padded query rows get an infinite log-sum-exp there, so they contribute nothing.
Memory O(T * H * D): no mask or score matrix is ever built; the padded buckets are O(T) too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_anchor.attention.layout import QueryBlock, derived

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# a bucket's blocks are at least 1 / _BUCKET_RATIO of its longest: padded work <= 1 - 1/ratio^2 of the bucket's
_BUCKET_RATIO = 1.25
# diagonals up to this length share one bucket whatever their ratio: per-call overhead dominates there
_SHORT = 32


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return None if q.device.type == "cpu" else f"it runs on CPU tensors only, got device {q.device}"


# deterministic (Megatron's deterministic_mode): torch's CPU kernels: no atomics
def attention(q, k, v, blocks, q_offset, scale, deterministic=False):
    return _BlockwiseFlashAttention.apply(q, k, v, blocks, q_offset, scale)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` -> the kernel's ``[1, H, n, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


@dataclass(frozen=True)
class _Bucket:
    """Entries padded to ``length`` and batched: one kernel call.

    ``rows``/``keys``: the q rows and key positions of the padded slots (int64 ``[count * length]``;
    slices for a single entry without anchor, then read as views). ``docs``: ``(first q row,
    queries)`` of each entry, whose queries sit at slots ``lead .. lead + queries``; ``lead`` is 1
    when slot 0 holds the anchor key (and a dummy query), whose positions are ``anchors``.
    """

    count: int
    length: int
    rows: slice | torch.Tensor
    keys: slice | torch.Tensor
    docs: tuple[tuple[int, int], ...]
    lead: int
    anchors: torch.Tensor | None

    def gather(self, x: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
        """``x[index]`` (``[T, H, D]`` or ``[T, H]``) as the kernel's ``[count, H, length, ...]``."""
        if isinstance(index, slice):
            return x[index].transpose(0, 1).unsqueeze(0)
        return x.index_select(0, index).view(self.count, self.length, *x.shape[1:]).transpose(1, 2)

    def gather_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The kernel's ``[count, H, length]`` log-sum-exp for the backward: +inf outside the real query slots.

        With it the dummy and padded queries' probabilities are 0, so they add nothing to dq, dk,
        dv, whatever their (copied, finite) q, output and output gradient.
        """
        picked = self.gather(lse, self.rows)
        for i, (_, queries) in enumerate(self.docs):
            if self.lead:
                picked[i, :, 0] = float("inf")
            if self.lead + queries < self.length:
                picked[i, :, self.lead + queries:] = float("inf")
        return picked

    def scatter(self, target: torch.Tensor, part: torch.Tensor, offset: int = 0) -> None:
        """Write the query slots of ``part`` (the kernel's ``[count, H, length, ...]``) to ``target`` at rows + offset."""
        part = part.transpose(1, 2)  # [count, length, H, ...]
        for i, (row, queries) in enumerate(self.docs):
            target[row + offset:row + offset + queries] = part[i, self.lead:self.lead + queries]

    def add_anchor_grad(self, target: torch.Tensor, part: torch.Tensor) -> None:
        """Add the anchor slots' gradients (``part``: the kernel's ``[count, H, length, D]``) to ``target``'s anchor rows."""
        target.index_add_(0, self.anchors, part[:, :, 0].float())


def _buckets(blocks: tuple[QueryBlock, ...], q_offset: int) -> tuple[_Bucket, ...]:
    """The query blocks as bucketed entries (see the module docstring), built once per query blocks."""
    return derived(blocks, ("cpu_buckets", q_offset), lambda: _build_buckets(blocks, q_offset))


def _build_buckets(blocks: tuple[QueryBlock, ...], q_offset: int) -> tuple[_Bucket, ...]:
    entries = sorted(((b.end - b.start + (b.anchor is not None), b.anchor is not None, b.start, b.anchor)
                      for b in blocks), key=lambda e: (e[1], e[0]), reverse=True)
    groups: list[list[tuple]] = []
    for entry in entries:
        top = groups[-1][0] if groups else None
        if top is not None and top[1] == entry[1] and (entry[0] * _BUCKET_RATIO >= top[0] or top[0] <= _SHORT):
            groups[-1].append(entry)
        else:
            groups.append([entry])
    buckets = []
    for group in groups:
        width, lead = group[0][0], int(group[0][1])
        docs = tuple((start - q_offset, length - lead) for length, _, start, _ in group)
        if len(group) == 1 and not lead:
            start = docs[0][0]
            buckets.append(_Bucket(1, width, slice(start, start + width),
                                   slice(start + q_offset, start + q_offset + width), docs, 0, None))
            continue
        rows = torch.empty(len(group), width, dtype=torch.long)
        keys = torch.empty(len(group), width, dtype=torch.long)
        for i, ((row, queries), (_, _, _, anchor)) in enumerate(zip(docs, group)):
            rows[i] = row  # the dummy and padded slots repeat the entry's first query
            rows[i, lead:lead + queries] = torch.arange(row, row + queries)
            keys[i] = row + q_offset if anchor is None else anchor
            keys[i, lead:lead + queries] = torch.arange(row + q_offset, row + q_offset + queries)
        anchors = torch.tensor([e[3] for e in group]) if lead else None
        buckets.append(_Bucket(len(group), width, rows.reshape(-1), keys.reshape(-1), docs, lead, anchors))
    return tuple(buckets)


def _prefix_calls(blocks: tuple[QueryBlock, ...], q_offset: int):
    """``(rows of q, key rows)`` of the blocks whose queries also see all keys before their first one."""
    for block in blocks:
        if block.key_start < block.start:
            yield slice(block.start - q_offset, block.end - q_offset), slice(block.key_start, block.start)


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
        for bucket in _buckets(blocks, q_offset):  # every query row is in exactly one entry
            o, l = _flash(bucket.gather(q, bucket.rows), bucket.gather(k, bucket.keys), bucket.gather(v, bucket.keys),
                          0.0, True, scale=scale)
            bucket.scatter(out, o)
            bucket.scatter(lse, l)
        for rows, keys in _prefix_calls(blocks, q_offset):
            o, l = _flash(_bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), 0.0, False, scale=scale)
            _merge(out, lse, rows, o[0].transpose(0, 1), l[0].transpose(0, 1))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.q_offset, ctx.scale = blocks, q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        blocks, q_offset, scale = ctx.blocks, ctx.q_offset, ctx.scale
        # fp32 accumulators. The entries write every query row once, and every key row when the
        # queries are all the keys; anchors and prefixes add to rows written before
        dq = torch.empty(q.shape, dtype=torch.float32)
        every_key = q_offset == 0 and q.shape[0] == k.shape[0]
        dk, dv = ((torch.empty if every_key else torch.zeros)(k.shape, dtype=torch.float32) for _ in range(2))
        anchored = []
        for bucket in _buckets(blocks, q_offset):
            dq_part, dk_part, dv_part = _flash_backward(
                bucket.gather(grad_out, bucket.rows), bucket.gather(q, bucket.rows), bucket.gather(k, bucket.keys),
                bucket.gather(v, bucket.keys), bucket.gather(out, bucket.rows), bucket.gather_lse(lse), 0.0, True,
                scale=scale,
            )
            bucket.scatter(dq, dq_part)
            bucket.scatter(dk, dk_part, q_offset)
            bucket.scatter(dv, dv_part, q_offset)
            if bucket.lead:
                anchored.append((bucket, dk_part, dv_part))
        for bucket, dk_part, dv_part in anchored:
            bucket.add_anchor_grad(dk, dk_part)
            bucket.add_anchor_grad(dv, dv_part)
        for rows, keys in _prefix_calls(blocks, q_offset):
            dq_part, dk_part, dv_part = _flash_backward(
                _bhsd(grad_out[rows]), _bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), _bhsd(out[rows]),
                lse[rows].T.unsqueeze(0), 0.0, False, scale=scale,
            )
            dq[rows] += dq_part[0].transpose(0, 1)
            dk[keys] += dk_part[0].transpose(0, 1)
            dv[keys] += dv_part[0].transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
