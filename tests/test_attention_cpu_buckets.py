"""The CPU backend's batched kernel calls: many documents of mixed lengths in padded buckets, against the oracle."""
import pytest
import torch

from nemo_anchor.attention import anchor_attention
from nemo_anchor.attention.cpu import _buckets
from nemo_anchor.attention.layout import layout_blocks


def _layout(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two windows of 300 tokens, each with a BOS-only first document, then short and long documents."""
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    for window_start in (0, 300):
        bounds.append(window_start + 1)  # BOS alone
        while bounds[-1] < window_start + 300:
            length = int(torch.randint(1, 40, (1,), generator=g)) if len(bounds) % 5 else 90
            bounds.append(min(bounds[-1] + length, window_start + 300))
    return torch.tensor(bounds, dtype=torch.int32), torch.tensor([0, 300, 600], dtype=torch.int32)


@pytest.mark.parametrize("mode", ["anchor", "intra_doc", "full"])
@pytest.mark.parametrize("q_offset,q_len", [(0, 600), (150, 300)])
def test_padded_buckets_match_the_reference(mode, q_offset, q_len):
    cu_seqlens, cu_windows = _layout(seed=len(mode) + q_offset)
    blocks = layout_blocks(cu_seqlens, cu_windows, mode, 600, q_offset, q_len)
    buckets = _buckets(blocks, q_offset)
    if mode != "full":  # many documents share a few padded kernel calls
        assert len(buckets) < len(blocks) / 3
        assert any(b.count > 1 and any(queries + b.lead < b.length for _, queries in b.docs) for b in buckets)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_len, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(600, 2, 16, generator=g, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(q_len, 4, 16, generator=g)
    results = []
    for backend in ("cpu", "reference"):
        out = anchor_attention(q, k, v, cu_seqlens, cu_windows=cu_windows, mode=mode, backend=backend,
                               q_offset=q_offset)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad_out)])
    for name, actual, expected in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5, msg=name)
