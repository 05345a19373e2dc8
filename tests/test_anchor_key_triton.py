"""The anchor merge's Triton kernels, run for real on the CPU by Triton's interpreter, against a float64 oracle.

Triton decides at import whether its functions are interpreted, so the kernel tests run in a fresh
process with ``TRITON_INTERPRET=1`` (:func:`test_under_the_triton_interpreter` starts it on this
file). There the ``flash`` backend runs on CPU tensors with the varlen stand-ins
(tests/varlen_standins.py) for the library calls and the kernels of
:mod:`nemo_anchor.attention.anchor_key_triton` for the anchor; outputs and the gradients of q, k
and v are compared with attention computed densely in float64 from the reference's mask
(:func:`nemo_anchor.attention.reference.dense_mask`). Skipped where triton is not installed
(``.venv``); runs in ``.venv-bridge``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_attention, anchor_key, flash
from nemo_anchor.attention.layout import pack_layout
from nemo_anchor.attention.reference import dense_mask

import varlen_standins  # tests/varlen_standins.py
from layout_strategies import packed_layouts  # tests/layout_strategies.py

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 process")


@pytest.mark.skipif(INTERPRETED, reason="this is that process")
def test_under_the_triton_interpreter():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parents[1],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" in result.stdout  # the cases ran; only the launcher skipped


@pytest.fixture
def triton_flash(monkeypatch):
    """The flash backend on CPU tensors: stand-in library calls, the interpreted kernels; returns their launches."""
    kernels, reason = gpu.anchor_key_triton()
    assert kernels is not None and kernels.INTERPRETED and kernels.runs_on(torch.device("cpu")), reason
    launches = []
    for name in kernels.KERNELS:
        monkeypatch.setattr(kernels, name, _Recorded(getattr(kernels, name), name, launches))
    monkeypatch.setattr(gpu, "flash_attn_varlen_func",
                        lambda: (varlen_standins.with_autograd(varlen_standins.flash_attn_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_varlen_backward", lambda: (varlen_standins.flash_attn_varlen_backward, None))
    monkeypatch.setattr(flash, "unavailable_reason", lambda q, needs_grad: None)
    monkeypatch.delenv("NEMO_ANCHOR_ANCHOR_PATH", raising=False)
    return launches


class _Recorded:
    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


def float64_oracle(q, k, v, grad, bounds, windows, mode, q_offset, scale):
    """Output and (dq, dk, dv) of the masked softmax attention, densely in float64 (GQA: head h reads h // group)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    blocks = pack_layout(torch.tensor(bounds), torch.tensor(windows)).blocks(mode, q_offset, q.shape[0])
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
    scores = scores.masked_fill(~dense_mask(blocks, q_offset, k.shape[0], q.device), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1))
    return [out, *torch.autograd.grad(out, (q, k, v), grad.double())]


def run(bounds, windows, mode, q_offset, q_len, kv_heads, group, head_dim, dtype, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    total = bounds[-1]
    q = torch.randn(q_len, kv_heads * group, head_dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(q_len, kv_heads * group, head_dim, generator=g).to(dtype)
    out = anchor_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32),
                           cu_windows=torch.tensor(windows, dtype=torch.int32), mode=mode, backend="flash",
                           softmax_scale=scale, q_offset=q_offset)
    actual = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    return actual, float64_oracle(q, k, v, grad, bounds, windows, mode, q_offset, scale)


def assert_close(actual, expected, dtype):
    tolerance = {torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        assert a.dtype == dtype and a.shape == e.shape, name
        bound = max(1.0, e.abs().max().item())
        torch.testing.assert_close(a.double(), e, atol=tolerance * bound, rtol=tolerance, msg=name)


def anchored(bounds, windows, mode, q_offset, q_len) -> bool:
    blocks = pack_layout(torch.tensor(bounds), torch.tensor(windows)).blocks(mode, q_offset, q_len)
    return any(b.anchor is not None for b in blocks)


@interpreted_only
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=packed_layouts(), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([8, 12]), seed=st.integers(0, 2**16))
def test_every_mode_and_query_range_matches_float64(triton_flash, layout, kv_heads, group, head_dim, seed):
    """fp32: equal to the float64 oracle to fp32 rounding, for every mode, query range (q_offset), GQA group and a
    head_dim that is not a power of two; the anchor's share comes from the Triton kernels whenever there is one."""
    triton_flash.clear()
    assert_close(*run(*layout, kv_heads, group, head_dim, torch.float32, seed), torch.float32)
    expected = ["forward_kernel", "backward_kernel", "finish_kernel"] if anchored(*layout) else []
    assert triton_flash == expected


