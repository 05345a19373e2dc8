"""The test oracle: a dense boolean mask and an fp32 softmax. Memory O(Tq * T * H): small sizes only."""
from __future__ import annotations

import torch

from nemo_anchor.attention.layout import QueryBlock, per_query


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return None


def dense_mask(blocks: tuple[QueryBlock, ...], q_offset: int, total: int, device: torch.device) -> torch.Tensor:
    """``[Tq, T]`` bool: ``mask[i, j]`` is True when query row i (position q_offset + i) sees key j."""
    key_start, anchor = per_query(blocks, device)
    position = torch.arange(q_offset, q_offset + len(key_start), device=device)[:, None]
    keys = torch.arange(total, device=device)
    return (keys <= position) & ((keys >= key_start[:, None]) | (keys == anchor[:, None]))


# deterministic (Megatron's deterministic_mode): dense autograd: no atomics
def attention(q, k, v, blocks, q_offset, scale, deterministic=False):
    group = q.shape[1] // k.shape[1]
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    scores = scores.masked_fill(~dense_mask(blocks, q_offset, k.shape[0], q.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(q.dtype)
