"""The anchor without copying K/V: intra-document attention through a varlen kernel, the anchor merged by log-sum-exp.

A varlen kernel reads each sequence's keys from one contiguous range of k/v. Putting the window's
anchor in front of every later document's keys (:func:`nemo_anchor.attention.layout.varlen_plan`)
therefore gathers a new k and v of ``T + documents`` rows in every layer, kept for the backward: a
full copy of K and V per layer. Here instead:

1. the kernel runs the query blocks *without* their anchors: each document against its own keys,
   consecutive ranges of k/v (``kv_rows`` is a slice: no copy), giving ``out_doc`` and its
   log-sum-exp ``lse_doc`` (after a window whose first document is its BOS alone the keys are not
   consecutive and ``kv_rows`` gathers them: rare, see :class:`~nemo_anchor.attention.layout.VarlenPlan`);
2. the anchor is one key: per query its score ``s = scale * q . k[anchor]``, a number per head;
3. the two are one softmax: ``lse = logaddexp(lse_doc, s)``,
   ``out = out_doc * exp(lse_doc - lse) + v[anchor] * exp(s - lse)``.

The backward runs the kernel's backward on the document part with the *merged* output and
log-sum-exp, which gives the exact gradients of the merged softmax for the document keys (the
identity ring attention and the ``cpu`` backend rely on); the anchor's share is computed here from
its probability ``exp(s - lse)``. Extra work and memory: one key per query (``s``: fp32 ``[Tq, Hq]``,
recomputed in the backward, never saved), in chunks of rows so no ``[Tq, Hq, D]`` fp32 temporary is
made at once.

A :class:`VarlenKernel` is three calls of one library over a
:class:`~nemo_anchor.attention.layout.VarlenPlan`, given the plan's key and value rows
(``k[plan.kv_rows]``, a view): ``forward(q, keys, values, plan, scale) -> (out, lse)`` with ``lse``
fp32 ``[Hq, Tq]`` (FlashAttention's varlen layout), ``backward(dout, q, keys, values, out, lse,
plan, scale) -> (dq, dkeys, dvalues)``, and, for blocks without anchors, the plain call through the
library's own autograd. Every FlashAttention generation has the first two: torch's FlashAttention-2
(``aten._flash_attention_backward``), flash-attn 2, 3 and 4 (the backward their own autograd calls),
so ``torch_varlen``, ``flash``, ``fa3`` and ``fa4`` all merge the anchor here.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import torch

from nemo_anchor.attention.layout import QueryBlock, VarlenPlan, varlen_plan

# rows of queries whose anchor share is computed at once: bounds the fp32 temporaries to
# _CHUNK x Hq x D (32 MiB at 32 heads of 128)
_CHUNK = 2048


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen kernel's three calls over a plan's key rows (see the module docstring): ``attention`` is the
    backend's ``attention(q, k, v, blocks, q_offset, scale)``."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, keys, values, plan, scale) -> (out, lse)
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    differentiable: Callable[..., torch.Tensor]  # (q, keys, values, plan, scale) -> out, its library's autograd

    def attention(self, q, k, v, blocks, q_offset, scale):
        if not has_anchor(blocks):  # every sequence's keys are a range of k/v: a view
            plan = varlen_plan(blocks, q.device)
            return self.differentiable(q, _plan_keys(k, plan), _plan_keys(v, plan), plan, scale)
        plan, runs = split_anchor(blocks, q.device)
        runs = tuple(_Run(r.start - q_offset, r.end - q_offset, r.anchor) for r in runs)
        return _AnchorMerged.apply(q, k, v, self, plan, runs, scale)


@dataclass(frozen=True)
class _Run:
    """Queries ``[start, end)`` (packed positions; rows of q once ``q_offset`` is subtracted) that all see the
    key ``anchor`` besides their document's keys."""

    start: int
    end: int
    anchor: int


@functools.lru_cache(maxsize=64)
def split_anchor(blocks: tuple[QueryBlock, ...], device: torch.device) -> tuple[VarlenPlan, tuple[_Run, ...]]:
    """The varlen plan of the blocks without their anchors, and the runs of query rows that see each anchor."""
    runs: list[_Run] = []
    for block in blocks:
        if block.anchor is None:
            continue
        if runs and runs[-1].anchor == block.anchor and runs[-1].end == block.start:
            runs[-1] = replace(runs[-1], end=block.end)
        else:
            runs.append(_Run(block.start, block.end, block.anchor))
    plain = tuple(replace(b, anchor=None) for b in blocks)
    return varlen_plan(plain, device), tuple(runs)


