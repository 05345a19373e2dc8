"""Transformer Engine backend: ``DotProductAttention`` in THD format, bottom-right causal; ``full`` and ``intra_doc``.

The sequences are those of the flash-attn backend (:class:`nemo_anchor.attention.layout.VarlenPlan`):
one per query block, its keys a range of k/v (a view, no copy). ``anchor`` mode is refused
(:data:`nemo_anchor.attention.functional.NO_ANCHOR`): TE's public attention returns no
log-sum-exp to merge the anchor with, and putting the anchor in front of every document's keys
would copy K and V in every layer.
One TE module per head configuration is kept: it has no parameters, only kernel selection state.
"""
from __future__ import annotations

import functools
import os

import torch

from nemo_anchor import gpu
from nemo_anchor.attention import requirements
from nemo_anchor.attention.layout import varlen_plan

_MASK = "padding_causal_bottom_right"


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return gpu.transformer_engine_pytorch()[1] or requirements.cuda_reason("Transformer Engine", q, returns_lse=False)


def deterministic_reason(q: torch.Tensor) -> str | None:
    """Why TE's attention would not run its deterministic backward here, or None. ``DotProductAttention`` takes no
    flag: it reads ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (or torch's deterministic algorithms) when built, and
    Megatron's own ``deterministic_mode`` refuses TE's attention without that variable."""
    if os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0" or torch.are_deterministic_algorithms_enabled():
        return None
    return ("Transformer Engine runs a deterministic backward only with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 in the "
            "environment (Megatron's deterministic_mode requires it too)")


@functools.lru_cache(maxsize=16)
def _module(dot_product_attention: type, heads: int, kv_heads: int, head_dim: int, scale: float):
    return dot_product_attention(
        heads, head_dim, num_gqa_groups=kv_heads, attention_dropout=0.0,
        qkv_format="thd", attn_mask_type=_MASK, softmax_scale=scale,
    )


# deterministic (Megatron's deterministic_mode): chosen only where deterministic_reason allows it
def attention(q, k, v, blocks, q_offset, scale, deterministic=False):
    te, _ = gpu.transformer_engine_pytorch()
    plan = varlen_plan(blocks, q.device)
    module = _module(te.DotProductAttention, q.shape[1], k.shape[1], q.shape[2], scale)
    out = module(
        query_layer=q, key_layer=k[plan.kv_rows], value_layer=v[plan.kv_rows],
        qkv_format="thd", attn_mask_type=_MASK,
        cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_kv=plan.cu_seqlens_k,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_kv=plan.max_seqlen_k,
    )
    return out.view(q.shape)  # TE returns [t, h * d]
