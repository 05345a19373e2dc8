"""AnchorAttention for Hugging Face models: ``attn_implementation="anchor"``.

Importing this module registers ``"anchor"`` with ``transformers.AttentionInterface``, so any
model built on it (Llama, Mistral, Qwen2, ...) can train on packed windows with the same mask
as our Megatron model::

    import nemo_anchor.export.hf_attention  # noqa: F401  (registers "anchor")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="anchor")
    out = model(input_ids=tokens, position_ids=positions, cu_seqlens=cu_seqlens, cu_windows=cu_windows,
                labels=labels, use_cache=False)

``tokens``/``positions`` are ``[B, T]`` (positions continuous ``0..T-1`` across each window);
``cu_seqlens`` (int32) are the document boundaries over the B*T flattened tokens and
``cu_windows`` the window boundaries (default: each row is one window), exactly as
``nemo_anchor.data.collate_windows`` produces them. The structure travels only in these two
keyword arguments: an ``attention_mask`` is refused rather than half-honoured.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface

from nemo_anchor.attention import anchor_attention

NAME = "anchor"


def anchor_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_windows: Optional[torch.Tensor] = None,
    **_unused,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q ``[B, Hq, T, D]``, k/v ``[B, Hkv, T, D]`` -> ``[B, T, Hq, D]``."""
    if cu_seqlens is None:
        raise ValueError("attn_implementation='anchor' needs cu_seqlens=... (int32 document boundaries over the "
                         "B*T flattened tokens) in the model call")
    if attention_mask is not None:
        raise ValueError("attn_implementation='anchor' takes the document structure from cu_seqlens/cu_windows; "
                         "call the model with attention_mask=None")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by attn_implementation='anchor'")
    batch, heads, length, head_dim = query.shape
    if key.shape[2] != length:
        raise ValueError(f"attn_implementation='anchor' attends within the given tokens only (keys {key.shape[2]}, "
                         f"queries {length}): call the model with use_cache=False; generate with 'sdpa', which equals "
                         f"AnchorAttention on one document starting at BOS")
    if cu_windows is None:
        cu_windows = torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=query.device)

    def packed(x):  # [B, H, T, D] -> [B*T, H, D]
        return x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim)

    out = anchor_attention(packed(query), packed(key), packed(value), cu_seqlens, cu_windows=cu_windows,
                           mode="anchor", softmax_scale=scaling)
    return out.reshape(batch, length, heads, head_dim), None


AttentionInterface.register(NAME, anchor_attention_forward)
