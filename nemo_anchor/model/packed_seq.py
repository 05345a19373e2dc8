"""Packed-sequence parameters that carry documents and anchors past Megatron's RoPE.

Megatron applies RoPE per ``cu_seqlens_q/kv`` segment in THD format and ignores position ids.
So the standard fields describe where positions restart (windows, or documents for
``intra_doc_reset``) while ``cu_seqlens_doc`` / ``cu_seqlens_window`` tell the core attention
which keys each token may see. ``make_packed_seq_params`` carries those boundaries as a
:class:`~nemo_anchor.attention.layout.PackLayout` (``layout``), built on the host from the batch's
host copy of the boundaries (``batch_for_this_rank``), and each token's rotary position
(``rope_positions``, applied by :class:`~nemo_anchor.model.rope.AnchorSelfAttention`): every layer of
the micro-batch reuses them, with no host sync in the forward. Plain ``PackedSeqParams``
(e.g. from NeMo's own packed path) still work: every segment is then its own document and window,
read in each layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from nemo_anchor.attention.layout import PackLayout, pack_layout
from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.model.rope import rope_positions


@dataclass
class AnchorPackedSeqParams(PackedSeqParams):
    cu_seqlens_doc: torch.Tensor = None  # int32 [n_docs + 1], document boundaries over the pack
    cu_seqlens_window: torch.Tensor = None  # int32 [n_windows + 1], each also a document boundary
    layout: PackLayout = None  # the two above, read to the host once for all layers
    rope_positions: torch.Tensor = None  # int64 [t], each local token's position in its RoPE segment


def packed_layout(params: PackedSeqParams) -> PackLayout:
    """The pack's documents and windows as the core attention should see them."""
    layout = getattr(params, "layout", None)
    if layout is not None:
        return layout
    docs = getattr(params, "cu_seqlens_doc", None)
    windows = getattr(params, "cu_seqlens_window", None)
    if docs is None:
        docs = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return pack_layout(docs, docs if windows is None else windows)


def make_packed_seq_params(
    cu_seqlens: torch.Tensor, cu_windows: torch.Tensor, attention_type: str, cp_group=None,
    layout: PackLayout | None = None,
) -> AnchorPackedSeqParams:
    """Build THD params for a batch of packed windows (see ``nemo_anchor.data.collate_windows``).

    ``cu_seqlens``/``cu_windows`` are int32 boundaries over the flattened ``B*T`` tokens, on the
    model's device. ``layout``: the same boundaries read on the host before they were moved there
    (``batch_for_this_rank`` adds it to the batch); without it they are read here, a host sync on a GPU.
    """
    kind = get_attention_type(attention_type)
    cu_seqlens = cu_seqlens.to(torch.int32)
    cu_windows = cu_windows.to(torch.int32)
    if layout is None:
        layout = pack_layout(cu_seqlens, cu_windows)
    by_document = kind.rope_restarts == "document"
    rope_bounds = layout.doc_bounds if by_document else layout.window_bounds
    rope_segments = cu_seqlens if by_document else cu_windows
    cp_size, cp_rank = (cp_group.size(), cp_group.rank()) if cp_group is not None else (1, 0)
    positions = torch.from_numpy(rope_positions(rope_bounds, cp_size, cp_rank)).to(cu_seqlens.device, non_blocking=True)
    # Megatron sizes its RoPE table by max_seqlen, the longest segment: every position indexes it. TE's
    # fused THD RoPE restarts at each cu_seqlens_q segment, as the positions do. (Megatron's unfused THD
    # RoPE, which AnchorSelfAttention replaces, maps by offset when max_seqlen equals the pack length:
    # one segment, offset 0, the same positions.)
    max_seqlen = max(end - start for start, end in zip(rope_bounds, rope_bounds[1:]))
    return AnchorPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=rope_segments,
        cu_seqlens_kv=rope_segments,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        cp_group=cp_group,
        cu_seqlens_doc=cu_seqlens,
        cu_seqlens_window=cu_windows,
        layout=layout,
        rope_positions=positions,
    )
