"""Registry of attention types: the paper's Figure 2 paradigms, selected by name from YAML.

An attention type is two independent choices that Megatron would otherwise tie together:
which keys a token sees (the kernel's ``mask``) and where RoPE positions restart
(``rope_restarts``: at every window, so positions run 0..T-1 across packed documents, or at
every document).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionType:
    name: str
    mask: str  # a mode of nemo_anchor.attention.anchor_attention: full | intra_doc | anchor
    rope_restarts: str  # "window" | "document"
    description: str


_REGISTRY: dict[str, AttentionType] = {}


def register_attention_type(kind: AttentionType) -> AttentionType:
    if kind.rope_restarts not in ("window", "document"):
        raise ValueError(f"rope_restarts must be 'window' or 'document', got {kind.rope_restarts!r}")
    _REGISTRY[kind.name] = kind
    return kind


def get_attention_type(name: str) -> AttentionType:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention_type {name!r}; choose one of {sorted(_REGISTRY)}") from None


def attention_type_names() -> list[str]:
    return sorted(_REGISTRY)


register_attention_type(AttentionType(
    "full", "full", "window", "causal over the whole packed window (documents see each other)"))
register_attention_type(AttentionType(
    "intra_doc", "intra_doc", "window", "causal within each document, positions continuous"))
register_attention_type(AttentionType(
    "intra_doc_reset", "intra_doc", "document", "causal within each document, positions reset to 0"))
register_attention_type(AttentionType(
    "anchor", "anchor", "window",
    "AnchorAttention: causal within each document plus the window's anchor token, positions continuous"))
