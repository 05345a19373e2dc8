"""``NEMO_ANCHOR_ANCHOR_PATH``: the anchor merged by log-sum-exp (default) or, for comparison, copied into the keys.

Through the flash-attn stand-ins (tests/varlen_standins.py): both paths equal the reference for
every mode and query range; ``kv_copy`` hands the kernel the gathered keys (``T`` plus one row per
anchored document), ``merge`` the layer's own k; any other value is refused in one line.
"""
from __future__ import annotations

import pytest
import torch

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_attention, flash
from nemo_anchor.attention.anchor_merge import anchor_path

import varlen_standins  # tests/varlen_standins.py

BOUNDS, WINDOWS = (0, 5, 9, 20, 21, 30, 33, 40), (0, 20, 40)  # the second window's first document is its BOS alone


@pytest.fixture
def keys_seen(monkeypatch):
    """The flash backend on CPU tensors with the stand-ins; returns the row count of every k the kernel is handed."""
    seen = []
    differentiable = varlen_standins.with_autograd(varlen_standins.flash_attn_varlen_func)

    def spying(q, k, v, *args, **kwargs):
        seen.append(k.shape[0])
        return differentiable(q, k, v, *args, **kwargs)

    monkeypatch.setattr(gpu, "flash_attn_varlen_func", lambda: (spying, None))
    monkeypatch.setattr(gpu, "flash_attn_varlen_backward", lambda: (varlen_standins.flash_attn_varlen_backward, None))
    monkeypatch.setattr(flash, "unavailable_reason", lambda q, needs_grad: None)
    return seen


def outputs_and_grads(backend: str, mode: str, q_offset: int, q_len: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(q_len, 4, 8, generator=g).requires_grad_()
    k, v = (torch.randn(BOUNDS[-1], 2, 8, generator=g).requires_grad_() for _ in range(2))
    out = anchor_attention(q, k, v, torch.tensor(BOUNDS, dtype=torch.int32), mode=mode, backend=backend,
                           cu_windows=torch.tensor(WINDOWS, dtype=torch.int32), q_offset=q_offset)
    return [out, *torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g))]


@pytest.mark.parametrize("path", [None, "merge", "kv_copy"])
@pytest.mark.parametrize("mode", ["full", "intra_doc", "anchor"])
@pytest.mark.parametrize("q_offset, q_len", [(0, 40), (7, 20)])
def test_each_path_matches_the_reference(monkeypatch, keys_seen, path, mode, q_offset, q_len):
    if path is None:
        monkeypatch.delenv("NEMO_ANCHOR_ANCHOR_PATH", raising=False)
    else:
        monkeypatch.setenv("NEMO_ANCHOR_ANCHOR_PATH", path)
    expected = outputs_and_grads("reference", mode, q_offset, q_len)
    for name, actual, wanted in zip(("out", "dq", "dk", "dv"), outputs_and_grads("flash", mode, q_offset, q_len),
                                    expected):
        torch.testing.assert_close(actual, wanted, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("q_offset, q_len, anchored", [(0, 40, 4), (7, 20, 2)])
def test_kv_copy_hands_the_kernel_one_key_more_per_anchored_document(monkeypatch, keys_seen, q_offset, q_len,
                                                                      anchored):
    """Anchored documents: 5 and 9 (window 0), 30 and 33 (window 1; 21 reads the anchor 20 as its first key);
    of the queries 7..26 only 7..8 and 9..19."""
    for path in ("merge", "kv_copy"):
        monkeypatch.setenv("NEMO_ANCHOR_ANCHOR_PATH", path)
        outputs_and_grads("flash", "anchor", q_offset, q_len)
    merged, copied = keys_seen
    assert copied == merged + anchored


@pytest.mark.parametrize("value", ["fast", "", "KV_COPY"])
def test_an_unknown_path_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv("NEMO_ANCHOR_ANCHOR_PATH", value)
    with pytest.raises(ValueError, match=f"NEMO_ANCHOR_ANCHOR_PATH={value!r} is not one of merge, kv_copy") as error:
        anchor_path()
    assert "\n" not in str(error.value)
