"""anchor_attention: the layout semantics, and every CPU-runnable backend against the reference.

The flash-attn and Transformer Engine call sites run here through pure-torch stand-ins that
implement the documented semantics of ``flash_attn_varlen_func`` and TE's THD
``DotProductAttention`` (int32 cu_seqlens, exact max_seqlen, bottom-right causal, GQA heads);
the real kernels are exercised only where CUDA is available.
"""
from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_anchor import gpu
from nemo_anchor.attention import BackendUnavailableError, anchor_attention, fa3, fa4, flash, te
from nemo_anchor.attention.layout import layout_blocks, varlen_plan
from nemo_anchor.attention.reference import dense_mask

import varlen_standins  # tests/varlen_standins.py
from layout_strategies import packed_layouts  # tests/layout_strategies.py

SETTINGS = settings(max_examples=40, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny problems: extra threads only add synchronisation, which a busy machine makes slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Problem:
    doc_bounds: tuple[int, ...]
    window_bounds: tuple[int, ...]
    mode: str
    kv_heads: int
    group: int
    head_dim: int
    q_offset: int
    q_len: int
    seed: int

    @property
    def total(self) -> int:
        return self.doc_bounds[-1]

    def boundaries(self) -> dict:
        return dict(
            cu_seqlens=torch.tensor(self.doc_bounds, dtype=torch.int32),
            cu_windows=torch.tensor(self.window_bounds, dtype=torch.int32),
            mode=self.mode,
            q_offset=self.q_offset,
        )

    def tensors(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed)
        shapes = [
            (self.q_len, self.kv_heads * self.group, self.head_dim),
            (self.total, self.kv_heads, self.head_dim),
            (self.total, self.kv_heads, self.head_dim),
        ]
        return tuple(torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes)


@st.composite
def problems(draw) -> Problem:
    doc_bounds, windows, mode, q_offset, q_len = draw(packed_layouts())
    return Problem(
        doc_bounds, windows, mode,
        kv_heads=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 3])),
        head_dim=draw(st.sampled_from([1, 5, 16, 33])),
        q_offset=q_offset, q_len=q_len, seed=draw(st.integers(0, 2**16)),
    )


def visible_keys(p: int, doc_bounds, window_bounds, mode: str) -> set[int]:
    """The issue's definition, written independently of the layout code."""
    def start_of(bounds):
        return max(b for b in bounds if b <= p)

    window, doc = start_of(window_bounds), start_of(doc_bounds)
    if mode == "full":
        return set(range(window, p + 1))
    keys = set(range(doc, p + 1))
    return keys | {window} if mode == "anchor" else keys


def outputs_and_grads(problem: Problem, dtype: torch.dtype, backend: str, **kwargs) -> list[torch.Tensor]:
    q, k, v = problem.tensors(dtype)
    out = anchor_attention(q, k, v, backend=backend, **problem.boundaries(), **kwargs)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(problem.seed + 1)).to(dtype)
    return [out, *torch.autograd.grad(out, (q, k, v), grad_out)]


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def assert_matches(actual: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype) -> None:
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        assert a.dtype == e.dtype == dtype and a.shape == e.shape, name
        scale = max(1.0, e.float().abs().max().item())
        torch.testing.assert_close(a.float(), e.float(), atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype], msg=name)


# --- semantics ------------------------------------------------------------------------------

@SETTINGS
@given(problems())
def test_mask_follows_the_definition_of_each_mode(problem):
    b = problem.boundaries()
    blocks = layout_blocks(b["cu_seqlens"], b["cu_windows"], problem.mode, problem.total, problem.q_offset, problem.q_len)
    mask = dense_mask(blocks, problem.q_offset, problem.total, torch.device("cpu"))
    for row in range(problem.q_len):
        p = problem.q_offset + row
        expected = visible_keys(p, problem.doc_bounds, problem.window_bounds, problem.mode)
        assert set(torch.nonzero(mask[row]).flatten().tolist()) == expected, (row, p)


