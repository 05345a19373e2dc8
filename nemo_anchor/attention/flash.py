"""flash-attn 2 backend: the whole packed sequence in one ``flash_attn_varlen_func`` call.

Every query block is one varlen sequence: its queries, and as keys/values a range of k/v
(:class:`nemo_anchor.attention.layout.VarlenPlan`; a view, no copy). ``causal=True`` aligns the
mask to the bottom right when seqlen_q != seqlen_k (flash-attn >= 2.1), so a block whose keys
start before its first query (context parallelism) sees them all.

With anchors the documents run alone and the anchor is merged through the log-sum-exp
(:mod:`nemo_anchor.attention.anchor_merge`): the forward is the public ``flash_attn_varlen_func``
with ``return_attn_probs=True`` (it returns the log-sum-exp, fp32 ``[Hq, Tq]``), the backward the
op flash-attn's own autograd calls, handed the merged output and log-sum-exp
(:func:`nemo_anchor.gpu.flash_attn_varlen_backward`, flash-attn >= 2.7). No K/V copy.
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_merge, requirements



def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return (gpu.flash_attn_varlen_func()[1] or requirements.cuda_reason("flash-attn", q, max_head_dim=256)
            or gpu.flash_attn_varlen_backward()[1])


def _documents_forward(q, keys, values, plan, scale):
    kernel, _ = gpu.flash_attn_varlen_func()
    out, lse, _ = kernel(q, keys, values, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
                         max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
                         dropout_p=0.0, softmax_scale=scale, causal=True, return_attn_probs=True)
    return out, lse


def _documents_backward(dout, q, keys, values, out, lse, plan, scale, deterministic=False):
    backward, _ = gpu.flash_attn_varlen_backward()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)
    # dropout 0, causal, no window, softcap or ALiBi, no random state: as the public call
    backward(dout=dout, q=q, k=keys, v=values, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
             cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
             max_seqlen_k=plan.max_seqlen_k, dropout_p=0.0, softmax_scale=scale, causal=True, window_size_left=-1,
             window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=deterministic, rng_state=None)
    return dq, dk, dv


def _documents(q, keys, values, plan, scale):
    kernel, _ = gpu.flash_attn_varlen_func()
    return kernel(q, keys, values, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
                  max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
                  dropout_p=0.0, softmax_scale=scale, causal=True)


attention = anchor_merge.VarlenKernel(_documents_forward, _documents_backward, _documents).attention