LAYOUTS = {
    # several windows, each anchor seen by several documents; the second window's first document is its BOS alone
    "windows, BOS-only document": ((0, 5, 9, 20, 21, 30, 33, 40), (0, 20, 40)),
    # every window's first document is its BOS alone
    "BOS-only documents only": ((0, 1, 4, 9, 10, 14, 15, 16, 22), (0, 9, 15, 22)),
    # documents longer than a tile (anchor_key.TILE_ROWS = 128) and a program's step (BLOCK_M = 32): several
    # tiles per anchor, several steps per tile
    "long documents": ((0, 3, 170, 260, 263, 400), (0, 260, 400)),
}


# the long documents (slow under the interpreter) with all the queries only
CASES = [(name, q_offset, q_len) for name in LAYOUTS for q_offset, q_len in [(0, None), (4, 11), (7, None)]
         if name != "long documents" or q_offset == 0]


@interpreted_only
@pytest.mark.parametrize("name, q_offset, q_len", CASES)
@pytest.mark.parametrize("kv_heads, group", [(1, 1), (2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windows_and_bos_only_documents_match_float64(triton_flash, name, q_offset, q_len, kv_heads, group, dtype):
    bounds, windows = LAYOUTS[name]
    q_len = bounds[-1] - q_offset if q_len is None else q_len
    assert anchored(bounds, windows, "anchor", q_offset, q_len)
    assert_close(*run(bounds, windows, "anchor", q_offset, q_len, kv_heads, group, 16, dtype, seed=7), dtype)
    assert triton_flash == ["forward_kernel", "backward_kernel", "finish_kernel"]


@interpreted_only
def test_kernels_equal_the_torch_fallback():
    """The same arithmetic two ways, on a plan with several anchors and long runs: the kernels and the torch
    fallback agree to fp32 rounding, forward and backward."""
    bounds, windows = LAYOUTS["long documents"]
    blocks = pack_layout(torch.tensor(bounds), torch.tensor(windows)).blocks("anchor", 2, bounds[-1] - 2)
    plan = anchor_key.anchor_plan(blocks, 2, torch.device("cpu"))
    assert plan.slot_tiles.diff().min() > 1  # each anchor's rows fill several tiles
    g = torch.Generator().manual_seed(3)
    q, out, dout = (torch.randn(bounds[-1] - 2, 8, 16, generator=g) for _ in range(3))
    k, v, dk, dv = (torch.randn(bounds[-1], 2, 16, generator=g) for _ in range(4))
    lse, dq = torch.randn(8, bounds[-1] - 2, generator=g) + 3, torch.randn(q.shape, generator=g)
    results = []
    for kernels in (gpu.anchor_key_triton()[0], None):
        tensors = [x.clone() for x in (out, lse, dq, dk, dv)]
        o, l, dq_, dk_, dv_ = tensors
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gpu, "anchor_key_triton", lambda: (kernels, "fallback"))
            anchor_key.merge_anchor(o, l, q, k, v, plan, 0.3)
            anchor_key.merge_anchor_backward(dq_, dk_, dv_, dout, q, k, v, o, l, plan, 0.3)
        results.append(tensors)
    for name, a, b, before in zip(("out", "lse", "dq", "dk", "dv"), *results, (out, lse, dq, dk, dv)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
        assert not torch.equal(a, before), name  # the merge changed something


def test_the_kernels_import_on_a_triton_without_knobs(monkeypatch):
    """``triton.knobs`` appeared in Triton 3.4; the [gpu] extra allows 3.2 (torch 2.6's). The module reads whether
    its kernels are interpreted off the kernels themselves, so it imports there too, and says the same."""
    import importlib.util

    import triton

    monkeypatch.delattr(triton, "knobs", raising=False)
    path = Path(anchor_key.__file__).with_name("anchor_key_triton.py")
    spec = importlib.util.spec_from_file_location("anchor_key_triton_without_knobs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.INTERPRETED == INTERPRETED
    assert module.runs_on(torch.device("cpu")) == INTERPRETED and module.runs_on(torch.device("cuda")) != INTERPRETED
