"""Megatron's RoPE as our models apply it: one rule for the fused kernel, fp32 rotation, no host sync.

- :func:`rope_fusion_allowed`: the one rule for Transformer Engine's fused RoPE, serving our trainer,
  NeMo and Bridge (``nemo_anchor.launch`` applies it when a run starts).
- ``rope_in_fp32``: Megatron computes cos/sin in fp32 but rotates q/k in their own dtype, so in bf16
  runs the rotation itself is rounded: the precision loss the paper measures. With the flag, q/k
  rotate in fp32 and are cast back, so the rounding happens once, after RoPE.
- Packed (THD) input on the unfused path: Megatron's ``_apply_rotary_pos_emb_thd`` reads
  ``cu_seqlens`` to the host in every layer, for q and for k (``rope_utils.py:204``, ``.tolist()``).
  ``make_packed_seq_params`` attaches each token's rotary position (this context-parallel rank's
  tokens, counted from its RoPE segment's start) once per micro-batch, and the layers rotate per
  token instead: the same frequencies, gathered on the device.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

_installed = False


def uses_yarn(config) -> bool:
    """Whether a model config (ours, Megatron's, NeMo's or Bridge's) describes YaRN RoPE."""
    return (getattr(config, "position_embedding_type", None) == "yarn" or getattr(config, "rope_scaling", None) == "yarn"
            or getattr(config, "yarn_rotary_scaling_factor", 1.0) != 1.0)


def rope_fusion_allowed(config) -> bool:
    """Whether Transformer Engine's fused RoPE computes what the model asks for.

    TE's kernel rotates in fp32 and rounds once; ``rope_in_fp32`` keeps Megatron's unfused fp32
    rotation (the option the paper measures stays exact), and YaRN keeps it too: Megatron's fused
    THD path drops YaRN's attention scaling (``mscale``).
    """
    return not getattr(config, "rope_in_fp32", False) and not uses_yarn(config)


def rope_positions(bounds: tuple[int, ...], cp_size: int = 1, cp_rank: int = 0) -> np.ndarray:
    """Each local token's position in its RoPE segment (``bounds``: the segments' host boundaries).

    Under context parallelism a rank holds chunks ``r`` and ``2cp-1-r`` of every segment, as
    Megatron's THD RoPE (``_get_thd_freqs_on_this_cp_rank``) maps them.
    """
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        chunk = (end - start) // (2 * cp_size)
        if cp_size == 1:
            pieces.append(np.arange(end - start))
        else:
            pieces += [np.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                       np.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)]
    return np.concatenate(pieces)


def install_rope_precision_hook() -> None:
    """Route ``Attention``'s RoPE through our rules: per-token rotation of packed input on the unfused
    path, and fp32 rotation with ``config.rope_in_fp32``."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    @functools.wraps(original)
    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, *args, **kwargs):
        positions = getattr(cu_seqlens, "rope_positions", None)
        if positions is not None and not config.apply_rope_fusion:
            # THD [t, h, d] as sbhd [t, 1, h, d] with each token's frequencies: no per-layer host sync
            return apply_rotary_pos_emb(t.unsqueeze(1), freqs[positions], config, None, *args, **kwargs).squeeze(1)
        if getattr(config, "rope_in_fp32", False) and t.dtype != torch.float32:
            return original(t.float(), freqs.float(), config, cu_seqlens, *args, **kwargs).to(t.dtype)
        return original(t, freqs, config, cu_seqlens, *args, **kwargs)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _installed = True
