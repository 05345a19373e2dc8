"""Optional fp32 RoPE rotation for Megatron's unfused RoPE path.

Megatron computes cos/sin in fp32 but rotates q/k in their own dtype, so in bf16 runs the
rotation itself is rounded: the precision loss the paper measures. ``rope_in_fp32`` on the
transformer config rotates in fp32 and casts back, so the rounding happens once, after RoPE.
"""
from __future__ import annotations

import functools

import torch

_installed = False


def install_rope_precision_hook() -> None:
    """Route ``Attention``'s RoPE through :func:`_rotate` (a no-op unless ``config.rope_in_fp32``)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, *args, **kwargs):
        if getattr(config, "rope_in_fp32", False) and t.dtype != torch.float32:
            return original(t.float(), freqs.float(), config, *args, **kwargs).to(t.dtype)
        return original(t, freqs, config, *args, **kwargs)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _installed = True
