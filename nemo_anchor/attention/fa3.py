"""FlashAttention-3 backend (Hopper): the whole packed sequence in one ``flash_attn_interface.flash_attn_varlen_func`` call.

FlashAttention-3 is written for SM90 (H100, H200) with warp specialisation and TMA; MagiAttention's
published H100 figures (32K, forward, document mask) put it near 585 TFLOP/s against about 345 for
FlashAttention-2. The sequences are those of the flash-attn 2 backend
(:class:`nemo_anchor.attention.layout.VarlenPlan`): one per query block, keys prefixed with the
window anchor's where the block has one, ``causal=True`` aligned to the bottom right. Its
documented autograd drops the gradient of the log-sum-exp, so the anchor is gathered into the
keys (a K/V copy per layer in ``anchor`` mode, counted by ``nemo-anchor plan``).
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.attention.layout import varlen_plan

_MAX_HEAD_DIM = 256
_CAPABILITY = 9  # SM90 only


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    kernel, reason = gpu.flash_attn_3_varlen_func()
    if kernel is None:
        return reason
    if not q.is_cuda:
        return f"FlashAttention-3 runs on CUDA tensors only, got device {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-3 (with a backward) supports float16 and bfloat16 only, got {q.dtype}"
    if q.shape[-1] > _MAX_HEAD_DIM or q.shape[-1] % 8:
        return f"FlashAttention-3 needs head_dim a multiple of 8 and <= {_MAX_HEAD_DIM}, got {q.shape[-1]}"
    capability = torch.cuda.get_device_capability(q.device)
    if capability[0] != _CAPABILITY:
        return f"FlashAttention-3 runs on compute capability 9.x (Hopper) only, got {capability}"
    return None


def attention(q, k, v, blocks, q_offset, scale):
    kernel, _ = gpu.flash_attn_3_varlen_func()
    plan = varlen_plan(blocks, q.device)
    out = kernel(q, k[plan.kv_rows], v[plan.kv_rows], plan.cu_seqlens_q, plan.cu_seqlens_k,
                 plan.max_seqlen_q, plan.max_seqlen_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # some releases return (out, softmax_lse)
