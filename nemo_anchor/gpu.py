"""The one place where the optional GPU kernels (flash-attn 2/3/4, Transformer Engine, torch's varlen, apex) are imported.

Imports are lazy and cached. They are guarded with ``except Exception`` rather than
``ImportError``: a CPU-only transformer-engine raises RuntimeError at import time, and a
flash-attn built without CUDA fails on its missing extension module. Each accessor returns
``(object, None)`` when usable and ``(None, reason)`` otherwise, so callers can say why.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from types import ModuleType
from typing import Any, Callable

import torch


@functools.cache
def _import(module_name: str) -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(module_name), None
    except Exception as error:  # noqa: BLE001 - see the module docstring
        return None, f"`import {module_name}` failed: {type(error).__name__}: {error}"


def _parameters(kernel: Callable[..., Any]) -> dict[str, bool] | None:
    """``{name: can be passed by keyword}`` of a function or a torch op (read from its schema, which
    ``inspect.signature`` cannot read), ``{"**": True}`` for a function taking ``**kwargs``; None if unreadable."""
    schema = getattr(getattr(kernel, "default", None), "_schema", None)  # torch.ops.<namespace>.<op>
    if schema is not None:
        return {argument.name: True for argument in schema.arguments}
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {"**": True}
    return {name: p.kind is not inspect.Parameter.POSITIONAL_ONLY for name, p in parameters.items()}


@functools.cache
def _accepting(kernel: Callable[..., Any], name: str, keywords: tuple[str, ...]) -> tuple[Callable[..., Any] | None, str | None]:
    """``(kernel, None)`` when ``kernel`` (a function or a torch op) takes every keyword argument in ``keywords``
    (or any, through ``**kwargs``; or its signature cannot be read), else None and which ones it lacks: the
    release installed calls them otherwise, and calling it would raise TypeError mid-run, or, by position, pass
    one argument for another."""
    parameters = _parameters(kernel)
    if parameters is None or "**" in parameters:
        return kernel, None
    missing = [k for k in keywords if not parameters.get(k, False)]
    if missing:
        return None, f"{name} takes no {', '.join(missing)} (a release with other keyword names than nemo-anchor calls)"
    return kernel, None


def takes_keyword(kernel: Callable[..., Any], keyword: str) -> bool:
    """Whether ``kernel`` takes ``keyword`` (an optional argument some releases lack, e.g. ``deterministic``)."""
    return _accepting(kernel, "", (keyword,))[1] is None


# the keyword arguments our backends pass each kernel (nemo_anchor.attention.flash, fa3, fa4)
_VARLEN_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal")
FLASH_ATTN_2_KEYWORDS = (*_VARLEN_KEYWORDS, "dropout_p", "return_attn_probs")
FLASH_ATTN_3_KEYWORDS = ("softmax_scale", "causal", "return_attn_probs")
FLASH_ATTN_4_KEYWORDS = (*_VARLEN_KEYWORDS, "return_lse")
FLASH_ATTN_4_BACKWARD_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
# the backward ops are called by keyword, every argument we pass checked against the op's schema
_BACKWARD_KEYWORDS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k",
                      "max_seqlen_q", "max_seqlen_k", "softmax_scale", "window_size_left", "window_size_right",
                      "softcap", "deterministic")
FLASH_ATTN_2_BACKWARD_KEYWORDS = (*_BACKWARD_KEYWORDS, "dropout_p", "causal", "alibi_slopes", "rng_state")
FLASH_ATTN_3_BACKWARD_KEYWORDS = (*_BACKWARD_KEYWORDS, "is_causal", "sm_margin")


def flash_attn_varlen_func() -> tuple[Callable[..., Any] | None, str | None]:
    """``flash_attn.flash_attn_varlen_func`` (flash-attn 2), or None and why it is unavailable."""
    module, reason = _import("flash_attn")
    if module is None:
        return None, reason
    kernel = getattr(module, "flash_attn_varlen_func", None)  # flash-attn 4 ships only flash_attn.cute
    if kernel is None:
        return None, "flash_attn has no flash_attn_varlen_func (not flash-attn 2)"
    return _accepting(kernel, "flash_attn.flash_attn_varlen_func", FLASH_ATTN_2_KEYWORDS)


def transformer_engine_pytorch() -> tuple[ModuleType | None, str | None]:
    """The ``transformer_engine.pytorch`` module, or None and why it is unavailable."""
    return _import("transformer_engine.pytorch")


def torch_varlen_attn() -> tuple[Callable[..., Any] | None, str | None]:
    """``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA only), or None and why it is unavailable."""
    module, reason = _import("torch.nn.attention.varlen")
    if module is None:
        return None, reason
    kernel = getattr(module, "varlen_attn", None)
    return (kernel, None) if kernel is not None else (None, "torch.nn.attention.varlen has no varlen_attn")


def anchor_key_triton() -> tuple[ModuleType | None, str | None]:
    """Our Triton kernels that merge the window anchor (:mod:`nemo_anchor.attention.anchor_key_triton`; they
    need ``triton``, which every CUDA torch wheel brings, in the range of nemo-anchor's ``[gpu]`` extra), or None
    and why they are unavailable (:func:`nemo_anchor.attention.anchor_key.merge_path` says it)."""
    return _import("nemo_anchor.attention.anchor_key_triton")


def torch_flash_attention_ops() -> tuple[tuple[Callable[..., Any], Callable[..., Any]] | None, str | None]:
    """``(torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward)``, or None and why not.

    The FlashAttention-2 varlen forward (returning the log-sum-exp) and backward (taking the output
    and log-sum-exp to differentiate) that torch's own ``varlen_attn`` calls
    (torch/nn/attention/varlen.py, ``_varlen_attn`` and ``_varlen_attn_backward``); the backward
    accepts a merged log-sum-exp, which ``varlen_attn``'s autograd does not pass through.
    """
    aten = torch.ops.aten  # registered on every build; their kernels are CUDA only
    if not (hasattr(aten, "_flash_attention_forward") and hasattr(aten, "_flash_attention_backward")):
        return None, "this torch has no aten._flash_attention_forward/_backward"
    return (aten._flash_attention_forward, aten._flash_attention_backward), None


def flash_attn_varlen_backward() -> tuple[Callable[..., Any] | None, str | None]:
    """flash-attn 2's varlen backward that takes the output and log-sum-exp to differentiate, or None and why not.

    ``torch.ops.flash_attn._flash_attn_varlen_backward``, the op ``flash_attn_varlen_func``'s own
    autograd calls, registered with torch's dispatcher since flash-attn 2.7 (schema: dout, q, k, v,
    out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
    deterministic, rng_state; it fills dq, dk, dv). The anchor merge hands it the merged
    log-sum-exp, which the public autograd cannot pass through.
    """
    _, reason = flash_attn_varlen_func()
    if reason is not None:
        return None, reason
    if not hasattr(torch.ops.flash_attn, "_flash_attn_varlen_backward"):
        return None, "this flash-attn (< 2.7) registers no torch.ops.flash_attn._flash_attn_varlen_backward"
    return _accepting(torch.ops.flash_attn._flash_attn_varlen_backward,
                      "torch.ops.flash_attn._flash_attn_varlen_backward", FLASH_ATTN_2_BACKWARD_KEYWORDS)


def flash_attn_3_varlen_func() -> tuple[Callable[..., Any] | None, str | None]:
    """FlashAttention-3's ``flash_attn_interface.flash_attn_varlen_func`` (Hopper), or None and why it is unavailable."""
    module, reason = _import("flash_attn_interface")
    if module is None:
        return None, reason
    kernel = getattr(module, "flash_attn_varlen_func", None)
    if kernel is None:
        return None, "flash_attn_interface has no flash_attn_varlen_func"
    return _accepting(kernel, "flash_attn_interface.flash_attn_varlen_func", FLASH_ATTN_3_KEYWORDS)


