"""``AnchorCoreAttention``: a drop-in for Megatron-Core's ``core_attention`` submodule.

It keeps the constructor and forward contract of
``megatron.core.transformer.dot_product_attention.DotProductAttention`` (0.16.1) and adds what
that module refuses: packed THD input with document/anchor masks, and context parallelism.
The mask comes from ``mask`` (one of ``nemo_anchor.attention.MODES``), the structure of the
pack from ``packed_seq_params`` (see :mod:`nemo_anchor.model.packed_seq`). The kernel is chosen at the first
forward of each kind (device, dtype, gradient or not) and kept on the module: later calls check nothing again.
Megatron's ``deterministic_mode`` reaches every backend's backward (``anchor_attention(deterministic=...)``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from nemo_anchor.attention import anchor_attention
from nemo_anchor.attention.functional import (ChosenBackend, choose_backend, library_logger, log_backend_choice,
                                              needs_grad)
from nemo_anchor.attention.layout import PackLayout
from nemo_anchor.model.packed_seq import AnchorPackedSeqParams, packed_layout

_CAUSAL_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
_LOGGED: set[tuple[str, str]] = set()  # the (mask, backend) pairs whose choice this process has logged
_WARNED_PLAIN_ROPE = False  # whether this process has warned that plain PackedSeqParams restart RoPE per document


class AnchorCoreAttention(MegatronModule):
    """Core attention over packed windows for the ``full``, ``intra_doc`` and ``anchor`` masks.

    Layouts: sbhd ``q [s, b, np, hn]``, ``k/v [s, b, ng, hn]`` -> ``[s, b, np*hn]`` (each batch row
    is one window holding one document, so every mask is plain causal attention there); thd
    ``q [t, np, hn]``, ``k/v [t, ng, hn]`` -> ``[t, np*hn]``, one pack (batch size 1) whose documents
    and windows :func:`~nemo_anchor.model.packed_seq.packed_layout` reads from ``packed_seq_params``:
    ours carry both; Megatron's plain ones documents only, and the pack is then one window whose
    first token is the anchor. Grouped-query heads are not expanded.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        mask: str = "anchor",
        backend: str = "auto",
    ):
        super().__init__(config=config)
        if attn_mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(f"AnchorCoreAttention needs a causal attn_mask_type, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout} is not supported (long-context training uses 0)")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.mask = mask
        self.backend = backend
        self.deterministic = bool(config.deterministic_mode)
        self._chosen: dict[tuple, ChosenBackend] = {}  # (device, dtype, needs_grad) -> the backend chosen for it
        self.cp_comm_type = cp_comm_type or config.cp_comm_type or "a2a"
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is an fp16 workaround; AnchorCoreAttention "
                             "keeps softmax statistics in fp32 and does not support it")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by AnchorCoreAttention")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL_MASK_TYPES:
            raise ValueError(f"AnchorCoreAttention needs a causal attn_mask_type, got {attn_mask_type}")

        cp = self.pg_collection.cp
        cp_size = cp.size() if cp is not None else 1
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # boundaries describe the whole pack: each rank holds t = pack / cp tokens
            layout = packed_layout(packed_seq_params, query.shape[0] * cp_size, self.mask, cp_size)
            if not isinstance(packed_seq_params, AnchorPackedSeqParams) and self.mask in ("anchor", "full"):
                _warn_plain_params_rope(self.mask)
            out = self._attend(query, key, value, layout)
            return out.reshape(out.size(0), -1)

        s, b = query.shape[:2]
        flat = [x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value)]
        # each batch row is one window holding one document; each rank holds s = window / cp tokens of it
        window = s * cp_size
        bounds = tuple(range(0, (b + 1) * window, window))
        out = self._attend(*flat, PackLayout.of(bounds, bounds))
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend(self, q, k, v, layout: PackLayout):
        backend = self._backend(q, k, v)
        cp_group = self.pg_collection.cp
        if cp_group is not None and cp_group.size() > 1:
            from nemo_anchor.parallel.context_parallel import context_parallel_attention

            return context_parallel_attention(
                q, k, v, layout=layout, mask=self.mask, backend=backend, softmax_scale=self.softmax_scale,
                cp_group=cp_group, comm_type=self.cp_comm_type, deterministic=self.deterministic,
            )
        return anchor_attention(q, k, v, layout=layout, mode=self.mask, backend=backend,
                                softmax_scale=self.softmax_scale, deterministic=self.deterministic)

    def _backend(self, q, k, v) -> ChosenBackend:
        """The backend for this kind of call, chosen at its first forward and kept (a dictionary look-up after)."""
        grad = needs_grad(q, k, v)
        kind = (q.device, q.dtype, grad)
        chosen = self._chosen.get(kind)
        if chosen is None:
            chosen = self._chosen[kind] = choose_backend(self.backend, q, grad, self.mask, self.deterministic)
            self._log_backend_once(chosen, q, grad)
        return chosen

    def _log_backend_once(self, chosen: ChosenBackend, q, grad: bool):
        """The first forward of each process says which kernel runs and why (rank 0): our trainer, NeMo and
        Bridge all build this module, so every front door says it."""
        if (self.mask, self.backend) in _LOGGED:
            return
        _LOGGED.add((self.mask, self.backend))
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        log_backend_choice(chosen, self.mask, q, grad, self.deterministic)


def _warn_plain_params_rope(mask: str) -> None:
    """Once per process: Megatron applies RoPE per ``cu_seqlens_q`` segment, so plain params restart the positions
    at every document, while the ``anchor`` and ``full`` paradigms define them continuous over the window."""
    global _WARNED_PLAIN_ROPE
    if _WARNED_PLAIN_ROPE:
        return
    _WARNED_PLAIN_ROPE = True
    library_logger(__name__).warning(
        "nemo_anchor attention: the %s mask got Megatron's plain PackedSeqParams: Megatron applies RoPE per "
        "cu_seqlens_q segment, so positions restart at every document, while the %s paradigm defines them "
        "continuous over the window; build the parameters with nemo_anchor.model.packed_seq.make_packed_seq_params "
        "to keep them continuous", mask, mask)
