"""The ``torch_varlen`` backend (torch's FlashAttention-2 ``varlen_attn``), on the CPU through a stand-in.

``varlen_attn`` runs on CUDA only. Here a pure-torch stand-in follows its documented semantics
(per-sequence attention over int32 ``cu_seq_q``/``cu_seq_k``, ``window_size=(left, right)``
aligned to the bottom right, grouped-query heads behind ``enable_gqa``); the stand-in is checked
against ``F.scaled_dot_product_attention`` where the semantics are unambiguous, and the plan
the backend hands the kernel is checked against the reference's dense mask directly.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from nemo_anchor import gpu
from nemo_anchor.attention import BackendUnavailableError, anchor_attention, functional, torch_varlen
from nemo_anchor.attention.layout import layout_blocks, varlen_plan
from nemo_anchor.attention.reference import dense_mask

import varlen_standins  # tests/varlen_standins.py
from layout_strategies import packed_layouts  # tests/layout_strategies.py

CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the stand-in ---------------------------------------------------------------------------

def varlen_attn_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's ``varlen_attn`` contract, computed densely in fp64 per sequence."""
    assert return_aux is None and seqused_k is None and block_table is None and num_splits is None
    assert query.dtype == key.dtype == value.dtype and query.dim() == key.dim() == 3 and key.shape == value.shape
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and cu_seq_q.device == query.device
    assert len(cu_seq_q) == len(cu_seq_k) and cu_seq_q[0] == cu_seq_k[0] == 0
    assert cu_seq_q[-1] == query.shape[0] and cu_seq_k[-1] == key.shape[0]
    len_q, len_k = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    assert isinstance(max_q, int) and isinstance(max_k, int) and (max_q, max_k) == (max(len_q), max(len_k))
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")  # as torch's wrapper
    assert query.shape[1] % key.shape[1] == 0
    left, right = window_size
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    group = query.shape[1] // key.shape[1]
    outs = []
    for qs, qn, ks, kn in zip(cu_seq_q.tolist(), len_q, cu_seq_k.tolist(), len_k):
        diagonal = torch.arange(qn)[:, None] + (kn - qn)  # bottom-right: the last query sits on the last key
        keys = torch.arange(kn)[None]
        allowed = torch.ones(qn, kn, dtype=torch.bool)
        if right >= 0:
            allowed &= keys <= diagonal + right
        if left >= 0:
            allowed &= keys >= diagonal - left
        qi = query[qs:qs + qn].double()
        ki, vi = (x[ks:ks + kn].double().repeat_interleave(group, 1) for x in (key, value))
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vi))
    return torch.cat(outs).to(query.dtype)


def flash_attention_forward_standin(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                    return_debug_mask, *, scale=None):
    """``aten._flash_attention_forward``'s varlen contract: (out, lse fp32 [Hq, Tq], rng, unused, debug)."""
    assert dropout_p == 0.0 and is_causal and not return_debug_mask and scale is not None
    varlen_standins.check_contract(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    out, lse = varlen_standins.forward(query, key, value, cum_seq_q, cum_seq_k, scale)
    return out, lse, torch.zeros(2), torch.empty(0), torch.empty(0)


def flash_attention_backward_standin(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                                     dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten._flash_attention_backward``: FlashAttention's backward from the *given* out and lse."""
    assert dropout_p == 0.0 and is_causal
    varlen_standins.check_contract(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    return varlen_standins.backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, scale)


FLASH_OPS_STANDIN = (flash_attention_forward_standin, flash_attention_backward_standin)


def standin_torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The first release's signature: ``is_causal``, no ``scale`` (D ** -0.5), no GQA flag."""
    return varlen_attn_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                               window_size=(-1, 0) if is_causal else (-1, -1), enable_gqa=True)


def standin_without_gqa_flag(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                             window_size=(-1, -1)):
    """A later signature: ``scale`` and ``window_size``, no ``enable_gqa`` (no head-count check either)."""
    return varlen_attn_standin(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                               scale=scale, window_size=window_size, enable_gqa=True)


def random_sequences(seed: int, lengths_q: list[int], lengths_k: list[int], heads=4, kv_heads=2, head_dim=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, head_dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lengths_k), kv_heads, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    cu = [torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32) for lengths in (lengths_q, lengths_k)]
    return q, k, v, *cu


