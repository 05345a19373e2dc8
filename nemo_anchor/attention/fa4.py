"""FlashAttention-4 backend (CuTe DSL; Hopper and Blackwell): one ``flash_attn.cute.flash_attn_varlen_func`` call.

FlashAttention-4 (``flash-attn-4``, ``flash_attn.cute``) is written in CUTLASS's CuTe DSL for SM90
and SM100, varlen forward and backward. The sequences are those of the flash-attn 2 backend
(:class:`nemo_anchor.attention.layout.VarlenPlan`), ``causal=True`` aligned to the bottom right;
the anchor is gathered into the keys (its autograd does not take a log-sum-exp gradient), a K/V
copy per layer in ``anchor`` mode, counted by ``nemo-anchor plan``.
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.attention.layout import varlen_plan

_MAX_HEAD_DIM = 128
_CAPABILITIES = (9, 10)  # SM90 (Hopper), SM100 (Blackwell)


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    kernel, reason = gpu.flash_attn_4_varlen_func()
    if kernel is None:
        return reason
    if not q.is_cuda:
        return f"FlashAttention-4 runs on CUDA tensors only, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 supports float16 and bfloat16 only, got {q.dtype}"
    if q.shape[-1] > _MAX_HEAD_DIM or q.shape[-1] % 8:
        return f"FlashAttention-4 needs head_dim a multiple of 8 and <= {_MAX_HEAD_DIM}, got {q.shape[-1]}"
    capability = torch.cuda.get_device_capability(q.device)
    if capability[0] not in _CAPABILITIES:
        return f"FlashAttention-4 runs on compute capability 9.x and 10.x only, got {capability}"
    return None


def attention(q, k, v, blocks, q_offset, scale):
    kernel, _ = gpu.flash_attn_4_varlen_func()
    plan = varlen_plan(blocks, q.device)
    out = kernel(q, k[plan.kv_rows], v[plan.kv_rows], cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
                 max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # (out, lse) in the 4.0 betas
