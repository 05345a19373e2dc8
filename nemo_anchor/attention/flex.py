"""FlexAttention backend: one BlockMask per layout, built from the layout and reused.

The block mask is derived from the query blocks directly instead of by ``create_block_mask``,
which either evaluates the mask on the whole T x T grid (eager: memory grows as T squared)
or compiles it first (8 s for an 8K window on the CPU). The derived mask has exactly the tiles
``create_block_mask(..., _compile=True)`` finds (tested on the CPU; ``scripts/gpu_check.py``
compares the two on CUDA) and costs a few small tensor ops per layout. A (query tile, key tile)
pair is *full* when every query of the tile sees every key of the tile, *partial* when some do
(the mask_mod is then applied), otherwise skipped. The per-layout cache makes all layers and
heads of a step share one mask.

``flex_attention`` runs compiled (Triton on CUDA: forward and backward). torch 2.13 implements
no FlexAttention backward on the CPU: there this backend is forward only.
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from nemo_anchor.attention.layout import QueryBlock, derived, per_query

TILE = 128
_MIN_CUDA_HEAD_DIM = 16


def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    if needs_grad and q.device.type == "cpu":
        return (
            "torch has no FlexAttention backward on the CPU; call it under torch.no_grad() or "
            "use backend='cpu' for training"
        )
    if q.is_cuda and q.shape[-1] < _MIN_CUDA_HEAD_DIM:
        # torch's Triton template refuses it at compile time ("embedding dimension ... must be at least 16"),
        # seen on an H200 with torch 2.11 for a head dim of 8
        return f"FlexAttention on CUDA needs head_dim >= {_MIN_CUDA_HEAD_DIM}, got {q.shape[-1]}"
    return None


@functools.cache
def _compiled_flex_attention():
    # Eager flex_attention computes the full score matrix; the compiled kernel skips empty tiles.
    # static shapes: the dynamic-shape CPU template of torch 2.13 fails to compile in bfloat16
    return torch.compile(flex_attention, dynamic=False)


def block_mask(blocks: tuple[QueryBlock, ...], q_offset: int, total: int, device: torch.device) -> BlockMask:
    """The BlockMask of queries ``[q_offset, q_offset + Tq)`` against ``total`` keys, built once per query blocks."""
    return derived(blocks, ("flex_block_mask", q_offset, total, device),
                   lambda: _build_block_mask(blocks, q_offset, total, device))


def _build_block_mask(blocks: tuple[QueryBlock, ...], q_offset: int, total: int, device: torch.device) -> BlockMask:
    key_start, anchor = per_query(blocks, device)
    q_len = len(key_start)
    q_tiles, k_tiles = -(-q_len // TILE), -(-total // TILE)
    first_row = torch.arange(q_tiles, device=device) * TILE
    last_row = (first_row + TILE).clamp(max=q_len) - 1
    first_key = torch.arange(k_tiles, device=device) * TILE
    last_key = (first_key + TILE).clamp(max=total) - 1
    # the keys seen by a tile's rows through [key_start, p] form one interval:
    # [key_start of its first row, position of its last row]
    touched = (first_key[None] <= q_offset + last_row[:, None]) & (last_key[None] >= key_start[first_row][:, None])
    full = (first_key[None] >= key_start[last_row][:, None]) & (last_key[None] <= q_offset + first_row[:, None])
    # tiles cut by the end of the sequence stay partial so the kernel masks their padding
    full &= ((last_row - first_row + 1 == TILE)[:, None]) & ((last_key - first_key + 1 == TILE)[None])
    rows = torch.nonzero(anchor >= 0).squeeze(1)
    touched[rows // TILE, anchor[rows] // TILE] = True
    partial = touched & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles.sum(-1, dtype=torch.int32)
        indices = torch.sort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
        return counts[None, None], indices[None, None]

    def mask_mod(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx + q_offset) & ((kv_idx >= key_start[q_idx]) | (kv_idx == anchor[q_idx]))

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(q_len, total)
    )


# deterministic (Megatron's deterministic_mode): FlexAttention's own backward (gpu_check.py compares two runs)
def attention(q, k, v, blocks, q_offset, scale, deterministic=False):
    mask = block_mask(blocks, q_offset, k.shape[0], q.device)
    if not torch.is_grad_enabled():  # torch refuses CPU inputs that require grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    out = _compiled_flex_attention()(
        *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
        block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).contiguous()
