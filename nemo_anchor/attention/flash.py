"""flash-attn 2 backend: the whole packed sequence in one ``flash_attn_varlen_func`` call.

Every query block is one varlen sequence: its queries, and as keys/values the window anchor's
(when the block has one) followed by the block's own, so ``cu_seqlens_k`` runs ahead of
``cu_seqlens_q`` by the number of anchors inserted so far. ``causal=True`` aligns the mask to
the bottom right when seqlen_q != seqlen_k (flash-attn >= 2.1): each query then sees the anchor
and its own causal prefix. See :class:`nemo_anchor.attention.layout.VarlenPlan`.
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.attention.layout import varlen_plan

_MAX_HEAD_DIM = 256


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    kernel, reason = gpu.flash_attn_varlen_func()
    if kernel is None:
        return reason
    if not q.is_cuda:
        return f"flash-attn runs on CUDA tensors only, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn supports float16 and bfloat16 only, got {q.dtype}"
    if q.shape[-1] > _MAX_HEAD_DIM:
        return f"flash-attn supports head_dim <= {_MAX_HEAD_DIM}, got {q.shape[-1]}"
    return None


def attention(q, k, v, blocks, q_offset, scale):
    flash_attn_varlen_func, _ = gpu.flash_attn_varlen_func()
    plan = varlen_plan(blocks, q.device)
    return flash_attn_varlen_func(
        q, k[plan.kv_rows], v[plan.kv_rows],
        cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
        dropout_p=0.0, softmax_scale=scale, causal=True,
    )
