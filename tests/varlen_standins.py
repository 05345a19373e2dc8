"""FlashAttention's varlen contract in fp64: what the CPU stand-ins of every FlashAttention generation compute.

A varlen call attends each query sequence ``cu_q[i]:cu_q[i+1]`` to its key sequence
``cu_k[i]:cu_k[i+1]``, causal aligned to the bottom right (the last query sits on the last key),
query head ``h`` reading key/value head ``h // (Hq // Hkv)``. The forward returns the output and
the log-sum-exp (fp32 ``[Hq, Tq]``); the backward is FlashAttention's, from the *given* output
and log-sum-exp: ``P = exp(S - lse)``, ``D = rowsum(dO * O)``, ``dS = P (dO V^T - D)``.

Inside :func:`cpu_flash_math` (benchmarks at 128K, which count launches) the stand-ins compute the
same through torch's CPU flash-attention kernel instead, in O(T) memory.
"""
from __future__ import annotations

import contextlib

import torch


def check_contract(q, k, v, cu_q, cu_k, max_q, max_k) -> None:
    """The documented argument contract shared by every FlashAttention varlen entry point."""
    assert q.dtype == k.dtype == v.dtype and q.dim() == k.dim() == 3 and k.shape == v.shape
    assert q.shape[1] % k.shape[1] == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == cu_k.device == q.device
    assert len(cu_q) == len(cu_k) and cu_q[0] == cu_k[0] == 0
    assert cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    assert isinstance(max_q, int) and isinstance(max_k, int)
    assert (max_q, max_k) == (int(cu_q.diff().max()), int(cu_k.diff().max()))


def _sequences(q, k, cu_q, cu_k, scale):
    """Per sequence: (q rows, k rows, fp64 scores ``[Hq, qn, kn]`` masked bottom-right causal, GQA group)."""
    group = q.shape[1] // k.shape[1]
    for qs, qe, ks, ke in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        qn, kn = qe - qs, ke - ks
        allowed = torch.arange(kn)[None] <= torch.arange(qn)[:, None] + (kn - qn)
        ki = k[ks:ke].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].double(), ki) * scale
        yield slice(qs, qe), slice(ks, ke), scores.masked_fill(~allowed, float("-inf")), group


def forward(q, k, v, cu_q, cu_k, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out in q's dtype, lse fp32 [Hq, Tq])``."""
    out = torch.empty(q.shape, dtype=torch.float64)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float64)
    for rows, keys, scores, group in _sequences(q, k, cu_q, cu_k, scale):
        lse[:, rows] = scores.logsumexp(-1)
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[keys].double().repeat_interleave(group, 1))
    return out.to(q.dtype), lse.float()


def backward(dout, q, k, v, out, lse, cu_q, cu_k, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` in the inputs' dtypes, from the given ``out`` and ``lse``."""
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk, dv = (torch.zeros(k.shape, dtype=torch.float64) for _ in range(2))
    row_dot = (dout.double() * out.double()).sum(-1).T  # [Hq, Tq]
    heads, head_dim = q.shape[1], q.shape[2]
    for rows, keys, scores, group in _sequences(q, k, cu_q, cu_k, scale):
        p = (scores - lse[:, rows].double()[..., None]).exp()  # [Hq, qn, kn]
        do = dout[rows].double()
        ki, vi = (x[keys].double().repeat_interleave(group, 1) for x in (k, v))
        ds = p * (torch.einsum("qhd,khd->hqk", do, vi) - row_dot[:, rows][..., None])
        dq[rows] = torch.einsum("hqk,khd->qhd", ds, ki) * scale
        per_group = (-1, heads // group, group, head_dim)
        dk[keys] = torch.einsum("hqk,qhd->khd", ds, q[rows].double()).view(per_group).sum(2) * scale
        dv[keys] = torch.einsum("hqk,qhd->khd", p, do).view(per_group).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def cpu_flash_forward(q, k, v, cu_q, cu_k, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` through torch's CPU flash-attention kernel (fp32 statistics, O(T) memory). Its causal
    mask is top-left: a sequence with more keys than queries gets as many dummy queries in front, whose
    rows are dropped, so that its queries sit bottom-right."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
    for rows, keys, group, pad in _rows(q, k, cu_q, cu_k):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *_bhsd(_ahead(q[rows], pad)), *_bhsd(k[keys], v[keys], group=group), 0.0, True, scale=scale)
        out[rows], lse[:, rows] = o[0, :, pad:].transpose(0, 1), l[0, :, pad:]
    return out, lse