def _plan_keys(x: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
    """The key (or value) rows the plan's sequences read: a view for a slice; a gather only after a
    BOS-only document (see :class:`~nemo_anchor.attention.layout.VarlenPlan`)."""
    return x[plan.kv_rows]


def _plan_key_grad(grad: torch.Tensor, like: torch.Tensor, plan: VarlenPlan) -> torch.Tensor:
    """The gradient of ``_plan_keys(like, plan)`` as a gradient of ``like``."""
    rows = plan.kv_rows
    if isinstance(rows, slice) and rows == slice(0, like.shape[0]):
        return grad
    full = torch.zeros_like(like)
    if isinstance(rows, slice):
        full[rows] = grad
    else:
        full.index_add_(0, rows, grad)
    return full


def has_anchor(blocks: tuple[QueryBlock, ...]) -> bool:
    return any(b.anchor is not None for b in blocks)


def _anchor_scores(q: torch.Tensor, k_anchor: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 ``[n, Hq]``: ``scale * q . k_anchor`` with query head h reading key/value head ``h // group``."""
    n, heads, d = q.shape
    kv_heads = k_anchor.shape[0]
    grouped = q.view(n, kv_heads, heads // kv_heads, d).float()
    return torch.einsum("nkgd,kd->nkg", grouped, k_anchor.float()).reshape(n, heads) * scale


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[n, Hq, ...]`` as ``[n, Hkv, group, ...]`` (a view)."""
    return x.view(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _chunks(runs: tuple[_Run, ...]):
    for run in runs:
        for start in range(run.start, run.end, _CHUNK):
            yield slice(start, min(run.end, start + _CHUNK)), run.anchor


class _AnchorMerged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel, plan, runs, scale):
        out, lse = kernel.forward(q, _plan_keys(k, plan), _plan_keys(v, plan), plan, scale)  # lse: fp32 [Hq, Tq]
        kv_heads = k.shape[1]
        for rows, anchor in _chunks(runs):
            s = _anchor_scores(q[rows], k[anchor], scale)  # [n, Hq]
            doc_lse = lse[:, rows].T
            merged = torch.maximum(doc_lse, s) + torch.log1p(torch.exp(-(doc_lse - s).abs()))
            keep, take = (doc_lse - merged).exp(), (s - merged).exp()  # [n, Hq]
            mixed = (_grouped(out[rows].float() * keep[..., None], kv_heads)
                     + _grouped(take[..., None], kv_heads) * v[anchor].float()[None, :, None, :])
            out[rows] = mixed.view(out[rows].shape).to(out.dtype)
            lse[:, rows] = merged.T
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.plan, ctx.runs, ctx.scale = kernel, plan, runs, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        plan = ctx.plan
        dq, dk, dv = ctx.kernel.backward(grad_out, q, _plan_keys(k, plan), _plan_keys(v, plan), out, lse, plan,
                                         ctx.scale)
        dk, dv = _plan_key_grad(dk, k, plan), _plan_key_grad(dv, v, plan)
        kv_heads, scale = k.shape[1], ctx.scale
        anchor_dk: dict[int, torch.Tensor] = {}
        anchor_dv: dict[int, torch.Tensor] = {}
        for rows, anchor in _chunks(ctx.runs):
            k_a, v_a = k[anchor].float(), v[anchor].float()  # [Hkv, D]
            p = (_anchor_scores(q[rows], k[anchor], scale) - lse[:, rows].T).exp()  # the anchor's probability
            do = grad_out[rows].float()
            row_dot = (do * out[rows].float()).sum(-1)  # FlashAttention's D_i = dO . O
            dp = torch.einsum("nkgd,kd->nkg", _grouped(do, kv_heads), v_a).reshape(p.shape)
            ds = p * (dp - row_dot)  # [n, Hq]
            dq_a = _grouped(ds[..., None] * scale, kv_heads) * k_a[None, :, None, :]
            dq[rows] += dq_a.view(dq[rows].shape).to(dq.dtype)
            dk_a = torch.einsum("nkg,nkgd->kd", _grouped(ds, kv_heads), _grouped(q[rows].float(), kv_heads)) * scale
            dv_a = torch.einsum("nkg,nkgd->kd", _grouped(p, kv_heads), _grouped(do, kv_heads))
            anchor_dk[anchor] = anchor_dk.get(anchor, 0) + dk_a
            anchor_dv[anchor] = anchor_dv.get(anchor, 0) + dv_a
        for anchor, grad in anchor_dk.items():  # summed in fp32 first: one rounding per anchor row
            dk[anchor] = (dk[anchor].float() + grad).to(dk.dtype)
            dv[anchor] = (dv[anchor].float() + anchor_dv[anchor]).to(dv.dtype)
        return dq, dk, dv, None, None, None, None