def test_reference_is_softmax_attention_over_the_visible_keys():
    problem = Problem((0, 3, 4, 9), (0, 4, 9), "anchor", kv_heads=2, group=2, head_dim=3, q_offset=0, q_len=9, seed=0)
    q, k, v = (x.detach().double() for x in problem.tensors(torch.float32))
    out = anchor_attention(q.float(), k.float(), v.float(), backend="reference", **problem.boundaries(), softmax_scale=0.7)
    for p in range(9):
        keys = sorted(visible_keys(p, problem.doc_bounds, problem.window_bounds, "anchor"))
        for h in range(4):
            weights = torch.softmax(0.7 * k[keys, h // 2] @ q[p, h], dim=0)
            torch.testing.assert_close(out[p, h].double(), weights @ v[keys, h // 2], atol=1e-6, rtol=1e-5)


def test_anchor_adds_exactly_the_window_anchor_to_intra_doc():
    problem = Problem((0, 4, 6, 10), (0, 10), "anchor", 1, 1, 8, 0, 10, seed=3)
    anchor, intra, full = (outputs_and_grads(replace(problem, mode=m), torch.float32, "cpu")[0]
                           for m in ("anchor", "intra_doc", "full"))
    torch.testing.assert_close(anchor[:4], intra[:4])  # the first document holds the anchor itself
    torch.testing.assert_close(anchor[:4], full[:4])
    assert not torch.allclose(anchor[4:], intra[4:]) and not torch.allclose(anchor[4:], full[4:])


# --- backends against the reference ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@SETTINGS
@given(problem=problems())
def test_cpu_backend_matches_reference(dtype, problem):
    assert_matches(outputs_and_grads(problem, dtype, "cpu"), outputs_and_grads(problem, dtype, "reference"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cpu_backend_on_long_documents(dtype):
    # documents spanning several kernel tiles, queries from the middle, a custom scale
    problem = Problem((0, 300, 301, 700), (0, 301, 700), "anchor", 2, 2, 64, 250, 400, seed=1)
    assert_matches(outputs_and_grads(problem, dtype, "cpu", softmax_scale=0.1),
                   outputs_and_grads(problem, dtype, "reference", softmax_scale=0.1), dtype)


def test_auto_on_the_cpu_trains_through_the_cpu_backend():
    problem = Problem((0, 5, 12), (0, 12), "anchor", 2, 2, 8, 0, 12, seed=2)
    assert_matches(outputs_and_grads(problem, torch.float32, "auto"),
                   outputs_and_grads(problem, torch.float32, "reference"), torch.float32)


# --- flash-attn and Transformer Engine call sites, through stand-ins ------------------------

class DotProductAttentionStandin(torch.nn.Module):
    """Transformer Engine's ``DotProductAttention`` in THD format with bottom-right causal masks."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", softmax_scale=None):
        super().__init__()
        assert attention_dropout == 0.0
        self.heads, self.head_dim, self.kv_heads = num_attention_heads, kv_channels, num_gqa_groups or num_attention_heads
        self.scale = kv_channels ** -0.5 if softmax_scale is None else softmax_scale

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None):
        assert qkv_format == "thd" and attn_mask_type == "padding_causal_bottom_right" and attention_mask is None
        assert query_layer.shape[1:] == (self.heads, self.head_dim) and key_layer.shape[1] == self.kv_heads
        varlen_standins.check_contract(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                                       max_seqlen_q, max_seqlen_kv)
        out = varlen_standins.Differentiable.apply(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_kv,
                                                   self.scale)
        return out.reshape(out.shape[0], -1)


@pytest.fixture
def gpu_standins(monkeypatch):
    """The flash, fa3, fa4 and te backends run on CPU tensors with the stand-in kernels."""
    differentiable = varlen_standins.with_autograd
    monkeypatch.setattr(gpu, "flash_attn_varlen_func", lambda: (differentiable(varlen_standins.flash_attn_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_varlen_backward", lambda: (varlen_standins.flash_attn_varlen_backward, None))
    monkeypatch.setattr(gpu, "flash_attn_3_varlen_func", lambda: (differentiable(varlen_standins.fa3_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_3_backward", lambda: (varlen_standins.fa3_backward, None))
    monkeypatch.setattr(gpu, "flash_attn_4_varlen_func", lambda: (differentiable(varlen_standins.fa4_varlen_func), None))
    monkeypatch.setattr(gpu, "flash_attn_4_backward", lambda: (varlen_standins.fa4_backward, None))
    fake_te = types.SimpleNamespace(DotProductAttention=DotProductAttentionStandin)
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (fake_te, None))
    for module in (flash, fa3, fa4, te):
        monkeypatch.setattr(module, "unavailable_reason", lambda q, needs_grad: None)


@pytest.mark.parametrize("backend", ["flash", "fa3", "fa4", "te"])
# the fixture only installs the stand-ins: nothing to reset between examples
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_gpu_call_sites_match_reference(gpu_standins, backend, problem):
    dtype = torch.bfloat16
    if backend == "te" and problem.mode == "anchor":
        with pytest.raises(BackendUnavailableError, match="copy K and V in every layer"):
            outputs_and_grads(problem, dtype, backend, softmax_scale=0.3)
        return
    assert_matches(outputs_and_grads(problem, dtype, backend, softmax_scale=0.3),
                   outputs_and_grads(problem, dtype, "reference", softmax_scale=0.3), dtype)


@pytest.mark.parametrize("backend, accessor", [("flash", "flash_attn_varlen_func"), ("fa3", "flash_attn_3_varlen_func"),
                                              ("fa4", "flash_attn_4_varlen_func")])
def test_anchor_costs_no_key_value_copy_in_any_flash_attention(gpu_standins, monkeypatch, backend, accessor):
    """With anchors the kernel reads k and v in place, and autograd keeps q, k, v, the output and the log-sum-exp:
    no gathered K/V of T + documents rows in any layer."""
    kernel, _ = getattr(gpu, accessor)()
    seen = []

    def spying(q, k, v, *args, **kwargs):
        seen.append((k, v))
        return kernel(q, k, v, *args, **kwargs)

    monkeypatch.setattr(gpu, accessor, lambda: (spying, None))
    q, k, v = (torch.randn(64, 4, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = anchor_attention(q, k, v, torch.tensor([0, 5, 9, 20, 31, 40, 64], dtype=torch.int32), backend=backend,
                               cu_windows=torch.tensor([0, 31, 64], dtype=torch.int32), mode="anchor")
    (key, value), = seen
    assert key.shape == k.shape and key.data_ptr() == k.data_ptr() and value.data_ptr() == v.data_ptr()
    inputs = {x.data_ptr() for x in (q, k, v, out)}
    kv_bytes = k.numel() * k.element_size()
    assert [t for t in saved if t.data_ptr() not in inputs and t.numel() * t.element_size() >= kv_bytes] == []


def test_varlen_plan_prefixes_each_later_document_with_its_window_anchor():
    # windows [0, 9) and [9, 12); documents [0,3) [3,5) [5,9) | [9,10) [10,12)
    blocks = layout_blocks(torch.tensor([0, 3, 5, 9, 10, 12]), torch.tensor([0, 9, 12]), "anchor", 12, 0, 12)
    plan = varlen_plan(blocks, torch.device("cpu"))
    assert plan.cu_seqlens_q.tolist() == [0, 3, 5, 9, 10, 12]
    assert plan.cu_seqlens_k.tolist() == [0, 3, 6, 11, 12, 15]
    assert plan.cu_seqlens_q.dtype == plan.cu_seqlens_k.dtype == torch.int32
    assert (plan.max_seqlen_q, plan.max_seqlen_k) == (4, 5)
    assert plan.kv_rows.tolist() == [0, 1, 2, 0, 3, 4, 0, 5, 6, 7, 8, 9, 9, 10, 11]


def test_varlen_plan_after_a_bos_only_document_repeats_the_anchor_as_a_plain_key():
    blocks = layout_blocks(torch.tensor([0, 1, 5]), None, "anchor", 5, 0, 5)
    plan = varlen_plan(blocks, torch.device("cpu"))
    assert plan.kv_rows.tolist() == [0, 0, 1, 2, 3, 4]
    assert plan.cu_seqlens_q.tolist() == [0, 1, 5] and plan.cu_seqlens_k.tolist() == [0, 1, 6]


def test_varlen_plan_without_anchors_slices_keys_without_copying():
    blocks = layout_blocks(torch.tensor([0, 3, 5, 9]), None, "intra_doc", 9, 4, 5)  # queries 4..8
    plan = varlen_plan(blocks, torch.device("cpu"))
    assert plan.kv_rows == slice(3, 9)
    assert plan.cu_seqlens_q.tolist() == [0, 1, 5] and plan.cu_seqlens_k.tolist() == [0, 2, 6]


# --- the real kernels -----------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch_varlen", "flex", "flash", "fa3", "fa4", "te"])
def test_real_gpu_kernels_match_reference(backend):
    problem = Problem((0, 100, 101, 300, 512), (0, 300, 512), "anchor", 2, 2, 64, 0, 512, seed=0)
    q, k, v = (x.detach().cuda().requires_grad_() for x in problem.tensors(torch.bfloat16))
    reason = importlib.import_module(f"nemo_anchor.attention.{backend}").unavailable_reason(q, True)
    if reason is not None:
        pytest.skip(reason)
    boundaries = {key: (x.cuda() if isinstance(x, torch.Tensor) else x) for key, x in problem.boundaries().items()}
    results = []
    for name in (backend, "reference"):
        out = anchor_attention(q, k, v, backend=name, **boundaries)
        results.append([out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))])
    assert_matches([x.cpu() for x in results[0]], [x.cpu() for x in results[1]], torch.bfloat16)