def cpu_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward` through torch's CPU flash-attention kernel, as :func:`cpu_flash_forward`; the dummy
    queries' log-sum-exp is +inf: their probabilities are 0, they add nothing."""
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, group, pad in _rows(q, k, cu_q, cu_k):
        parts = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_bhsd(_ahead(dout[rows], pad), _ahead(q[rows], pad)), *_bhsd(k[keys], v[keys], group=group),
            *_bhsd(_ahead(out[rows], pad)), _ahead(lse[:, rows].T, pad, float("inf")).T[None].contiguous(),
            0.0, True, scale=scale)
        dq[rows] = parts[0][0, :, pad:].transpose(0, 1)
        for target, part in zip((dk, dv), parts[1:]):  # summed over the query heads of each key/value head
            target[keys] = part[0].transpose(0, 1).unflatten(1, (k.shape[1], group)).sum(2)
    return dq, dk, dv


def _rows(q, k, cu_q, cu_k):
    """Per sequence: (q rows, k rows, GQA group, keys beyond the queries)."""
    group = q.shape[1] // k.shape[1]
    for qs, qe, ks, ke in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        yield slice(qs, qe), slice(ks, ke), group, (ke - ks) - (qe - qs)


def _ahead(x: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """``x`` after ``rows`` rows of ``value``."""
    return torch.cat([x.new_full((rows, *x.shape[1:]), value), x]) if rows else x


def _bhsd(*xs, group: int = 1):
    """``[n, H, D]`` tensors as the CPU kernel's ``[1, H * group, n, D]``."""
    return [x.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0) for x in xs]


_MATH = {"forward": forward, "backward": backward}


@contextlib.contextmanager
def cpu_flash_math(wrap=lambda function: function):
    """The stand-ins compute through torch's CPU flash-attention kernel instead of densely in fp64: the same
    contract in fp32 with O(T) memory, for benchmarks that count launches at 128K tokens rather than digits.
    ``wrap`` wraps that forward and that backward (a benchmark counts each call as one kernel)."""
    _MATH.update(forward=wrap(cpu_flash_forward), backward=wrap(cpu_flash_backward))
    try:
        yield
    finally:
        _MATH.update(forward=forward, backward=backward)


class Differentiable(torch.autograd.Function):
    """The varlen forward with FlashAttention's backward, for stand-ins whose library owns the autograd."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale):
        out, lse = _MATH["forward"](q, k, v, cu_q, cu_k, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        return (*_MATH["backward"](dout, q, k, v, out, lse, cu_q, cu_k, ctx.scale), None, None, None)


def with_autograd(kernel, scale_of=lambda args, kwargs: kwargs["softmax_scale"]):
    """A stand-in varlen function whose output is differentiable, as the library's own autograd makes it."""
    def call(q, k, v, *args, **kwargs):
        result = kernel(q, k, v, *args, **kwargs)
        if not torch.is_grad_enabled():
            return result
        cu_q, cu_k = (args[0], args[1]) if args else (kwargs["cu_seqlens_q"], kwargs["cu_seqlens_k"])
        out = Differentiable.apply(q, k, v, cu_q, cu_k, scale_of(args, kwargs))
        return (out, *result[1:]) if isinstance(result, tuple) else out
    return call


# --- each library's entry points, with their documented signatures ----------------------------

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, return_attn_probs=False, **unused):
    """flash-attn 2's ``flash_attn_varlen_func``: out, or ``(out, softmax_lse, S_dmask)``."""
    assert dropout_p == 0.0 and causal and not unused
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _MATH["forward"](q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                               softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
    """``torch.ops.flash_attn._flash_attn_varlen_backward``: fills dq, dk, dv; returns softmax_d."""
    assert dropout_p == 0.0 and causal and (window_size_left, window_size_right) == (-1, -1)
    assert softcap == 0.0 and alibi_slopes is None and not zero_tensors
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    for target, grad in zip((dq, dk, dv), _MATH["backward"](dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                                    softmax_scale)):
        assert target.shape == grad.shape and target.dtype == grad.dtype
        target.copy_(grad)
    return torch.zeros_like(softmax_lse)


def fa3_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                    seqused_k=None, softmax_scale=None, causal=False, return_attn_probs=False, **unused):
    """FlashAttention-3's ``flash_attn_interface.flash_attn_varlen_func``: out, or ``(out, softmax_lse)``."""
    assert causal and seqused_q is None and seqused_k is None and not unused
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = _MATH["forward"](q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    return (out, lse) if return_attn_probs else out


def fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None,
                 max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
                 window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    """``torch.ops.flash_attn_3._flash_attn_backward`` (its names, ``sequed_q`` included, and defaults): fills dq,
    dk, dv; returns softmax_d."""
    assert is_causal and sequed_q is None and sequed_k is None and (window_size_left, window_size_right) == (-1, -1)
    return flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, 0.0, softmax_scale, True, -1, -1, softcap, None,
                                      deterministic)


def fa4_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    softmax_scale=None, causal=False, return_lse=False, **unused):
    """FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func``: keyword boundaries, ``(out, lse or None)``."""
    assert causal and not unused
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = _MATH["forward"](q, k, v, cu_seqlens_q, cu_seqlens_k, scale)
    return out, (lse if return_lse else None)


def fa4_backward(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                 window_size_right=None, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, **unused):
    """``flash_attn.cute.interface._flash_attn_bwd``: ``(dq, dk, dv)``."""
    assert causal and softcap == 0.0 and window_size_left is None and window_size_right is None and not unused
    check_contract(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _MATH["backward"](dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale)
