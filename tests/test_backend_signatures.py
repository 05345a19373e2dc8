"""Backends are checked by what they accept: a FlashAttention release whose functions lack the keywords
our backends pass, or ROCm's log-sum-exp layout, is a reason to fall through, not a TypeError mid-run.

The releases are stood in by modules whose functions have the signatures of other releases; CUDA by a
tensor that says it is on CUDA and a patched compute capability."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from nemo_anchor import gpu
from nemo_anchor.attention import fa3, fa4, flash, functional, requirements, te, torch_varlen


def _fa4_current(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, return_lse=False):
    raise AssertionError("not called")


def _fa4_beta_without_return_lse(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                 max_seqlen_k=None, softmax_scale=None, causal=False):
    raise AssertionError("a kernel that cannot take return_lse must not be called")


def _fa4_renamed_boundaries(q, k, v, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                            softmax_scale=None, causal=False, return_lse=False):
    raise AssertionError("a kernel with other boundary keywords must not be called")


def _fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False, *, cu_seqlens_q=None,
                  cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    raise AssertionError("not called")


def _fa4_backward_without_varlen(q, k, v, out, dout, lse, softmax_scale=None, causal=False):
    raise AssertionError("a backward that cannot take the boundaries must not be called")


@pytest.fixture
def flash_attention_4(monkeypatch):
    """Install a stand-in ``flash_attn.cute`` with the given forward and backward."""
    def install(forward, backward=_fa4_backward):
        cute = types.ModuleType("flash_attn.cute")
        cute.flash_attn_varlen_func = forward
        interface = types.ModuleType("flash_attn.cute.interface")
        interface._flash_attn_bwd = backward
        cute.interface = interface
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
        gpu._import.cache_clear()

    yield install
    gpu._import.cache_clear()


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the availability checks read of a query."""

    @property
    def is_cuda(self):
        return True


def _cuda_query(head_dim=64):
    return torch.Tensor._make_subclass(_OnCuda, torch.zeros(8, 2, head_dim, dtype=torch.bfloat16))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_flash_attention_4_with_the_keywords_we_pass_is_available(flash_attention_4):
    flash_attention_4(_fa4_current)
    assert gpu.flash_attn_4_varlen_func() == (_fa4_current, None)
    assert gpu.flash_attn_4_backward() == (_fa4_backward, None)


@pytest.mark.parametrize("forward, backward, missing", [
    (_fa4_beta_without_return_lse, _fa4_backward, "return_lse"),
    (_fa4_renamed_boundaries, _fa4_backward, "cu_seqlens_k, max_seqlen_k"),
    (_fa4_current, _fa4_backward_without_varlen, "cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k"),
], ids=["no-return_lse", "renamed-boundaries", "backward-without-varlen"])
def test_flash_attention_4_lacking_a_keyword_falls_through_with_the_reason(flash_attention_4, hopper, monkeypatch,
                                                                          forward, backward, missing):
    flash_attention_4(forward, backward)
    q = _cuda_query()
    reason = fa4.unavailable_reason(q, needs_grad=True)
    assert reason is not None and f"takes no {missing} " in reason, reason
    # auto skips it, and names it when asked for explicitly
    monkeypatch.setattr(functional, "auto_order", lambda q: ("fa4", "reference"))
    assert functional.select_backend("auto", q, True, "anchor").__name__.endswith(".reference")
    with pytest.raises(functional.BackendUnavailableError, match=f"'fa4' cannot run here: .*takes no {missing}"):
        functional.select_backend("fa4", q, True, "anchor")


def test_flash_attention_2_and_3_lacking_a_keyword_fall_through(monkeypatch):
    def fa2(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
            causal=False):  # no return_attn_probs: no log-sum-exp to merge
        raise AssertionError("not called")

    def fa3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                   is_causal=False):  # another name for causal
        raise AssertionError("not called")

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fa2))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.SimpleNamespace(flash_attn_varlen_func=fa3_varlen))
    gpu._import.cache_clear()
    try:
        assert "takes no return_attn_probs " in gpu.flash_attn_varlen_func()[1]
        assert "takes no causal, return_attn_probs " in gpu.flash_attn_3_varlen_func()[1]
        assert "takes no return_attn_probs " in flash.unavailable_reason(_cuda_query(), needs_grad=True)
    finally:
        gpu._import.cache_clear()


def test_rocm_is_refused_where_the_log_sum_exp_is_read(monkeypatch, hopper):
    """ROCm's FlashAttention returns the log-sum-exp as [B, H, max_q]: every backend that reads it says so;
    Transformer Engine, which returns none to us, does not."""
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    q = _cuda_query()
    for name, kwargs in (("flash-attn", {"max_head_dim": 256}), ("FlashAttention-3", {"capabilities": (9,)}),
                         ("FlashAttention-4", {"capabilities": (9, 10)}), ("torch's varlen_attn", {})):
        reason = requirements.cuda_reason(name, q, **kwargs)
        assert reason is not None and "ROCm" in reason and "[batch, heads, max_seqlen_q]" in reason, reason
    assert requirements.cuda_reason("Transformer Engine", q, returns_lse=False) is None
    for backend in (flash, fa3, fa4, torch_varlen):  # every log-sum-exp reader refuses, whatever is installed
        monkeypatch.setattr(gpu, {flash: "flash_attn_varlen_func", fa3: "flash_attn_3_varlen_func",
                                  fa4: "flash_attn_4_varlen_func", torch_varlen: "torch_varlen_attn"}[backend],
                            lambda: (lambda *args, **kwargs: None, None))
        assert "ROCm" in backend.unavailable_reason(q, needs_grad=True)
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (types.SimpleNamespace(), None))
    assert te.unavailable_reason(q, needs_grad=True) is None


@torch.library.custom_op("nemo_anchor_test::fa3_backward_before_deterministic", mutates_args=("dq", "dk", "dv"))
def _fa3_backward_without_deterministic(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                        out: torch.Tensor, softmax_lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                        dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, softmax_scale: float,
                                        is_causal: bool, window_size_left: int, window_size_right: int,
                                        softcap: float, sm_margin: int) -> None:
    raise AssertionError("an op that cannot take the arguments we pass must not be called")


def test_flash_attention_3s_backward_op_is_checked_against_its_schema(monkeypatch, hopper):
    """The op is called by keyword: one whose schema lacks a keyword we pass (here ``deterministic``) falls
    through with the reason, as FlashAttention-4's backward does, instead of taking one argument for another."""
    monkeypatch.setattr(gpu, "flash_attn_3_varlen_func", lambda: (lambda *args, **kwargs: None, None))
    monkeypatch.setattr(torch.ops, "flash_attn_3", types.SimpleNamespace(
        _flash_attn_backward=torch.ops.nemo_anchor_test.fa3_backward_before_deterministic))
    gpu._accepting.cache_clear()
    kernel, reason = gpu.flash_attn_3_backward()
    assert kernel is None and "_flash_attn_backward takes no deterministic " in reason, reason
    assert fa3.unavailable_reason(_cuda_query(), needs_grad=True) == reason
