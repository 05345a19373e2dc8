"""Fast CPU backend: torch's CPU flash-attention kernel per query block, merged through the log-sum-exp.

The keys a block sees split into at most three parts, each handled without a mask: the causal
diagonal (its queries against their own positions: a square, where the kernel's top-left causal
mask is the right one), the keys before its first query (all visible; only with ``q_offset``),
and the anchor column (one key, computed directly). The parts are merged with their
log-sum-exps. The kernel returns its log-sum-exp without a gradient, hence this
``autograd.Function``: its backward runs the kernel's backward on each part with the *merged*
output and log-sum-exp, which gives the exact gradients of the merged softmax (the identity
ring attention relies on). Memory O(T * H * D): no mask or score matrix is ever built.
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


def _kernel_parts(block: QueryBlock, q_offset: int) -> tuple[slice, list[tuple[slice, bool]]]:
    """The block's rows of q and its ``(key rows, causal)`` kernel calls."""
    parts = [(slice(block.start, block.end), True)]
    if block.key_start < block.start:
        parts.append((slice(block.key_start, block.start), False))
    return slice(block.start - q_offset, block.end - q_offset), parts


def _anchor_scores(q_rows: torch.Tensor, k_anchor: torch.Tensor, scale: float) -> torch.Tensor:
    """``[n, Hq]`` fp32 scores of the rows against the anchor key (``[Hkv, D]``)."""
    group = q_rows.shape[1] // k_anchor.shape[0]
    return torch.einsum("nhd,hd->nh", q_rows.float(), k_anchor.float().repeat_interleave(group, 0)) * scale


class _BlockwiseFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, blocks, q_offset, scale):
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32)  # [Tq, Hq]: the kernel's memory order
        for block in blocks:
            rows, parts = _kernel_parts(block, q_offset)
            q_rows, outs, lses = q[rows], [], []
            for keys, causal in parts:
                o, l = _flash(_bhsd(q_rows), _bhsd(k[keys]), _bhsd(v[keys]), 0.0, causal, scale=scale)
                outs.append(o[0].transpose(0, 1))
                lses.append(l[0].transpose(0, 1))
            if block.anchor is not None:
                outs.append(v[block.anchor].repeat_interleave(group, 0))  # broadcasts over the rows
                lses.append(_anchor_scores(q_rows, k[block.anchor], scale))
            if len(outs) == 1:
                out[rows], lse[rows] = outs[0], lses[0]
            else:
                merged = torch.logsumexp(torch.stack(lses), dim=0)
                out[rows] = sum(o.float() * (l - merged).exp().unsqueeze(-1) for o, l in zip(outs, lses))
                lse[rows] = merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.q_offset, ctx.scale = blocks, q_offset, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, (kv_heads, head_dim) = ctx.scale, k.shape[1:]
        group = q.shape[1] // kv_heads
        # fp32 accumulators: a query row and the anchor key collect several parts
        dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
        for block in ctx.blocks:
            rows, parts = _kernel_parts(block, ctx.q_offset)
            q_rows, g_rows, o_rows, l_rows = q[rows], grad_out[rows], out[rows], lse[rows]
            for keys, causal in parts:
                dq_part, dk_part, dv_part = _flash_backward(
                    _bhsd(g_rows), _bhsd(q_rows), _bhsd(k[keys]), _bhsd(v[keys]), _bhsd(o_rows),
                    l_rows.T.unsqueeze(0), 0.0, causal, scale=scale,
                )
                dq[rows] += dq_part[0].transpose(0, 1)
                dk[keys] += dk_part[0].transpose(0, 1)
                dv[keys] += dv_part[0].transpose(0, 1)
            if block.anchor is not None:
                a, g = block.anchor, g_rows.float()
                probs = (_anchor_scores(q_rows, k[a], scale) - l_rows).exp()  # [n, Hq]
                # softmax backward: dS = P * (dP - rowsum(dO * O))
                d_scores = probs * (torch.einsum("nhd,hd->nh", g, v[a].float().repeat_interleave(group, 0))
                                    - (g * o_rows.float()).sum(-1))
                dq[rows] += scale * d_scores.unsqueeze(-1) * k[a].float().repeat_interleave(group, 0)
                dk[a] += scale * torch.einsum("nh,nhd->hd", d_scores, q_rows.float()).view(kv_heads, group, head_dim).sum(1)
                dv[a] += torch.einsum("nh,nhd->hd", probs, g).view(kv_heads, group, head_dim).sum(1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