def flash_attn_4_varlen_func() -> tuple[Callable[..., Any] | None, str | None]:
    """FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func`` (CuTe DSL; Hopper, Blackwell), or None and why."""
    module, reason = _import("flash_attn.cute")
    if module is None:
        return None, reason
    kernel = getattr(module, "flash_attn_varlen_func", None)
    if kernel is None:
        return None, "flash_attn.cute has no flash_attn_varlen_func"
    return _accepting(kernel, "flash_attn.cute.flash_attn_varlen_func", FLASH_ATTN_4_KEYWORDS)


def flash_attn_3_backward() -> tuple[Callable[..., Any] | None, str | None]:
    """FlashAttention-3's backward that takes the output and log-sum-exp to differentiate, or None and why not.

    ``torch.ops.flash_attn_3._flash_attn_backward``, the op its ``flash_attn_varlen_func``
    autograd calls, registered with torch's dispatcher since August 2025 (schema: dout, q, k, v,
    out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
    max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right,
    softcap, deterministic, sm_margin; it fills dq, dk, dv).
    """
    _, reason = flash_attn_3_varlen_func()
    if reason is not None:
        return None, reason
    if not hasattr(torch.ops.flash_attn_3, "_flash_attn_backward"):
        return None, "this FlashAttention-3 (before August 2025) registers no torch.ops.flash_attn_3._flash_attn_backward"
    return _accepting(torch.ops.flash_attn_3._flash_attn_backward, "torch.ops.flash_attn_3._flash_attn_backward",
                      FLASH_ATTN_3_BACKWARD_KEYWORDS)


def flash_attn_4_backward() -> tuple[Callable[..., Any] | None, str | None]:
    """FlashAttention-4's backward that takes the output and log-sum-exp to differentiate, or None and why not.

    ``flash_attn.cute.interface._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, ...,
    cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=) -> (dq, dk, dv)``, the function its
    ``flash_attn_varlen_func`` autograd calls. FlashAttention-4 registers no dispatcher op, and its
    public ``return_lse`` gradient would need the merged output as a second tensor per layer.
    """
    module, reason = _import("flash_attn.cute.interface")
    if module is None:
        return None, reason
    backward = getattr(module, "_flash_attn_bwd", None)
    if backward is None:
        return None, "flash_attn.cute.interface has no _flash_attn_bwd"
    return _accepting(backward, "flash_attn.cute.interface._flash_attn_bwd", FLASH_ATTN_4_BACKWARD_KEYWORDS)


def apex_gradient_accumulation() -> tuple[ModuleType | None, str | None]:
    """apex's ``fused_weight_gradient_mlp_cuda`` extension, or None and why it is unavailable.

    Megatron's own linear layers (the output layer, whatever the layer spec) refuse
    ``gradient_accumulation_fusion`` without it; NGC's PyTorch and NeMo containers ship it.
    """
    return _import("fused_weight_gradient_mlp_cuda")

