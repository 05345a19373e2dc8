"""FlashAttention-4 backend (CuTe DSL; Hopper and Blackwell): one ``flash_attn.cute.flash_attn_varlen_func`` call.

FlashAttention-4 (``flash-attn-4``, ``flash_attn.cute``) is written in CUTLASS's CuTe DSL for SM90
and SM100, varlen forward and backward. The sequences are those of the flash-attn 2 backend
(:class:`nemo_anchor.attention.layout.VarlenPlan`), ``causal=True`` aligned to the bottom right.
With anchors the documents run alone and the anchor is merged through the log-sum-exp
(:mod:`nemo_anchor.attention.anchor_merge`): the public call with ``return_lse=True`` returns it,
and the backward is the function FlashAttention-4's own autograd calls, handed the merged output
and log-sum-exp (:func:`nemo_anchor.gpu.flash_attn_4_backward`). No K/V copy. A deterministic backward
(``deterministic=True``) exists in its newer releases on SM100/SM110 only (:func:`deterministic_reason`).
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_merge, requirements



def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return (gpu.flash_attn_4_varlen_func()[1]
            or requirements.cuda_reason("FlashAttention-4", q, max_head_dim=128, capabilities=(9, 10))  # SM90, SM100
            or gpu.flash_attn_4_backward()[1])


def _call(q, keys, values, plan, scale, **options):
    kernel, _ = gpu.flash_attn_4_varlen_func()
    return kernel(q, keys, values, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
                  max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, softmax_scale=scale, causal=True,
                  **options)


def _documents_forward(q, keys, values, plan, scale):
    out, lse = _call(q, keys, values, plan, scale, return_lse=True)
    return out, lse


def deterministic_reason(q: torch.Tensor) -> str | None:
    """Why FlashAttention-4 cannot run a deterministic backward for ``q`` here, or None."""
    backward, reason = gpu.flash_attn_4_backward()
    if reason is not None:
        return reason
    if not gpu.takes_keyword(backward, "deterministic"):
        return ("this FlashAttention-4's _flash_attn_bwd takes no deterministic (a release before its deterministic "
                "backward)")
    capability = torch.cuda.get_device_capability(q.device)
    if capability[0] not in (10, 11):  # its own assertion: "bwd deterministic only supported for sm100/sm110"
        return f"FlashAttention-4's deterministic backward runs on SM100/SM110 only, got {capability}"
    return None


def _documents_backward(dout, q, keys, values, out, lse, plan, scale, deterministic=False):
    backward, _ = gpu.flash_attn_4_backward()
    flags = {"deterministic": True} if deterministic else {}  # releases before it take no such keyword
    return backward(q, keys, values, out, dout, lse, scale, True, cu_seqlens_q=plan.cu_seqlens_q,
                    cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
                    **flags)


def _documents(q, keys, values, plan, scale):
    out = _call(q, keys, values, plan, scale)
    return out[0] if isinstance(out, tuple) else out  # (out, lse) in the 4.0 betas


attention = anchor_merge.VarlenKernel(_documents_forward, _documents_backward, _documents).attention
