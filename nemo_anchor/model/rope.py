"""Megatron's RoPE as our models apply it: fp32 rotation, no host sync (whether TE's fused RoPE may
run instead is :func:`nemo_anchor.launch.rope_fusion_allowed`).

- ``rope_in_fp32``: Megatron computes cos/sin in fp32 but rotates q/k in their own dtype, so in bf16
  runs the rotation itself is rounded: the precision loss the paper measures. With the flag, q/k
  rotate in fp32 and are cast back, so the rounding happens once, after RoPE.
- Packed (THD) input on the unfused path: Megatron's ``_apply_rotary_pos_emb_thd`` reads
  ``cu_seqlens`` to the host in every layer, for q and for k (``.tolist()``). ``make_packed_seq_params``
  puts each token's rotary position (this context-parallel rank's tokens, counted from its RoPE
  segment's start) into the packed-sequence parameters once per micro-batch, and the layers rotate
  per token instead: the same frequencies, gathered on the device.

Both are done by :class:`AnchorSelfAttention`, Megatron's ``SelfAttention`` in our layer spec: it takes
the rotation over from Megatron's ``Attention.forward`` only where one of the two applies, through
Megatron's own ``apply_rotary_pos_emb``, and leaves everything else (TE's fused RoPE included) to it.
"""
from __future__ import annotations

import numpy as np
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config as yarn_attention_scale,  # what Attention.forward passes as mscale
)
from megatron.core.transformer.attention import SelfAttention


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


def rotate(t: torch.Tensor, freqs: torch.Tensor, config, mscale: float = 1.0, cp_group=None) -> torch.Tensor:
    """Megatron's unfused RoPE of ``t`` ``[s, b, h, d]`` by ``freqs`` ``[s, 1, 1, d]``, row by row; in fp32
    (one rounding, after the rotation) with ``config.rope_in_fp32``. The rows' frequencies are this
    context-parallel rank's already: ``cp_group`` is only handed on (Megatron reads the global one without)."""
    if not getattr(config, "rope_in_fp32", False) or t.dtype == torch.float32:
        return apply_rotary_pos_emb(t, freqs, config, mscale=mscale, cp_group=cp_group)
    return apply_rotary_pos_emb(t.float(), freqs.float(), config, mscale=mscale, cp_group=cp_group).to(t.dtype)


def token_freqs(freqs: torch.Tensor, packed_seq_params, cp_group) -> torch.Tensor:
    """Each local token's row of Megatron's RoPE table ``freqs`` ``[max_s, 1, 1, d]`` for packed input.

    The positions come from the parameters (``AnchorPackedSeqParams.rope_positions``); plain
    ``PackedSeqParams`` (NeMo's own packed path) are read on the host here, as Megatron would, once
    per layer instead of once for q and once for k.
    """
    positions = getattr(packed_seq_params, "rope_positions", None)
    if positions is None:
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        cp_size, cp_rank = (cp_group.size(), cp_group.rank()) if cp_group is not None else (1, 0)
        positions = torch.from_numpy(rope_positions(tuple(cu_seqlens.tolist()), cp_size, cp_rank)).to(freqs.device)
    return freqs[positions]


class AnchorSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` that rotates q and k itself where Megatron's RoPE would read the
    boundaries to the host (packed input, unfused path) or round the rotation (``rope_in_fp32``).

    It hands ``Attention.forward`` no rotary embedding then, and rotates q and k as
    ``get_query_key_value_tensors`` returns them: after the q/k norms, where Megatron rotates. TE's
    fused RoPE, inference and everything else are Megatron's own: its fused THD kernel takes the
    boundaries on the device, restarting positions at each ``cu_seqlens_q`` segment (chunks r and
    2cp-1-r of it under context parallelism), as ``rope_positions`` counts them.
    """

    _token_freqs = None  # the frequencies of this forward's tokens while it takes the rotation over

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        self._token_freqs = self._rotation_to_take_over(rotary_pos_emb, packed_seq_params, kwargs)
        if self._token_freqs is not None:
            rotary_pos_emb = None
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._token_freqs = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(*args, **kwargs)
        if self._token_freqs is None:
            return qkv
        query, key, *rest = qkv
        mscale, cp_group = yarn_attention_scale(self.config), self.pg_collection.cp
        return (rotate(query, self._token_freqs, self.config, mscale, cp_group),
                rotate(key, self._token_freqs, self.config, mscale, cp_group), *rest)

    def _rotation_to_take_over(self, rotary_pos_emb, packed_seq_params, kwargs) -> torch.Tensor | None:
        """The frequencies of the rows of q and k when this layer rotates them itself, else None."""
        config = self.config
        if (not isinstance(rotary_pos_emb, torch.Tensor) or config.apply_rope_fusion
                or kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None
                or (config.no_rope_freq and config.no_rope_freq[self.layer_number - 1])):
            return None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return token_freqs(rotary_pos_emb, packed_seq_params, self.pg_collection.cp)
        return rotary_pos_emb if getattr(config, "rope_in_fp32", False) else None
