"""Fast CPU backend: torch's CPU flash-attention kernel per query block, merged through the log-sum-exp.

The keys a block sees split into parts that need no mask: the causal diagonal (its queries
against their own positions: a square, where the kernel's top-left causal mask is the right
one), the keys before its first query (all visible: with ``q_offset``, or a BOS-only first
document), and the anchor column (one key). The kernel runs per block and part; the anchor
column is computed for all rows of a window at once, in a handful of vectorised ops (many small
ops per document cost more than the kernel on a busy machine), and merged through the
log-sum-exp.

The kernel returns its log-sum-exp without a gradient, hence this ``autograd.Function``: its
backward runs the kernel's backward on each part with the *merged* output and log-sum-exp,
which gives the exact gradients of the merged softmax (the identity ring attention relies on).
Memory O(T * H * D): no mask or score matrix is ever built.
"""
from __future__ import annotations

import torch

from nemo_anchor.attention.layout import QueryBlock

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
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)  # [Tq, Hq]: the kernel's memory order
        for rows, keys, causal in _kernel_calls(blocks, q_offset):
            o, l = _flash(_bhsd(q[rows]), _bhsd(k[keys]), _bhsd(v[keys]), 0.0, causal, scale=scale)
            if causal:  # the first part of its block
                out[rows], lse[rows] = o[0].transpose(0, 1), l[0].transpose(0, 1)
            else:
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
        for rows, anchor in _anchor_runs(ctx.blocks, ctx.q_offset):
            key, value = (_per_query_head(x[anchor], q.shape[1]) for x in (k, v))
            q_rows, g = q[rows].float(), grad_out[rows].float()
            probs = (torch.einsum("rhd,hd->rh", q_rows, key) * scale - lse[rows]).exp()
            # softmax backward: dS = P * (dP - rowsum(dO * O))
            d_scores = probs * (torch.einsum("rhd,hd->rh", g, value) - (g * out[rows].float()).sum(-1))
            dq[rows] += scale * d_scores.unsqueeze(-1) * key
            dk[anchor] += scale * torch.einsum("rh,rhd->hd", d_scores, q_rows).view(kv_heads, -1, head_dim).sum(1)
            dv[anchor] += torch.einsum("rh,rhd->hd", probs, g).view(kv_heads, -1, head_dim).sum(1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
