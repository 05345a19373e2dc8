"""FlashAttention-3 backend (Hopper): the whole packed sequence in one ``flash_attn_interface.flash_attn_varlen_func`` call.

FlashAttention-3 is written for SM90 (H100, H200) with warp specialisation and TMA; MagiAttention's
published H100 figures (32K, forward, document mask) put it near 585 TFLOP/s against about 345 for
FlashAttention-2. The sequences are those of the flash-attn 2 backend
(:class:`nemo_anchor.attention.layout.VarlenPlan`), ``causal=True`` aligned to the bottom right.
With anchors the documents run alone and the anchor is merged through the log-sum-exp
(:mod:`nemo_anchor.attention.anchor_merge`): the public call with ``return_attn_probs=True``
returns it, and the backward is the op FlashAttention-3's own autograd calls, handed the merged
output and log-sum-exp (:func:`nemo_anchor.gpu.flash_attn_3_backward`, called by keyword, each checked
against the op's schema). No K/V copy. ``deterministic`` reaches that backward's own flag.
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_merge, requirements



def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return (gpu.flash_attn_3_varlen_func()[1]
            or requirements.cuda_reason("FlashAttention-3", q, max_head_dim=256, capabilities=(9,))  # SM90 only
            or gpu.flash_attn_3_backward()[1])


def _call(q, keys, values, plan, scale, **options):
    kernel, _ = gpu.flash_attn_3_varlen_func()
    return kernel(q, keys, values, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
                  softmax_scale=scale, causal=True, **options)


def _documents_forward(q, keys, values, plan, scale):
    out, lse = _call(q, keys, values, plan, scale, return_attn_probs=True)
    return out, lse


def _documents_backward(dout, q, keys, values, out, lse, plan, scale, deterministic=False):
    backward, _ = gpu.flash_attn_3_backward()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)
    # by keyword (checked against the op's schema: gpu.FLASH_ATTN_3_BACKWARD_KEYWORDS); no seqused, causal, no
    # window or softcap, no SM margin: as the public call
    backward(dout=dout, q=q, k=keys, v=values, out=out, softmax_lse=lse, cu_seqlens_q=plan.cu_seqlens_q,
             cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
             dq=dq, dk=dk, dv=dv, softmax_scale=scale, is_causal=True, window_size_left=-1, window_size_right=-1,
             softcap=0.0, deterministic=deterministic, sm_margin=0)
    return dq, dk, dv


def _documents(q, keys, values, plan, scale):
    out = _call(q, keys, values, plan, scale)
    return out[0] if isinstance(out, tuple) else out  # some releases return (out, softmax_lse)


attention = anchor_merge.VarlenKernel(_documents_forward, _documents_backward, _documents).attention
