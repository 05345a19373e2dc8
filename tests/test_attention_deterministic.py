"""Megatron's ``deterministic_mode`` reaches every attention backend's backward, and the backend is chosen once.

The GPU libraries are stood in on the CPU (tests/varlen_standins.py, with the signatures of their releases);
each stand-in backward records the ``deterministic`` it was handed (torch's FlashAttention-2 op takes none: it
records whether ``torch.use_deterministic_algorithms`` was on when it ran). The core attention is Megatron's
drop-in built from a ``TransformerConfig``, as every front door builds it. About 3 CPU seconds.
"""
from __future__ import annotations

import types

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

import varlen_standins  # tests/varlen_standins.py
from nemo_anchor import gpu
from nemo_anchor.attention import BackendUnavailableError, fa3, fa4, flash, functional, te, torch_varlen
from nemo_anchor.model import core_attention
from nemo_anchor.model.core_attention import AnchorCoreAttention
from nemo_anchor.model.packed_seq import make_packed_seq_params

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
DOCS = torch.tensor([0, 5, 9, 20, 31, 40, 64], dtype=torch.int32)
WINDOWS = torch.tensor([0, 31, 64], dtype=torch.int32)


def _recording(backward, seen, flag_at=None):
    """``backward`` that records its ``deterministic`` argument (keyword, or position ``flag_at``)."""
    def call(*args, **kwargs):
        seen.append(kwargs["deterministic"] if "deterministic" in kwargs else
                    args[flag_at] if flag_at is not None else False)
        return backward(*args, **kwargs)
    return call


