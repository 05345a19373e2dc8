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
identity ring attention and the ``cpu`` backend rely on); the anchor's share is computed from its
probability ``exp(s - lse)``. Both merges are :mod:`nemo_anchor.attention.anchor_key`'s: on CUDA one
Triton launch forward and two backward per layer, whatever the length, the score ``s`` recomputed in
the backward, never saved. What they read besides the tensors (:class:`~nemo_anchor.attention.anchor_key.AnchorPlan`)
is built once per micro-batch and cached, like the varlen plan.

``NEMO_ANCHOR_ANCHOR_PATH=kv_copy`` (:func:`anchor_path`; default ``merge``) runs the previous path
instead, to compare the two in one session: the anchor gathered in front of every later document's
keys (:func:`~nemo_anchor.attention.layout.varlen_plan` with anchors), a K/V copy per layer through
the library's own autograd.

A :class:`VarlenKernel` is three calls of one library over a
:class:`~nemo_anchor.attention.layout.VarlenPlan`, given the plan's key and value rows
(``k[plan.kv_rows]``, a view): ``forward(q, keys, values, plan, scale) -> (out, lse)`` with ``lse``
fp32 ``[Hq, Tq]`` (FlashAttention's varlen layout), ``backward(dout, q, keys, values, out, lse,
plan, scale) -> (dq, dkeys, dvalues)``, and the plain call through the library's own autograd (blocks
without anchors, and the ``kv_copy`` path). Every FlashAttention generation has the first two: torch's FlashAttention-2
(``aten._flash_attention_backward``), flash-attn 2, 3 and 4 (the backward their own autograd calls),
so ``torch_varlen``, ``flash``, ``fa3`` and ``fa4`` all merge the anchor here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from nemo_anchor.attention.anchor_key import anchor_plan, merge_anchor, merge_anchor_backward
from nemo_anchor.attention.layout import QueryBlock, VarlenPlan, varlen_plan

ANCHOR_PATH_VARIABLE = "NEMO_ANCHOR_ANCHOR_PATH"
ANCHOR_PATHS = ("merge", "kv_copy")


def anchor_path() -> str:
    """How the varlen backends attend to the window anchor: ``$NEMO_ANCHOR_ANCHOR_PATH``, default ``merge``.

    Raises:
        ValueError: the variable holds another value (one line naming it and the value).
    """
    path = os.environ.get(ANCHOR_PATH_VARIABLE, "merge")
    if path not in ANCHOR_PATHS:
        raise ValueError(f"{ANCHOR_PATH_VARIABLE}={path!r} is not one of {', '.join(ANCHOR_PATHS)}")
    return path


@dataclass(frozen=True)
class VarlenKernel:
    """A varlen kernel's three calls over a plan's key rows (see the module docstring): ``attention`` is the
    backend's ``attention(q, k, v, blocks, q_offset, scale, deterministic)``."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, keys, values, plan, scale) -> (out, lse)
    # (dout, q, keys, values, out, lse, plan, scale, deterministic) -> (dq, dkeys, dvalues)
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    differentiable: Callable[..., torch.Tensor]  # (q, keys, values, plan, scale) -> out, its library's autograd

    def attention(self, q, k, v, blocks, q_offset, scale, deterministic=False):
        """``deterministic`` (Megatron's ``deterministic_mode``): every backward runs through :attr:`backward` with
        the library's own deterministic flag, blocks without anchors too (a library's public autograd may not
        take one); the anchor merge is deterministic either way (no atomics)."""
        if anchor_path() == "kv_copy" or not has_anchor(blocks):
            # without anchors every sequence's keys are a range of k/v (a view); with them, a gathered copy
            plan = varlen_plan(blocks, q.device)
            if deterministic:
                return _Merged.apply(q, k, v, self, plan, None, scale, True)
            return self.differentiable(q, _plan_keys(k, plan), _plan_keys(v, plan), plan, scale)
        plan = anchor_plan(blocks, q_offset, q.device)
        return _Merged.apply(q, k, v, self, plan.documents, plan, scale, deterministic)


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


class _Merged(torch.autograd.Function):
    """The kernel's forward and backward over ``documents``, and the anchor merged where ``anchors`` (an
    :class:`~nemo_anchor.attention.anchor_key.AnchorPlan`) is given."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, documents, anchors, scale, deterministic):
        out, lse = kernel.forward(q, _plan_keys(k, documents), _plan_keys(v, documents), documents, scale)
        if anchors is not None:
            merge_anchor(out, lse, q, k, v, anchors, scale)  # lse: fp32 [Hq, Tq]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.documents, ctx.anchors, ctx.scale = kernel, documents, anchors, scale
        ctx.deterministic = deterministic
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        documents = ctx.documents
        dq, dk, dv = ctx.kernel.backward(grad_out, q, _plan_keys(k, documents), _plan_keys(v, documents), out, lse,
                                         documents, ctx.scale, ctx.deterministic)
        dk, dv = _plan_key_grad(dk, k, documents), _plan_key_grad(dv, v, documents)
        if ctx.anchors is not None:
            merge_anchor_backward(dq, dk, dv, grad_out, q, k, v, out, lse, ctx.anchors, ctx.scale)
        return dq, dk, dv, None, None, None, None, None
