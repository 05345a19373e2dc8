"""``anchor_attention``: the functional API over the attention backends."""
from __future__ import annotations

import importlib
import logging
import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from nemo_anchor.attention.layout import MODES, PackLayout, pack_layout

# each backend is the module nemo_anchor.attention.<name>, imported on first use, with
# `unavailable_reason(q, needs_grad) -> str | None` and `attention(q, k, v, blocks, q_offset, scale)`
BACKENDS = ("auto", "reference", "cpu", "flex", "torch_varlen", "flash", "fa3", "fa4", "te")
# "auto" takes the first that can run. On Hopper (compute capability 9.x) the Hopper kernels come
# first: FlashAttention-3 (fastest in MagiAttention's published H100 document-mask figures: about
# 585 TFLOP/s, cuDNN 492, FlashAttention-2 345), cuDNN's fused attention through Transformer Engine,
# FlashAttention-4; on Blackwell (10.x) FlashAttention-4, written for it, then cuDNN; before them
# (Ampere) and after them the FlashAttention-2 kernels, torch's own first (it needs no package).
# Then ours on the CPU, FlexAttention (any device; CUDA in fp32), and the oracle. Each backend
# refuses what it cannot run (device, dtype, head_dim, compute capability), so one order serves all.
_AUTO_ORDER = {
    9: ("fa3", "te", "fa4", "torch_varlen", "flash"),
    10: ("fa4", "te", "torch_varlen", "flash"),
}
_FA2_ORDER = ("torch_varlen", "flash", "te")
_ANYWHERE = ("cpu", "flex", "reference")
# backends that cannot attend to the window anchor without copying K and V in every layer: refused
# in ``anchor`` mode, and skipped there by ``auto``. Every other GPU kernel merges the anchor through
# the log-sum-exp (:mod:`nemo_anchor.attention.anchor_merge`), one extra key per query.
NO_ANCHOR = frozenset({"te"})
# the kernel each backend runs: a comparison of attention types is like for like on one family only
KERNEL_FAMILIES = {
    "fa3": "FlashAttention-3", "fa4": "FlashAttention-4", "flash": "FlashAttention-2", "torch_varlen": "FlashAttention-2",
    "te": "cuDNN fused attention", "cpu": "torch's CPU flash attention", "flex": "FlexAttention", "reference": "dense reference",
}
# backends whose anchor is merged by nemo_anchor.attention.anchor_key (Triton, or its torch fallback)
MERGES_ANCHOR = frozenset({"torch_varlen", "flash", "fa3", "fa4"})
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ChosenBackend:
    """A backend chosen once for one kind of call (:func:`choose_backend`) and reused: pass it as
    ``anchor_attention(backend=...)`` and no call chooses again. ``skipped``: why ``auto`` passed over each
    backend before it; ``requested``: the name asked for (``auto`` or this one)."""

    name: str
    attention: Callable[..., torch.Tensor] = field(repr=False)
    requested: str
    skipped: dict[str, str]


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run for these inputs on this machine."""


def anchor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_windows: torch.Tensor | None = None,
    layout: PackLayout | None = None,
    mode: str = "anchor",
    backend: str | ChosenBackend = "auto",
    softmax_scale: float | None = None,
    q_offset: int = 0,
    deterministic: bool = False,
) -> torch.Tensor:
    """Causal attention over packed windows of documents: full, intra-document, or AnchorAttention.

    Arguments:
        q: ``(Tq, Hq, D)`` queries, packed THD. Tq == T except with ``q_offset`` (below).
        k, v: ``(T, Hkv, D)``, with ``Hq % Hkv == 0``: grouped-query heads, not expanded
            (query head h uses key/value head ``h // (Hq // Hkv)``).
            q, k, v share one dtype (float32, bfloat16; float16 where the backend allows) and one device.
        cu_seqlens: ``(num_docs + 1,)`` integer tensor (int32 by convention), the document
            boundaries ``[0, ..., T]``, strictly increasing.
        cu_windows: ``(num_windows + 1,)`` integer tensor, the window boundaries, each also in
            ``cu_seqlens``. None means one window ``[0, T]``. The *anchor* of a window is its
            first token (BOS, position id 0).
        layout: instead of ``cu_seqlens``/``cu_windows``, the pack's :class:`~nemo_anchor.attention.layout.PackLayout`
            (``pack_layout(cu_seqlens, cu_windows)``), read once and shared by every layer.
        mode: which keys the query at packed position p sees (causal, key position <= p):
            ``"full"``: every key of its window;
            ``"intra_doc"``: the keys of its document (with reset position ids this is the
            usual intra-document attention; positions are the model's business);
            ``"anchor"``: the keys of its document plus its window's anchor. The first document of
            a window contains the anchor already; documents never see each other otherwise.
        backend:
            ``"reference"``: dense mask, fp32 softmax, any device; O(Tq * T) memory: the test oracle.
            ``"cpu"``: torch's CPU flash kernel per document, the anchor merged through the
            log-sum-exp; O(T * H * D) memory. CPU tensors.
            ``"flex"``: compiled FlexAttention with a block mask built once per layout; forward and
            backward on CUDA. On the CPU torch has no FlexAttention backward: forward only.
            ``"torch_varlen"``: torch's FlashAttention-2 varlen kernel (torch >= 2.10; CUDA, fp16/bf16).
            ``"flash"``: flash-attn 2's ``flash_attn_varlen_func`` (>= 2.7; CUDA, fp16/bf16).
            ``"fa3"``: FlashAttention-3's ``flash_attn_interface.flash_attn_varlen_func`` (Hopper).
            ``"fa4"``: FlashAttention-4's ``flash_attn.cute.flash_attn_varlen_func`` (Hopper, Blackwell).
            These four make one kernel call per layer; with anchors the documents run alone and the
            anchor is merged through the log-sum-exp: one extra key per query, no K/V copy.
            ``"te"``: Transformer Engine ``DotProductAttention`` (cuDNN fused attention), THD,
            bottom-right causal (CUDA); ``full`` and ``intra_doc`` only (see ``NO_ANCHOR``).
            ``"auto"``: the first that can run these inputs: on Hopper fa3, te, fa4, torch_varlen,
            flash; on Blackwell fa4, te, torch_varlen, flash; on Ampere torch_varlen, flash, te
            (te skipped in ``anchor`` mode); then cpu, flex, reference (a GPU in fp32: flex; the CPU: cpu).
            Or a :class:`ChosenBackend` (:func:`choose_backend`), chosen once for calls like this one: a model
            layer chooses at its first forward, and no later call repeats the availability checks.
        softmax_scale: scale of ``q @ k^T``; default ``D ** -0.5``. Softmax statistics are fp32
            whatever the input dtype.
        q_offset: the rows of q are the tokens at packed positions ``[q_offset, q_offset + Tq)``
            of the sequence described by ``cu_seqlens``/``cu_windows`` over k/v's length T (used
            by context parallelism); row i of the output is the token at ``q_offset + i``.
        deterministic: the backward gives the same bits every run (Megatron's ``deterministic_mode``): each
            FlashAttention backward gets its deterministic flag (torch's: ``torch.use_deterministic_algorithms``
            for that call), and ``auto`` skips what has none here (FlashAttention-4 before SM100, Transformer
            Engine without ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``). The anchor merge has no atomics either way.
            With ``NEMO_ANCHOR_ANCHOR_PATH=kv_copy`` the anchors' gathered key gradients are summed by
            ``index_add_``, deterministic on CUDA only under ``torch.use_deterministic_algorithms``.

    Returns:
        ``(Tq, Hq, D)`` in the input dtype; differentiable in q, k and v (flex: not on the CPU).

    Tensor boundaries are read on the host (one device sync per call); a ``layout`` is read once,
    when it is built, so layers that share it never sync. What a backend derives from the layout
    (block lists, varlen cu_seqlens, FlexAttention block masks) is cached per layout, so the
    layers of one step share it.

    Raises:
        ValueError: malformed input (shapes, dtypes, devices, boundaries, mode, backend name),
            naming the offending argument and value.
        BackendUnavailableError: an explicitly requested backend cannot run here (or, ``te``, not in
            ``anchor`` mode); says why.
    """
    _check_tensors(q, k, v, q_offset)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if not isinstance(backend, ChosenBackend) and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if layout is None:
        if cu_seqlens is None:
            raise ValueError("pass the document boundaries: cu_seqlens (and cu_windows) or layout")
        layout = pack_layout(cu_seqlens, cu_windows, k.shape[0])
    elif cu_seqlens is not None or cu_windows is not None:
        raise ValueError("pass either cu_seqlens/cu_windows or layout, not both")
    elif layout.total != k.shape[0]:
        raise ValueError(f"the layout covers T={layout.total} tokens, but k and v hold {k.shape[0]}")
    blocks = layout.blocks(mode, q_offset, q.shape[0])
    if not isinstance(backend, ChosenBackend):
        backend = choose_backend(backend, q, needs_grad(q, k, v), mode, deterministic)
    return backend.attention(q, k, v, blocks, q_offset, float(softmax_scale), deterministic=deterministic)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` here will be differentiated (what the backends' checks ask)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a 3-D tensor [tokens, heads, head_dim], got {shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads Hq={q.shape[1]} must be a multiple of key/value heads Hkv={k.shape[1]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"q, k, v must share one dtype among {_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, int):
        raise ValueError(f"q_offset must be an int, got {q_offset!r}")
    if q.shape[0] == 0 or q_offset < 0 or q_offset + q.shape[0] > k.shape[0]:
        raise ValueError(
            f"the query rows [q_offset, q_offset + Tq) = [{q_offset}, {q_offset + q.shape[0]}) must be a "
            f"non-empty part of the T={k.shape[0]} key positions"
        )


def auto_order(q: torch.Tensor) -> tuple[str, ...]:
    """The backends ``auto`` tries for ``q``, in order (see ``_AUTO_ORDER``)."""
    gpu_order = _FA2_ORDER
    if q.is_cuda:
        gpu_order = _AUTO_ORDER.get(torch.cuda.get_device_capability(q.device)[0], _FA2_ORDER)
    return gpu_order + _ANYWHERE


def select_backend(backend: str, q: torch.Tensor, needs_grad: bool, mode: str, deterministic: bool = False):
    """The backend module that runs ``mode`` for ``q`` (``auto``: the first in :func:`auto_order` that can).

    Raises:
        BackendUnavailableError: an explicitly named backend cannot; says why.
    """
    return _backend_module(backend_choice(backend, q, needs_grad, mode, deterministic)[0])


def choose_backend(backend: str, q: torch.Tensor, needs_grad: bool, mode: str,
                   deterministic: bool = False) -> ChosenBackend:
    """:func:`backend_choice` as a :class:`ChosenBackend`, to reuse for every call of that kind (same device,
    dtype, head_dim, gradient need, mode and determinism).

    Raises:
        BackendUnavailableError: an explicitly named backend cannot run; says why.
    """
    name, skipped = backend_choice(backend, q, needs_grad, mode, deterministic)
    return ChosenBackend(name, _backend_module(name).attention, backend, skipped)


def backend_choice(backend: str, q: torch.Tensor, needs_grad: bool, mode: str,
                   deterministic: bool = False) -> tuple[str, dict[str, str]]:
    """The name of the backend that runs ``mode`` for ``q``, and why ``auto`` passed over each backend
    before it (``{name: reason}``; empty for a named backend).

    Raises:
        BackendUnavailableError: an explicitly named backend cannot run; says why.
    """
    if backend != "auto":
        reason = unavailable_reason(backend, q, needs_grad, mode, deterministic)
        if reason is not None:
            raise BackendUnavailableError(f"backend {backend!r} cannot run here: {reason}")
        return backend, {}
    skipped = {}
    for name in auto_order(q):  # the reference runs everywhere: there always is one
        reason = unavailable_reason(name, q, needs_grad, mode, deterministic)
        if reason is None:
            return name, skipped
        skipped[name] = reason
    raise AssertionError("the reference backend runs everywhere")


def kernel_family(backend: str) -> str:
    """The kernel ``backend`` runs (``torch_varlen`` and ``flash`` are both FlashAttention-2)."""
    return KERNEL_FAMILIES[backend]


def common_backend(q: torch.Tensor, needs_grad: bool, modes=("anchor", "full")) -> str:
    """The first backend in ``auto``'s order that runs every mode of ``modes`` for ``q``: the
    ``attention_backend`` to give each run of a like-for-like comparison of those attention types."""
    return next(name for name in auto_order(q) if all(unavailable_reason(name, q, needs_grad, m) is None for m in modes))


def anchor_handling(name: str, mode: str, device: torch.device) -> str | None:
    """How backend ``name`` attends to the window anchor on ``device`` in ``mode``: the merge's path (Triton, or
    the torch fallback and why: :func:`nemo_anchor.attention.anchor_key.merge_path`), the K/V copy of
    ``NEMO_ANCHOR_ANCHOR_PATH=kv_copy``; None where no anchor is merged."""
    if mode != "anchor" or name not in MERGES_ANCHOR:
        return None
    from nemo_anchor.attention.anchor_key import merge_path
    from nemo_anchor.attention.anchor_merge import ANCHOR_PATH_VARIABLE, anchor_path

    if anchor_path() == "kv_copy":
        return f"anchor copied into every document's keys ({ANCHOR_PATH_VARIABLE}=kv_copy)"
    return f"anchor merge: {merge_path(device)[1]}"


def log_backend_choice(backend: str | ChosenBackend, mode: str, q: torch.Tensor, needs_grad: bool,
                       deterministic: bool = False) -> None:
    """Log which backend runs ``mode`` and why, how it attends to the anchor (:func:`anchor_handling`), and warn
    where ``auto`` would run ``anchor`` and ``full`` on different kernel families (on Hopper without
    FlashAttention-3: FlashAttention-2 and cuDNN). ``backend``: a name, or the :class:`ChosenBackend` that runs."""
    if not isinstance(backend, ChosenBackend):
        backend = choose_backend(backend, q, needs_grad, mode, deterministic)
    name, skipped, requested = backend.name, backend.skipped, backend.requested
    device = torch.cuda.get_device_name(q.device) if q.is_cuda else str(q.device)
    why = ("asked for by name" if requested != "auto" else
           "auto's first that runs here" + "".join(f"; not {b}: {reason}" for b, reason in skipped.items()))
    details = [d for d in (anchor_handling(name, mode, q.device),
                           "deterministic backward" if deterministic and needs_grad else None) if d]
    log = library_logger(__name__)
    log.info("nemo_anchor attention: %s runs on %s (%s) on %s, %s, head_dim %d%s: %s", mode, name,
             kernel_family(name), device, str(q.dtype).removeprefix("torch."), q.shape[-1],
             "".join(f"; {d}" for d in details), why)
    if requested != "auto" or mode not in ("anchor", "full"):
        return
    families = {m: kernel_family(backend_choice("auto", q, needs_grad, m, deterministic)[0])
                for m in ("anchor", "full")}
    if families["anchor"] != families["full"]:
        log.warning("nemo_anchor attention: on this machine auto runs anchor on %s and full on %s, so comparing them "
                    "compares kernels too; set the attention backend (model.attention_backend, NeMo/Bridge "
                    "attention_kernel) to %s in both runs for like for like", families["anchor"], families["full"],
                    common_backend(q, needs_grad))


def library_logger(name: str) -> logging.Logger:
    """The logger ``name`` (a module of ``nemo_anchor``), under ``nemo_anchor``'s logger, which is shown at INFO on
    stderr when the application configured no logging (as ``transformers`` does for its own); otherwise records
    propagate to the application's handlers."""
    library = logging.getLogger("nemo_anchor")
    if not library.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        library.addHandler(handler)
    if library.level == logging.NOTSET:
        library.setLevel(logging.INFO)
    return logging.getLogger(name)


def unavailable_reason(backend: str, q: torch.Tensor, needs_grad: bool, mode: str,
                       deterministic: bool = False) -> str | None:
    """Why ``backend`` cannot run ``mode`` for ``q`` on this machine (with a deterministic backward where
    ``deterministic`` and ``needs_grad``: the backend's ``deterministic_reason``, where it has one), or None."""
    refusal = backend_refusal(backend, mode)
    if refusal is not None:
        return refusal
    module = _backend_module(backend)
    reason = module.unavailable_reason(q, needs_grad)
    if reason is None and deterministic and needs_grad and hasattr(module, "deterministic_reason"):
        reason = module.deterministic_reason(q)
    return reason


def backend_refusal(backend: str, mode: str) -> str | None:
    """Why ``backend`` never runs ``mode`` on any machine (a config error, checked before launch), or None."""
    if backend not in BACKENDS:
        return f"choose one of {BACKENDS}"
    if mode == "anchor" and backend in NO_ANCHOR:
        return ("its public attention returns no log-sum-exp to merge the anchor with, and gathering the anchor "
                "into every document's keys would copy K and V in every layer; use auto, fa3, fa4, torch_varlen "
                "or flash")
    return None


def _backend_module(name: str):
    return importlib.import_module(f"nemo_anchor.attention.{name}")