def _fa4_backward_with_flag(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                            window_size_left=None, window_size_right=None, *, cu_seqlens_q=None, cu_seqlens_k=None,
                            max_seqlen_q=None, max_seqlen_k=None, deterministic=False):
    """FlashAttention-4's newer ``_flash_attn_bwd`` (with ``deterministic``)."""
    return varlen_standins.fa4_backward(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left,
                                        window_size_right, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _torch_flash_ops(seen):
    def forward(query, key, value, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, debug, *, scale=None):
        out, lse = varlen_standins.forward(query, key, value, cum_q, cum_k, scale)
        return out, lse, torch.zeros(2), torch.empty(0), torch.empty(0)

    def backward(grad_out, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, rng, unused,
                 *, scale=None):
        # what aten._flash_attention_backward reads instead of a flag
        seen.append(torch.are_deterministic_algorithms_enabled()
                    and not torch.is_deterministic_algorithms_warn_only_enabled())
        return varlen_standins.backward(grad_out, query, key, value, out, lse, cum_q, cum_k, scale)
    return forward, backward


def _varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
    """torch's ``varlen_attn`` (causal, bottom right) with its own autograd, which takes no deterministic flag."""
    assert window_size == (-1, 0)
    return varlen_standins.Differentiable.apply(query, key, value, cu_seq_q, cu_seq_k, scale)


@pytest.fixture
def blackwell_standins(monkeypatch):
    """Every FlashAttention backend available on CPU tensors (a Blackwell, where FlashAttention-4 has its
    deterministic backward); returns the ``deterministic`` each backward was handed, per backend."""
    seen = {name: [] for name in ("flash", "fa3", "fa4", "torch_varlen")}
    differentiable = varlen_standins.with_autograd
    monkeypatch.setattr(gpu, "flash_attn_varlen_func", lambda: (differentiable(varlen_standins.flash_attn_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_varlen_backward",
                        lambda: (_recording(varlen_standins.flash_attn_varlen_backward, seen["flash"], 20), None))
    monkeypatch.setattr(gpu, "flash_attn_3_varlen_func", lambda: (differentiable(varlen_standins.fa3_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_3_backward",
                        lambda: (_recording(varlen_standins.fa3_backward, seen["fa3"], 20), None))
    monkeypatch.setattr(gpu, "flash_attn_4_varlen_func", lambda: (differentiable(varlen_standins.fa4_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_4_backward", lambda: (_recording(_fa4_backward_with_flag, seen["fa4"]), None))
    monkeypatch.setattr(gpu, "torch_flash_attention_ops", lambda: (_torch_flash_ops(seen["torch_varlen"]), None))
    monkeypatch.setattr(gpu, "torch_varlen_attn", lambda: (_varlen_attn, None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    for module in (flash, fa3, fa4, torch_varlen):
        monkeypatch.setattr(module, "unavailable_reason", lambda q, needs_grad: None)
    monkeypatch.setattr(core_attention, "_LOGGED", set())
    monkeypatch.delenv("NEMO_ANCHOR_ANCHOR_PATH", raising=False)
    return seen


def _core_attention(backend: str, mask: str, deterministic: bool) -> AnchorCoreAttention:
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, attention_dropout=0.0, deterministic_mode=deterministic)
    return AnchorCoreAttention(config, 1, AttnMaskType.causal, "self", pg_collection=types.SimpleNamespace(cp=None),
                               mask=mask, backend=backend)


def _forward_backward(module: AnchorCoreAttention, layers: int = 1) -> None:
    g = torch.Generator().manual_seed(0)
    params = make_packed_seq_params(DOCS, WINDOWS, "anchor")
    for _ in range(layers):
        q = torch.randn(64, HEADS, HEAD_DIM, generator=g, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(64, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        module(q, k, v, None, packed_seq_params=params).float().sum().backward()


@pytest.mark.parametrize("backend", ["flash", "fa3", "fa4", "torch_varlen"])
@pytest.mark.parametrize("mask", ["anchor", "intra_doc"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_reaches_each_flash_attention_backward(blackwell_standins, backend, mask, deterministic):
    """With and without anchors (the documents alone go through the library's backward too when asked)."""
    _forward_backward(_core_attention(backend, mask, deterministic))
    handed = blackwell_standins[backend]
    if deterministic:
        assert handed == [True]
    else:
        assert handed in ([False], [])  # [] : blocks without anchors went through the library's own autograd
    assert not torch.are_deterministic_algorithms_enabled()  # torch_varlen switched it on for its call only


def test_without_a_deterministic_backward_auto_passes_over_the_backend_and_says_why(blackwell_standins, monkeypatch):
    """FlashAttention-4 has one on SM100/SM110 only, Transformer Engine only with NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(functional, "auto_order", lambda q: ("fa4", "te", "flash", "reference"))
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (types.SimpleNamespace(), None))
    monkeypatch.setattr(te, "unavailable_reason", lambda q, needs_grad: None)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    q = torch.zeros(8, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    name, skipped = functional.backend_choice("auto", q, True, "full", deterministic=True)
    assert name == "flash"
    assert "SM100/SM110 only" in skipped["fa4"] and "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0" in skipped["te"]
    assert functional.backend_choice("auto", q, True, "full")[0] == "fa4"  # not asked: no such condition
    with pytest.raises(BackendUnavailableError, match="'fa4' cannot run here: .*SM100/SM110 only"):
        functional.choose_backend("fa4", q, True, "anchor", deterministic=True)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    assert functional.backend_choice("auto", q, True, "full", deterministic=True)[0] == "te"


def test_the_backend_is_chosen_once_per_module(blackwell_standins, monkeypatch):
    """Four layers' forward and backward through one module: the availability checks run at the first forward
    only (then per kind of call: without gradients is another kind)."""
    checks = []
    check = functional.unavailable_reason
    monkeypatch.setattr(functional, "unavailable_reason", lambda *args, **kwargs: checks.append(args) or check(*args, **kwargs))
    module = _core_attention("auto", "anchor", deterministic=False)
    _forward_backward(module, layers=4)
    first = len(checks)
    assert first >= 1
    _forward_backward(module, layers=4)
    assert len(checks) == first
    with torch.no_grad():
        params = make_packed_seq_params(DOCS, WINDOWS, "anchor")
        q, k, v = (torch.zeros(64, h, HEAD_DIM, dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
        module(q, k, v, None, packed_seq_params=params)
        without_gradients = len(checks)
        assert without_gradients > first
        module(q, k, v, None, packed_seq_params=params)
    assert len(checks) == without_gradients
