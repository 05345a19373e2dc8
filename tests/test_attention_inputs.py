"""Bad input to anchor_attention is a ValueError naming the problem; unusable backends say why."""
from __future__ import annotations

import pytest
import torch

from nemo_anchor import gpu
from nemo_anchor.attention import BackendUnavailableError, anchor_attention

T, H, D = 8, 4, 6


def call(q=None, k=None, v=None, cu_seqlens=None, **kwargs):
    q = torch.randn(T, H, D) if q is None else q
    k = torch.randn(T, 2, D) if k is None else k
    v = torch.randn(T, 2, D) if v is None else v
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32) if cu_seqlens is None else cu_seqlens
    return anchor_attention(q, k, v, cu_seqlens, backend=kwargs.pop("backend", "reference"), **kwargs)


def ints(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(cu_seqlens=ints(0, 3, 8)[None]), r"cu_seqlens must be a 1-D integer tensor"),
        (dict(cu_seqlens=torch.tensor([0.0, 3.0, 8.0])), r"cu_seqlens must be a 1-D integer tensor.*float32"),
        (dict(cu_seqlens=[0, 3, 8]), r"cu_seqlens must be a 1-D integer tensor.*list"),
        (dict(cu_seqlens=ints(1, 3, 8)), r"cu_seqlens must run from 0 to T=8"),
        (dict(cu_seqlens=ints(0, 3, 7)), r"cu_seqlens must run from 0 to T=8"),
        (dict(cu_seqlens=ints(0)), r"cu_seqlens must run from 0 to T=8"),
        (dict(cu_seqlens=ints(0, 3, 3, 8)), r"strictly increasing.*cu_seqlens\[1\]=3 and cu_seqlens\[2\]=3"),
        (dict(cu_seqlens=ints(0, 5, 3, 8)), r"strictly increasing"),
        (dict(cu_windows=ints(0, 4, 8)), r"cu_windows must be a subset of cu_seqlens.*\[4\]"),
        (dict(cu_windows=ints(0, 3)), r"cu_windows must run from 0 to T=8"),
        (dict(k=torch.randn(T, 3, D), v=torch.randn(T, 3, D)), r"Hq=4 must be a multiple of .*Hkv=3"),
        (dict(v=torch.randn(T, 1, D)), r"k and v must have the same shape"),
        (dict(k=torch.randn(T, 2, D + 1), v=torch.randn(T, 2, D + 1)), r"same head_dim, got 6 and 7"),
        (dict(q=torch.randn(T, H * D)), r"q must be a 3-D tensor"),
        (dict(q=torch.randn(T + 1, H, D)), r"query rows .* T=8"),
        (dict(q=torch.randn(T, H, D).bfloat16()), r"share one dtype"),
        (dict(q=torch.randn(T, H, D).double(), k=torch.randn(T, 2, D).double(), v=torch.randn(T, 2, D).double()),
         r"share one dtype"),
        (dict(k=torch.randn(T, 2, D, device="meta"), v=torch.randn(T, 2, D, device="meta")), r"one device"),
        (dict(mode="causal"), r"unknown mode 'causal'"),
        (dict(backend="triton"), r"unknown backend 'triton'"),
        (dict(softmax_scale=-1.0), r"softmax_scale must be a positive finite number"),
        (dict(q=torch.randn(4, H, D), q_offset=5), r"\[5, 9\) must be a non-empty part of the T=8"),
        (dict(q_offset=-1), r"non-empty part"),
        (dict(q_offset=1.0), r"q_offset must be an int"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        call(**kwargs)


def test_requested_gpu_backend_that_cannot_import_says_why(monkeypatch):
    monkeypatch.setattr(gpu, "flash_attn_varlen_func", lambda: (None, "`import flash_attn` failed: no CUDA"))
    with pytest.raises(BackendUnavailableError, match="'flash' cannot run here: `import flash_attn` failed: no CUDA"):
        call(backend="flash")


@pytest.mark.parametrize("backend, accessor, kernel", [
    ("flash", "flash_attn_varlen_func", lambda *a, **k: None),
    ("te", "transformer_engine_pytorch", object()),
])
def test_requested_gpu_backend_refuses_cpu_tensors(monkeypatch, backend, accessor, kernel):
    monkeypatch.setattr(gpu, accessor, lambda: (kernel, None))
    with pytest.raises(BackendUnavailableError, match="CUDA tensors only, got device cpu"):
        call(backend=backend, q=torch.randn(T, H, D).bfloat16(), k=torch.randn(T, 2, D).bfloat16(),
             v=torch.randn(T, 2, D).bfloat16(), mode="intra_doc")  # te runs no anchor mode anywhere


def test_gpu_imports_are_guarded_against_any_exception(monkeypatch):
    def broken_import(name):
        raise RuntimeError("transformer_engine was built without CUDA")

    gpu._import.cache_clear()
    monkeypatch.setattr(gpu.importlib, "import_module", broken_import)
    try:
        module, reason = gpu.transformer_engine_pytorch()
        assert module is None and "RuntimeError: transformer_engine was built without CUDA" in reason
        kernel, reason = gpu.flash_attn_varlen_func()
        assert kernel is None and "import flash_attn" in reason
    finally:
        gpu._import.cache_clear()
