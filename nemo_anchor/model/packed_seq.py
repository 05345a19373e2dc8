"""Packed-sequence parameters that carry documents and anchors past Megatron's RoPE.

Megatron applies RoPE per ``cu_seqlens_q/kv`` segment in THD format and ignores position ids.
So the standard fields describe where positions restart (windows, or documents for
``intra_doc_reset``) while ``cu_seqlens_doc`` / ``cu_seqlens_window`` tell the core attention
which keys each token may see. ``make_packed_seq_params`` carries those boundaries as a
:class:`~nemo_anchor.attention.layout.PackLayout` (``layout``), built on the host from the batch's
host copy of the boundaries (``batch_for_this_rank``), and each token's rotary position
(``rope_positions``, applied by :class:`~nemo_anchor.model.rope.AnchorSelfAttention`): every layer of
the micro-batch reuses them, with no host sync in the forward.

Megatron's plain ``PackedSeqParams`` (what Megatron-LM's THD training and NeMo's and Bridge's default
data steps build, for a user who plugs our layer spec into them) carry documents only: one
``cu_seqlens_q`` segment per document (``cu_seqlens_q_padded`` where the documents are padded) over the
micro-batch's THD pack. The pack is then one window whose first token is the anchor (see
:func:`packed_layout`), and RoPE restarts at every document, as Megatron applies it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from nemo_anchor.attention.layout import PackLayout, boundaries, pack_layout
from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.model.rope import rope_positions


@dataclass
class AnchorPackedSeqParams(PackedSeqParams):
    cu_seqlens_doc: torch.Tensor = None  # int32 [n_docs + 1], document boundaries over the pack
    cu_seqlens_window: torch.Tensor = None  # int32 [n_windows + 1], each also a document boundary
    layout: PackLayout = None  # the two above, read to the host once for all layers
    rope_positions: torch.Tensor = None  # int64 [t], each local token's position in its RoPE segment


def packed_layout(params: PackedSeqParams, tokens: int, mask: str, cp_size: int = 1) -> PackLayout:
    """The documents and windows of the THD pack of ``tokens`` tokens (all context-parallel ranks'
    together) that ``params`` describe, as the core attention under ``mask`` sees them.

    - :class:`AnchorPackedSeqParams`: their ``layout`` (else ``cu_seqlens_doc`` / ``cu_seqlens_window``).
    - Megatron's plain ``PackedSeqParams``: the documents are the segments of ``cu_seqlens_q_padded``
      (where the tokens lie), else of ``cu_seqlens_q``; the pack is one window and its first token
      the anchor. Tokens after the last boundary (Megatron's ``total_tokens`` beyond the sequences)
      are one more document, padding. Read to the host once and kept on ``params``, so the other
      layers of the micro-batch reuse it.

    Raises:
        ValueError: malformed boundaries; and plain params under context parallelism for any mask
            but ``intra_doc``: Megatron's THD split gives each rank chunks r and 2cp-1-r of every
            *document*, while our context-parallel attention takes windows cut that way, so each
            document would be its own window and the anchor (or, ``full``, the other documents) lost.
    """
    if isinstance(params, AnchorPackedSeqParams):
        if params.layout is not None:
            return params.layout
        return pack_layout(params.cu_seqlens_doc, params.cu_seqlens_window, tokens)
    if cp_size > 1 and mask != "intra_doc":
        raise ValueError(
            f"the {mask} mask under context parallelism (cp={cp_size}) needs each window's boundaries, and "
            f"Megatron's plain PackedSeqParams carry only documents, split across the ranks one by one: build "
            f"the parameters with nemo_anchor.model.packed_seq.make_packed_seq_params (cu_seqlens_doc, "
            f"cu_seqlens_window), as the data steps of nemo-anchor train, NeMo and Bridge do, or use the "
            f"intra_doc mask")
    padded = params.cu_seqlens_q_padded is not None
    documents = params.cu_seqlens_q_padded if padded else params.cu_seqlens_q
    # kept with the tensor it was read from and that tensor's version: a new or rewritten tensor is read again
    read_from = (documents._version if isinstance(documents, torch.Tensor) else None, tokens, cp_size > 1)
    kept = getattr(params, "_nemo_anchor_layout", None)
    if kept is not None and kept[0] is documents and kept[1] == read_from:
        return kept[2]
    name = "cu_seqlens_q_padded" if padded else "cu_seqlens_q"
    bounds = boundaries(documents, None, f"PackedSeqParams.{name}")
    if bounds[-1] > tokens:
        raise ValueError(f"PackedSeqParams.{name} ends at {bounds[-1]}, beyond the {tokens} tokens of the pack")
    if bounds[-1] < tokens:
        bounds += (tokens,)
    # under context parallelism (intra_doc only) each document is one window: the unit Megatron split
    layout = PackLayout.of(bounds, bounds if cp_size > 1 else None)
    params._nemo_anchor_layout = (documents, read_from, layout)
    return layout


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
