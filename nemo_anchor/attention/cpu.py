"""Fast CPU backend: torch's CPU flash-attention kernel per query block, merged through the log-sum-exp.

The keys a block sees split into parts that need no mask: the causal diagonal (its queries
against their own positions: a square, where the kernel's top-left causal mask is the right
one), the keys before its first query (all visible: with ``q_offset``, or a BOS-only first
document), and the anchor column (one key). The kernel runs per block and part; the anchor
column is computed for all rows at once, in a handful of vectorised ops (many small ops per
document cost more than the kernel on a busy machine), and merged through the log-sum-exp.

The kernel returns its log-sum-exp without a gradient, hence this ``autograd.Function``: its
backward runs the kernel's backward on each part with the *merged* output and log-sum-exp,
which gives the exact gradients of the merged softmax (the identity ring attention relies on).
Memory O(T * H * D): no mask or score matrix is ever built.
"""
from __future__ import annotations

import torch

from nemo_anchor.attention.layout import QueryBlock, per_query

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return None if q.device.type == "cpu" else f"it runs on CPU tensors only, got device {q.device}"


def attention(q, k, v, blocks, q_offset, scale):
    return _BlockwiseFlashAttention.apply(q, k, v, blocks, q_offset, scale)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` -> the kernel's ``[1, H, n, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _kernel_calls(blocks: tuple[QueryBlock, ...], q_offset: int):
    """``(rows of q, key rows, causal)`` of every kernel call: per block its diagonal, then its prefix."""
    for block in blocks:
        rows = slice(block.start - q_offset, block.end - q_offset)
        yield rows, slice(block.start, block.end), True
        if block.key_start < block.start:
            yield rows, slice(block.key_start, block.start), False


def _anchor_columns(q, k, v, blocks, q_offset):
    """The rows that have an anchor, and the anchor's key and value for each, GQA heads expanded (fp32)."""
    _, anchor = per_query(blocks, q.device)
    rows = torch.nonzero(anchor >= 0).squeeze(1)
    group = q.shape[1] // k.shape[1]
    keys, values = (x[anchor[rows]].float().repeat_interleave(group, 1) for x in (k, v))  # [R, Hq, D]
    return rows, anchor[rows], keys, values


def _merge(out, lse, rows, part_out, part_lse):
    """Fold a partial attention result over other keys into ``out``/``lse`` at ``rows``."""
    merged = torch.logaddexp(lse[rows], part_lse)
    out[rows] = (out[rows].float() * (lse[rows] - merged).exp().unsqueeze(-1)
                 + part_out.float() * (part_lse - merged).exp().unsqueeze(-1)).to(out.dtype)
    lse[rows] = merged


class _BlockwiseFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, q_offset, scale):
        out = torch.empty_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)  # [Tq, Hq]: the kernel's memory order
        for rows, keys, causal in _kernel_calls(blocks, q_offset):
            o, l = _flash(_bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), 0.0, causal, scale=scale)
            if causal:  # the first part of its block
                out[rows], lse[rows] = o[0].transpose(0, 1), l[0].transpose(0, 1)
            else:
                _merge(out, lse, rows, o[0].transpose(0, 1), l[0].transpose(0, 1))
        rows, _, anchor_keys, anchor_values = _anchor_columns(q, k, v, blocks, q_offset)
        if len(rows):
            scores = torch.einsum("rhd,rhd->rh", q[rows].float(), anchor_keys) * scale
            _merge(out, lse, rows, anchor_values, scores)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.q_offset, ctx.scale = blocks, q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, (kv_heads, head_dim) = ctx.scale, k.shape[1:]
        # fp32 accumulators: a query row and an anchor key collect several parts
        dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
        for rows, keys, causal in _kernel_calls(ctx.blocks, ctx.q_offset):
            dq_part, dk_part, dv_part = _flash_backward(
                _bhsd(grad_out[rows]), _bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), _bhsd(out[rows]),
                lse[rows].T.unsqueeze(0), 0.0, causal, scale=scale,
            )
            dq[rows] += dq_part[0].transpose(0, 1)
            dk[keys] += dk_part[0].transpose(0, 1)
            dv[keys] += dv_part[0].transpose(0, 1)
        rows, anchors, anchor_keys, anchor_values = _anchor_columns(q, k, v, ctx.blocks, ctx.q_offset)
        if len(rows):
            q_rows, g = q[rows].float(), grad_out[rows].float()
            probs = (torch.einsum("rhd,rhd->rh", q_rows, anchor_keys) * scale - lse[rows]).exp()
            # softmax backward: dS = P * (dP - rowsum(dO * O))
            d_scores = probs * ((g * anchor_values).sum(-1) - (g * out[rows].float()).sum(-1))
            dq[rows] += scale * d_scores.unsqueeze(-1) * anchor_keys

            def per_kv_head(x):  # [R, Hq, D] -> [R, Hkv, D], summing each group of query heads
                return x.view(len(rows), kv_heads, -1, head_dim).sum(2)

            dk.index_add_(0, anchors, per_kv_head(scale * d_scores.unsqueeze(-1) * q_rows))
            dv.index_add_(0, anchors, per_kv_head(probs.unsqueeze(-1) * g))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
