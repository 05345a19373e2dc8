"""The FlexAttention backend: its block mask derived from the layout, and its forward pass."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from torch.nn.attention.flex_attention import create_block_mask

from nemo_anchor.attention import BackendUnavailableError, anchor_attention, flex, layout
from nemo_anchor.attention.layout import layout_blocks

from layout_strategies import packed_layouts  # tests/layout_strategies.py

CPU = torch.device("cpu")


def tiles(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` as dense ``[q_tiles, kv_tiles]`` bool maps."""
    def dense(counts, indices):
        out = torch.zeros(indices.shape[-2], indices.shape[-1] + 1, dtype=torch.bool)
        for row, (n, idx) in enumerate(zip(counts[0, 0].tolist(), indices[0, 0])):
            out[row, idx[:n].long()] = True
        return out[:, :-1]

    return dense(mask.kv_num_blocks, mask.kv_indices), dense(mask.full_kv_num_blocks, mask.full_kv_indices)


@settings(max_examples=40, deadline=None)
@given(packed_layouts(max_docs=6, max_doc_len=150))
def test_block_mask_has_the_tiles_create_block_mask_finds(layout):
    bounds, windows, mode, q_offset, q_len = layout
    blocks = layout_blocks(torch.tensor(bounds), torch.tensor(windows), mode, bounds[-1], q_offset, q_len)
    ours = flex.block_mask(blocks, q_offset, bounds[-1], CPU)
    theirs = create_block_mask(ours.mask_mod, None, None, q_len, bounds[-1], device="cpu", BLOCK_SIZE=flex.TILE)
    for mine, expected in zip(tiles(ours), tiles(theirs)):
        assert torch.equal(mine, expected)


LAYOUT = dict(cu_seqlens=torch.tensor([0, 5, 9, 10, 200, 260, 400, 401, 650, 700], dtype=torch.int32),
              cu_windows=torch.tensor([0, 10, 260, 650, 700], dtype=torch.int32))


def qkv(dtype, kv_heads, q_len):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_len, 4, 16, generator=g).to(dtype)
    return q, *(torch.randn(700, kv_heads, 16, generator=g).to(dtype) for _ in range(2))


# each shape compiles once (about 20 s on a cold inductor cache): few, shared shapes
@pytest.mark.parametrize(
    "dtype, kv_heads, q_offset, q_len",
    [(torch.float32, 2, 130, 300), (torch.bfloat16, 4, 0, 700)],
)
def test_flex_forward_matches_reference(dtype, kv_heads, q_offset, q_len):
    q, k, v = (x.requires_grad_() for x in qkv(dtype, kv_heads, q_len))  # e.g. a model's activations
    with torch.no_grad():
        out = anchor_attention(q, k, v, backend="flex", q_offset=q_offset, **LAYOUT)
        expected = anchor_attention(q, k, v, backend="reference", q_offset=q_offset, **LAYOUT)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_block_mask_is_built_once_per_layout(monkeypatch):
    q, k, v = qkv(torch.float32, 2, 300)
    layout.query_blocks.cache_clear()  # blocks derived by the tests before keep their block masks
    built = []
    build = flex._build_block_mask
    monkeypatch.setattr(flex, "_build_block_mask", lambda *args: built.append(args) or build(*args))
    with torch.no_grad():
        outs = [anchor_attention(q, k, v, backend="flex", q_offset=130, **LAYOUT) for _layer in range(3)]
    assert len(built) == 1
    assert all(torch.equal(out, outs[0]) for out in outs)


def test_flex_refuses_gradients_on_the_cpu():
    q = torch.randn(8, 2, 4, requires_grad=True)
    with pytest.raises(BackendUnavailableError, match="no FlexAttention backward on the CPU"):
        anchor_attention(q, q, q, torch.tensor([0, 8], dtype=torch.int32), backend="flex")
