"""The one place where the optional GPU kernels (flash-attn, Transformer Engine, torch's varlen) are imported.

Imports are lazy and cached. They are guarded with ``except Exception`` rather than
``ImportError``: a CPU-only transformer-engine raises RuntimeError at import time, and a
flash-attn built without CUDA fails on its missing extension module. Each accessor returns
``(object, None)`` when usable and ``(None, reason)`` otherwise, so callers can say why.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Callable


@functools.cache
def _import(module_name: str) -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(module_name), None
    except Exception as error:  # noqa: BLE001 - see the module docstring
        return None, f"`import {module_name}` failed: {type(error).__name__}: {error}"


def flash_attn_varlen_func() -> tuple[Callable[..., Any] | None, str | None]:
    """``flash_attn.flash_attn_varlen_func`` (flash-attn 2), or None and why it is unavailable."""
    module, reason = _import("flash_attn")
    if module is None:
        return None, reason
    kernel = getattr(module, "flash_attn_varlen_func", None)  # flash-attn 4 ships only flash_attn.cute
    return (kernel, None) if kernel is not None else (None, "flash_attn has no flash_attn_varlen_func (not flash-attn 2)")


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
