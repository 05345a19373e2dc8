"""torch's own FlashAttention-2 varlen kernel: the whole packed sequence in one ``varlen_attn`` call.

``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA only) needs no extra package.
The sequences are those of the flash-attn backend (:class:`nemo_anchor.attention.layout.VarlenPlan`,
built once per layout and cached, so every layer of a step reuses it): one per query block,
its keys/values the window anchor's (where the block has one) followed by the block's own.
``window_size=(-1, 0)`` is causal with the mask aligned to the bottom right when a sequence
has more keys than queries, so each query sees the anchor and its own causal prefix.

Without anchors (``full``, ``intra_doc``) each sequence's keys are a range of k/v and the call
copies nothing. With anchors, gathering the anchor into every later document's keys would copy
K and V in every layer; instead the documents run alone through the FlashAttention-2 ops that
``varlen_attn`` itself calls (``aten._flash_attention_forward``/``_backward``, whose backward takes
the merged log-sum-exp, which ``varlen_attn``'s autograd drops) and the anchor is merged through
the log-sum-exp (:mod:`nemo_anchor.attention.anchor_merge`): one extra key per query, no copy.

The keyword arguments changed between torch releases (``is_causal`` before ``window_size``,
``scale`` and ``enable_gqa`` added later); :func:`kernel_arguments` adapts the call to the
installed signature. Grouped-query heads are never expanded: FlashAttention-2 reads key/value
head ``h // (Hq // Hkv)`` for query head ``h`` natively, ``enable_gqa`` only lifts the wrapper's
head-count check where it has one. ``deterministic`` turns ``torch.use_deterministic_algorithms`` on for the
backward call alone, the switch ``aten._flash_attention_backward`` reads instead of a flag.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

import torch

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_merge, requirements



def unavailable_reason(q: torch.Tensor, needs_grad: bool) -> str | None:
    return (gpu.torch_varlen_attn()[1]
            or requirements.cuda_reason("torch's varlen_attn (FlashAttention-2)", q, max_head_dim=256,
                                        min_capability=(8, 0))  # Ampere or newer
            or gpu.torch_flash_attention_ops()[1])


@functools.cache
def _parameters(kernel: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def kernel_arguments(kernel: Callable[..., Any], scale: float, head_dim: int, grouped: bool) -> tuple[dict, float]:
    """Keyword arguments of a causal call to this torch's ``varlen_attn``, and a factor for q.

    The factor is 1.0 where the kernel takes ``scale``; where it does not (torch 2.10), the kernel
    scales by ``head_dim ** -0.5`` and q is multiplied by the factor to get ``scale``.

    Raises:
        RuntimeError: the kernel takes neither ``window_size`` nor ``is_causal``.
    """
    parameters = _parameters(kernel)
    if "window_size" in parameters:
        keywords: dict = {"window_size": (-1, 0)}  # a tuple: the wrapper compares it with (-1, 0)
    elif "is_causal" in parameters:
        keywords = {"is_causal": True}
    else:
        raise RuntimeError(f"torch's varlen_attn{inspect.signature(kernel)} takes neither window_size nor is_causal")
    factor = 1.0
    if "scale" in parameters:
        keywords["scale"] = scale
    else:
        factor = scale * head_dim**0.5
    if grouped and "enable_gqa" in parameters:
        keywords["enable_gqa"] = True
    return keywords, factor


def _documents_forward(q, keys, values, plan, scale):
    forward, _ = gpu.torch_flash_attention_ops()[0]
    out, lse, *_ = forward(q, keys, values, plan.cu_seqlens_q, plan.cu_seqlens_k,
                           plan.max_seqlen_q, plan.max_seqlen_k, 0.0, True, False, scale=scale)
    return out, lse


@contextlib.contextmanager
def _deterministic_algorithms(deterministic: bool):
    """``aten._flash_attention_backward`` takes no flag: it runs FlashAttention's deterministic backward where
    ``torch.use_deterministic_algorithms(True)`` (not warn_only) is on when it is called; on for that call only."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if not deterministic or (enabled and not warn_only):
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _documents_backward(dout, q, keys, values, out, lse, plan, scale, deterministic=False):
    _, backward = gpu.torch_flash_attention_ops()[0]
    # no dropout: the random state is unused, passed as torch's varlen_attn passes it
    rng_state, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
    with _deterministic_algorithms(deterministic):
        return backward(dout, q, keys, values, out, lse, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                        plan.max_seqlen_k, 0.0, True, rng_state, unused, scale=scale)


def _documents(q, keys, values, plan, scale):
    kernel, _ = gpu.torch_varlen_attn()
    keywords, factor = kernel_arguments(kernel, scale, q.shape[-1], q.shape[1] != keys.shape[1])
    if factor != 1.0:
        q = q * factor
    return kernel(q, keys, values, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
                  **keywords)


attention = anchor_merge.VarlenKernel(_documents_forward, _documents_backward, _documents).attention