def sdpa_per_sequence(q, k, v, cu_q, cu_k, *, is_causal=False, mask_of=None):
    """torch's own SDPA per sequence (GQA through ``enable_gqa``); ``mask_of(qn, kn)`` gives its attn_mask."""
    outs = []
    for qs, qe, ks, ke in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[qs:qe], k[ks:ke], v[ks:ke]))
        mask = None if mask_of is None else mask_of(qe - qs, ke - ks)
        out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def test_standin_without_window_is_sdpa_per_sequence():
    q, k, v, cu_q, cu_k = random_sequences(0, [3, 1, 7], [5, 2, 7])
    out = varlen_attn_standin(q, k, v, cu_q, cu_k, 7, 7, enable_gqa=True)
    torch.testing.assert_close(out, sdpa_per_sequence(q, k, v, cu_q, cu_k))


def test_standin_causal_on_square_sequences_is_sdpa_is_causal():
    # equal query and key lengths: top-left and bottom-right alignment coincide
    q, k, v, cu_q, cu_k = random_sequences(1, [4, 1, 9], [4, 1, 9])
    out = varlen_attn_standin(q, k, v, cu_q, cu_k, 9, 9, window_size=(-1, 0), enable_gqa=True)
    torch.testing.assert_close(out, sdpa_per_sequence(q, k, v, cu_q, cu_k, is_causal=True))


def test_standin_causal_with_more_keys_is_torchs_lower_right_causal_bias():
    q, k, v, cu_q, cu_k = random_sequences(2, [2, 5, 1], [6, 6, 4])
    out = varlen_attn_standin(q, k, v, cu_q, cu_k, 5, 6, window_size=(-1, 0), enable_gqa=True)
    # torch's documented bottom-right causal mask, materialised as a boolean attn_mask
    expected = sdpa_per_sequence(q, k, v, cu_q, cu_k, mask_of=lambda qn, kn: causal_lower_right(qn, kn)._materialize(CPU))
    torch.testing.assert_close(out, expected)


def test_standin_refuses_grouped_heads_without_enable_gqa_like_torch():
    q, k, v, cu_q, cu_k = random_sequences(3, [2], [2])
    with pytest.raises(ValueError, match="same number of heads"):
        varlen_attn_standin(q, k, v, cu_q, cu_k, 2, 2, window_size=(-1, 0))


# --- the plan: what the kernel is given implies the reference's mask --------------------------

def implied_mask(plan, q_len: int, total: int) -> torch.Tensor:
    """``[Tq, T]`` int: how often query row i is given key position j by the plan under bottom-right causal."""
    rows = torch.arange(total)[plan.kv_rows] if isinstance(plan.kv_rows, slice) else plan.kv_rows
    counts = torch.zeros(q_len, total, dtype=torch.int64)
    cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
    for qs, qe, ks, ke in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        for a in range(qe - qs):
            for b in range(a + (ke - ks) - (qe - qs) + 1):  # bottom-right causal: keys up to the diagonal
                counts[qs + a, rows[ks + b]] += 1
    return counts


