"""What ``AnchorCoreAttention`` must compute, in float64, written from the masks' definition (not from the
layout code), and the tiny model whose core attention the tests call."""
from __future__ import annotations

import torch

from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.core_attention import AnchorCoreAttention
from nemo_anchor.model.gpt import build_gpt_model

VOCAB = 97
HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def visible_keys(p: int, docs: tuple[int, ...], windows: tuple[int, ...], mask: str) -> set[int]:
    """The keys the token at packed position ``p`` sees: its window's up to it (``full``), its document's
    (``intra_doc``), its document's and its window's first token (``anchor``)."""
    window, doc = max(b for b in windows if b <= p), max(b for b in docs if b <= p)
    if mask == "full":
        return set(range(window, p + 1))
    keys = set(range(doc, p + 1))
    return keys | {window} if mask == "anchor" else keys


def expected_output(q, k, v, docs, windows, mask: str) -> torch.Tensor:
    """``[T, Hq * D]`` float64: softmax attention of q ``[T, Hq, D]`` over k, v ``[T, Hkv, D]`` (grouped-query
    heads) under ``mask``, for documents ``docs`` and windows ``windows`` (boundaries ``(0, ..., T)``)."""
    total = q.shape[0]
    seen = torch.zeros(total, total, dtype=torch.bool)
    for p in range(total):
        seen[p, sorted(visible_keys(p, docs, windows, mask))] = True
    group = q.shape[1] // k.shape[1]
    keys, values = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[-1] ** -0.5
    weights = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, values).reshape(total, -1)


def tiny_model(attention_type: str, num_layers: int = 1, seed: int = 0):
    """A tiny GPTModel with our layer spec (CPU attention backend)."""
    cfg = ModelConfig(num_layers=num_layers, hidden_size=HEADS * HEAD_DIM, ffn_hidden_size=64, num_attention_heads=HEADS,
                      num_query_groups=GROUPS, seq_length=32, attention_backend="cpu", attention_type=attention_type)
    torch.manual_seed(seed)
    return build_gpt_model(cfg, VOCAB)


def core_attentions(model) -> list[AnchorCoreAttention]:
    return [module for module in model.modules() if isinstance(module, AnchorCoreAttention)]


def qkv(total: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """THD ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(total, HEADS, HEAD_DIM, generator=g), torch.randn(total, GROUPS, HEAD_DIM, generator=g),
            torch.randn(total, GROUPS, HEAD_DIM, generator=g))
