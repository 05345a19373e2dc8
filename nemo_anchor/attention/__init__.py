"""Attention over packed windows of documents: full, intra-document and AnchorAttention.

``anchor_attention`` is the one entry point; see its docstring for shapes, modes and backends.
"""
from nemo_anchor.attention.functional import BACKENDS, BackendUnavailableError, anchor_attention
from nemo_anchor.attention.layout import MODES, PackLayout, pack_layout

__all__ = ["anchor_attention", "MODES", "BACKENDS", "BackendUnavailableError", "PackLayout", "pack_layout"]