@settings(max_examples=60, deadline=None)
@given(packed_layouts())
def test_plan_gives_each_query_exactly_its_reference_keys(layout):
    bounds, windows, mode, q_offset, q_len = layout
    total = bounds[-1]
    blocks = layout_blocks(torch.tensor(bounds), torch.tensor(windows), mode, total, q_offset, q_len)
    plan = varlen_plan(blocks, CPU)
    assert plan.cu_seqlens_q.dtype == plan.cu_seqlens_k.dtype == torch.int32
    assert plan.cu_seqlens_q[0] == plan.cu_seqlens_k[0] == 0 and plan.cu_seqlens_q[-1] == q_len
    key_rows = len(range(total)[plan.kv_rows]) if isinstance(plan.kv_rows, slice) else len(plan.kv_rows)
    assert plan.cu_seqlens_k[-1] == key_rows
    q_lengths, k_lengths = plan.cu_seqlens_q.diff(), plan.cu_seqlens_k.diff()
    assert (q_lengths > 0).all() and (k_lengths >= q_lengths).all()
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (int(q_lengths.max()), int(k_lengths.max()))
    expected = dense_mask(blocks, q_offset, total, CPU)
    assert torch.equal(implied_mask(plan, q_len, total), expected.long())  # each visible key once, no other


# --- the backend through the stand-in, against the reference --------------------------------

@pytest.fixture
def standin(monkeypatch):
    """torch_varlen runs on CPU tensors with the stand-in kernel (the given one, default torch 2.13's)."""
    def install(kernel=varlen_attn_standin):
        monkeypatch.setattr(gpu, "torch_varlen_attn", lambda: (kernel, None))
        monkeypatch.setattr(gpu, "torch_flash_attention_ops", lambda: (FLASH_OPS_STANDIN, None))
        monkeypatch.setattr(torch_varlen, "unavailable_reason", lambda q, needs_grad: None)
    install()
    return install


def outputs_and_grads(bounds, windows, mode, q_offset, q_len, kv_heads, group, head_dim, dtype, backend, seed,
                      scale=None):
    g = torch.Generator().manual_seed(seed)
    total = bounds[-1]
    q = torch.randn(q_len, kv_heads * group, head_dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(total, kv_heads, head_dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
    out = anchor_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32),
                           cu_windows=torch.tensor(windows, dtype=torch.int32), mode=mode, backend=backend,
                           softmax_scale=scale, q_offset=q_offset)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def assert_matches(actual, expected, dtype):
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        assert a.dtype == e.dtype == dtype and a.shape == e.shape, name
        bound = max(1.0, e.float().abs().max().item())
        torch.testing.assert_close(a.float(), e.float(), atol=TOLERANCE[dtype] * bound, rtol=TOLERANCE[dtype], msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=packed_layouts(), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 4]),
       head_dim=st.sampled_from([8, 16]), seed=st.integers(0, 2**16))
def test_torch_varlen_matches_reference(standin, dtype, layout, kv_heads, group, head_dim, seed):
    args = (*layout, kv_heads, group, head_dim, dtype)
    assert_matches(outputs_and_grads(*args, "torch_varlen", seed, scale=0.3),
                   outputs_and_grads(*args, "reference", seed, scale=0.3), dtype)


@pytest.mark.parametrize("kernel", [standin_torch_2_10, standin_without_gqa_flag])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_torch_varlen_adapts_to_older_signatures(standin, kernel, scale):
    standin(kernel)
    args = ([0, 1, 6, 9, 15, 16, 20], [0, 9, 20], "anchor", 2, 16, 2, 4, 8, torch.bfloat16)
    assert_matches(outputs_and_grads(*args, "torch_varlen", 5, scale=scale),
                   outputs_and_grads(*args, "reference", 5, scale=scale), torch.bfloat16)


def test_kernel_arguments_follow_the_installed_signature():
    assert torch_varlen.kernel_arguments(varlen_attn_standin, 0.3, 64, True) == (
        {"window_size": (-1, 0), "scale": 0.3, "enable_gqa": True}, 1.0)
    assert torch_varlen.kernel_arguments(varlen_attn_standin, 0.3, 64, False) == (
        {"window_size": (-1, 0), "scale": 0.3}, 1.0)
    keywords, factor = torch_varlen.kernel_arguments(standin_torch_2_10, 0.3, 64, True)
    assert keywords == {"is_causal": True} and factor == pytest.approx(0.3 * 8)
    with pytest.raises(RuntimeError, match="neither window_size nor is_causal"):
        torch_varlen.kernel_arguments(lambda q, k, v, cu_q, cu_k, max_q, max_k: None, 0.3, 64, False)


def test_installed_torch_signature_is_understood():
    kernel, reason = gpu.torch_varlen_attn()
    if kernel is None:
        pytest.skip(reason)
    keywords, factor = torch_varlen.kernel_arguments(kernel, 0.3, 64, True)
    assert keywords["window_size"] == (-1, 0) and keywords["scale"] == 0.3 and factor == 1.0


# --- backend selection ----------------------------------------------------------------------

def cuda_like(dtype: torch.dtype, head_dim: int = 64):
    """What ``unavailable_reason`` reads of a CUDA query tensor."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=dtype, shape=(16, 4, head_dim))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without CUDA")
def test_auto_without_cuda_picks_cpu_and_explicit_torch_varlen_says_why():
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert functional.select_backend("auto", q, True, "anchor").__name__.endswith(".cpu")
    with pytest.raises(BackendUnavailableError, match="CUDA tensors only|varlen"):
        anchor_attention(q, q, q, torch.tensor([0, 4], dtype=torch.int32), backend="torch_varlen")


@pytest.mark.parametrize("dtype, capability, expected", [
    (torch.bfloat16, (9, 0), "torch_varlen"),
    (torch.float16, (8, 0), "torch_varlen"),
    (torch.float32, (9, 0), "flex"),  # FlashAttention has no fp32: flex runs fp32 on CUDA
    (torch.bfloat16, (7, 5), "flex"),  # pre-Ampere
])
def test_auto_on_cuda_picks_torch_varlen_first(monkeypatch, dtype, capability, expected):
    monkeypatch.setattr(gpu, "torch_varlen_attn", lambda: (varlen_attn_standin, None))
    monkeypatch.setattr(gpu, "flash_attn_varlen_func", lambda: (None, "not installed"))
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (None, "not installed"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert functional.select_backend("auto", cuda_like(dtype), True, "anchor").__name__.endswith("." + expected)


def test_auto_on_cuda_without_varlen_attn_falls_back_to_flash(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(gpu, "torch_varlen_attn", lambda: (None, "`import torch.nn.attention.varlen` failed"))
    monkeypatch.setattr(gpu, "flash_attn_varlen_func", lambda: (object(), None))
    monkeypatch.setattr(gpu, "flash_attn_varlen_backward", lambda: (object(), None))
    chosen = functional.select_backend("auto", cuda_like(torch.bfloat16), True, "anchor")
    assert chosen.__name__.endswith(".flash")
    assert "import" in torch_varlen.unavailable_reason(cuda_like(torch.bfloat16), True)


@pytest.mark.parametrize("head_dim", [12, 512])
def test_torch_varlen_refuses_head_dims_flash_attention_lacks(monkeypatch, head_dim):
    monkeypatch.setattr(gpu, "torch_varlen_attn", lambda: (varlen_attn_standin, None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "head_dim" in torch_varlen.unavailable_reason(cuda_like(torch.bfloat16, head_dim), True)


@pytest.mark.parametrize("capability, installed, expected, expected_with_anchors", [
    ((9, 0), {"fa3", "te", "fa4", "torch_varlen", "flash"}, "fa3", "fa3"),  # Hopper: FlashAttention-3 first
    ((9, 0), {"te", "fa4", "torch_varlen", "flash"}, "te", "fa4"),  # then cuDNN through TE (not with anchors)
    ((9, 0), {"fa4", "torch_varlen", "flash"}, "fa4", "fa4"),
    ((9, 0), {"torch_varlen", "flash"}, "torch_varlen", "torch_varlen"),  # FlashAttention-2 after them
    ((10, 0), {"fa3", "te", "fa4", "torch_varlen"}, "fa4", "fa4"),  # Blackwell: FA4 (FA3 is SM90 only)
    ((10, 0), {"fa3", "te", "torch_varlen"}, "te", "torch_varlen"),
    ((8, 0), {"fa3", "te", "fa4", "torch_varlen", "flash"}, "torch_varlen", "torch_varlen"),  # Ampere: FA2 order
    ((8, 0), {"fa3", "te", "fa4", "flash"}, "flash", "flash"),
])
def test_auto_prefers_each_generations_fastest_kernel(monkeypatch, capability, installed, expected,
                                                      expected_with_anchors):
    """With anchors te is passed over (it cannot merge the anchor without a K/V copy): the next in the order runs."""
    accessors = {"fa3": ("flash_attn_3_varlen_func", "flash_attn_3_backward"),
                 "fa4": ("flash_attn_4_varlen_func", "flash_attn_4_backward"),
                 "te": ("transformer_engine_pytorch",), "torch_varlen": ("torch_varlen_attn",),
                 "flash": ("flash_attn_varlen_func", "flash_attn_varlen_backward")}
    for name, names in accessors.items():
        found = (object(), None) if name in installed else (None, f"{name} not installed")
        for accessor in names:
            monkeypatch.setattr(gpu, accessor, lambda found=found: found)
    monkeypatch.setattr(gpu, "torch_flash_attention_ops", lambda: ((object(), object()), None))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    for mode, chosen in (("intra_doc", expected), ("anchor", expected_with_anchors)):
        assert functional.select_backend("auto", cuda_like(torch.bfloat16), True, mode).__name__.endswith("." + chosen)


def test_te_refuses_anchor_mode_and_says_why(monkeypatch):
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (object(), None))
    q = cuda_like(torch.bfloat16)
    assert functional.select_backend("te", q, True, "intra_doc").__name__.endswith(".te")
    with pytest.raises(BackendUnavailableError, match="backend 'te' cannot run here: .*copy K and V in every layer"):
        functional.select_backend("te", q, True, "anchor")


def test_anchor_costs_no_key_value_copy(standin, monkeypatch):
    """With anchors, the kernel reads k and v in place (views of the layer's tensors), and what autograd keeps
    for the backward is q, k, v, the output and the log-sum-exp: no gathered K/V of T + documents rows."""
    seen = []

    def spying_forward(query, key, value, *args, **kwargs):
        seen.append((key, value))
        return flash_attention_forward_standin(query, key, value, *args, **kwargs)

    monkeypatch.setattr(gpu, "torch_flash_attention_ops", lambda: ((spying_forward, flash_attention_backward_standin), None))
    bounds, windows = [0, 5, 9, 20, 31, 40, 64], [0, 31, 64]
    q, k, v = (torch.randn(64, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = anchor_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), backend="torch_varlen",
                               cu_windows=torch.tensor(windows, dtype=torch.int32), mode="anchor")
    (key, value), = seen
    assert key.shape == k.shape and key.data_ptr() == k.data_ptr() and value.data_ptr() == v.data_ptr()
    kv_bytes = k.numel() * k.element_size()
    copies = [t for t in saved if t.shape[0] >= k.shape[0] and t.data_ptr() not in
              {x.data_ptr() for x in (q, k, v, out)} and t.numel() * t.element_size() >= kv_bytes]
    assert copies == []
    out.sum().backward()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=packed_layouts(), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_anchor_merge_is_exact_in_fp32(standin, layout, kv_heads, group, seed):
    """The log-sum-exp merge adds no error of its own: in fp32 (the stand-in kernel computes in fp64) outputs and
    gradients equal the fp32 reference to rounding, for every mode, query range and grouped-query shape."""
    args = (*layout, kv_heads, group, 8, torch.float32)
    for actual, expected in zip(outputs_and_grads(*args, "torch_varlen", seed, scale=0.3),
                                outputs_and_grads(*args, "reference", seed, scale=0.3)):
        torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
