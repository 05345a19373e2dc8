"""The window anchor as one more key of a varlen kernel's result, merged by log-sum-exp in place.

A varlen kernel attends every query to its document's keys and returns ``out`` and the
log-sum-exp ``lse``; the anchor is one key more, ``s = scale * q . k[anchor]`` per query and head,
and the two are one softmax (:mod:`nemo_anchor.attention.anchor_merge` says why and when)::

    lse' = logaddexp(lse, s)
    out' = out * exp(lse - lse') + v[anchor] * exp(s - lse')

Both passes cost a constant number of launches per layer, whatever the length: on CUDA the Triton
kernels of :mod:`nemo_anchor.attention.anchor_key_triton` (one launch forward, two backward, all
in fp32 registers, no temporary larger than ``[2, n_tiles, Hkv, D]`` fp32); where those cannot run
(CPU tensors without Triton's interpreter: the CPU stand-ins) the same arithmetic vectorized in
torch over all query rows at once, 23 aten ops forward and 42 backward in fp32 (a few casts more
in bf16), no loop (rows without an anchor get ``s = -inf``, which leaves them bit for bit
unchanged). That fallback allocates fp32 temporaries of q's size ``[Tq, Hq, D]`` (q, out and the
output gradient, products of them) and every row's anchor key and value ``[Tq, Hkv, D]``.

:func:`merge_path` says which of the two runs for a device and why; the first forward's log line
quotes it. On CUDA the fallback runs only where the Triton kernels cannot (no ``triton``, one
too old for them, a broken install): it warns once, naming why and what it costs, and carries
on, since its results are the same (tests/test_anchor_key_triton.py) and only time and memory differ.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nemo_anchor import gpu
from nemo_anchor.attention.layout import QueryBlock, VarlenPlan, derived, to_device, varlen_plan

# query rows per Triton program (a tile never crosses from one anchor to another); the backward
# keeps one fp32 [Hkv, D] sum per tile and pass: Tq / TILE_ROWS of them
TILE_ROWS = 128


@dataclass(frozen=True)
class AnchorPlan:
    """What the merge reads besides the tensors, on their device; built once per micro-batch (:func:`anchor_plan`).

    ``documents``: the varlen plan of the query blocks without their anchors.
    ``tiles``: int32 ``[n_tiles, 3]``, ``(first row, end row, anchor key position)`` of at most
    ``TILE_ROWS`` consecutive rows of q that see the same anchor (the Triton kernels' work items).
    ``slot_tiles``: int32 ``[n_anchors + 1]``: the tiles of the i-th anchor are ``slot_tiles[i]:slot_tiles[i + 1]``.
    ``anchors``: int64 ``[n_anchors]``: the key position of each anchor.
    For the torch fallback, per row of q: ``row_slot`` int64 ``[Tq]``, its anchor's index (``n_anchors``
    for none); ``row_key`` int64 ``[Tq]``, its anchor's key position (0 for none); ``row_bias`` fp32
    ``[Tq, 1, 1]``, 0, or ``-inf`` for none.
    """

    documents: VarlenPlan
    tiles: torch.Tensor
    slot_tiles: torch.Tensor
    anchors: torch.Tensor
    row_slot: torch.Tensor
    row_key: torch.Tensor
    row_bias: torch.Tensor


def merge_path(device: torch.device) -> tuple[object | None, str]:
    """``(the Triton kernels' module, "triton")`` where they run on ``device``'s tensors, else
    ``(None, "torch fallback (why)")``."""
    kernels, reason = gpu.anchor_key_triton()
    if kernels is not None and kernels.runs_on(device):
        return kernels, "triton"
    if kernels is None:
        why = reason
    elif kernels.INTERPRETED:
        why = f"Triton's interpreter (TRITON_INTERPRET=1) runs CPU tensors, not {device.type}"
    else:
        why = f"{device.type} tensors; the Triton path needs a GPU or TRITON_INTERPRET=1"
    return None, f"torch fallback ({why})"


_WARNED: set[str] = set()  # the device types whose fallback this process has warned about


def _kernels(q: torch.Tensor):
    """The Triton kernels for q's device, or None (the torch fallback); on CUDA the first fallback warns."""
    kernels, path = merge_path(q.device)
    if kernels is None and q.is_cuda and q.device.type not in _WARNED:
        _WARNED.add(q.device.type)
        logging.getLogger(__name__).warning(
            "nemo_anchor attention: the anchor merge runs its %s on CUDA: about 23 launches forward and 42 backward "
            "per layer instead of 1 and 2, and fp32 temporaries of q's size (%.2f GiB each here); install the Triton "
            "of nemo-anchor's [gpu] extra", path, q.numel() * 4 / 2**30)
    return kernels


def anchor_plan(blocks: tuple[QueryBlock, ...], q_offset: int, device: torch.device) -> AnchorPlan:
    """The plan of the query blocks ``blocks`` (queries from packed position ``q_offset``) on ``device``, built
    once per :class:`~nemo_anchor.attention.layout.QueryBlocks` (so per micro-batch) and kept there.

    Host work and non-blocking copies from pinned memory only: building it does not wait for the device.
    """
    return derived(blocks, ("anchor_plan", q_offset, device), lambda: _anchor_plan(blocks, q_offset, device))


def _anchor_plan(blocks: tuple[QueryBlock, ...], q_offset: int, device: torch.device) -> AnchorPlan:
    runs: dict[int, list[tuple[int, int]]] = {}  # anchor -> its rows of q, in order
    for block in blocks:
        if block.anchor is not None:
            runs.setdefault(block.anchor, []).append((block.start - q_offset, block.end - q_offset))
    q_len = blocks[-1].end - q_offset
    tiles, slot_tiles = [], [0]
    row_slot, row_key = torch.full((q_len,), len(runs), dtype=torch.int64), torch.zeros(q_len, dtype=torch.int64)
    row_bias = torch.full((q_len, 1, 1), float("-inf"))
    for slot, (anchor, rows) in enumerate(runs.items()):
        for start, end in rows:
            tiles += [(first, min(end, first + TILE_ROWS), anchor) for first in range(start, end, TILE_ROWS)]
            row_slot[start:end], row_key[start:end], row_bias[start:end] = slot, anchor, 0.0
        slot_tiles.append(len(tiles))

    def on_device(x) -> torch.Tensor:
        return to_device(x, device)

    plain = tuple(QueryBlock(b.key_start, b.start, b.end, None) for b in blocks)
    return AnchorPlan(varlen_plan(plain, device), on_device(torch.tensor(tiles, dtype=torch.int32)),
                      on_device(torch.tensor(slot_tiles, dtype=torch.int32)), on_device(torch.tensor(list(runs))),
                      on_device(row_slot), on_device(row_key), on_device(row_bias))


def merge_anchor(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 plan: AnchorPlan, scale: float) -> None:
    """Merge each row's anchor into a varlen kernel's result, in place.

    Arguments:
        out: ``(Tq, Hq, D)``, q's dtype: the kernel's output over the documents' keys; rewritten.
        lse: fp32 ``(Hq, Tq)`` (FlashAttention's varlen layout, any strides): its log-sum-exp; rewritten.
        q: ``(Tq, Hq, D)``; k, v: ``(T, Hkv, D)`` with ``Hq % Hkv == 0``, query head ``h`` reading
            key/value head ``h // (Hq // Hkv)``; the last dimension of every tensor contiguous.
        plan: :func:`anchor_plan` of the call's query blocks.
        scale: the softmax scale.

    Every row of q that sees an anchor gets ``lse' = logaddexp(lse, s)``,
    ``out' = out * exp(lse - lse') + v[anchor] * exp(s - lse')`` with ``s = scale * q . k[anchor]``,
    computed in fp32 and rounded once to out's dtype; the other rows are left as they are.
    """
    kernels = _kernels(q)
    if kernels is not None:
        kernels.merge(out, lse, q, k, v, plan, scale)
        return
    s, k_rows, v_rows, _ = _scores(q, k, v, plan, scale)
    doc = _grouped(lse.T, k.shape[1])  # [Tq, Hkv, group], a view of lse
    merged = torch.logaddexp(doc, s)  # = doc where s = -inf (no anchor)
    mixed = torch.addcmul(_grouped(out, k.shape[1]) * (doc - merged).exp().unsqueeze(-1),
                          (s - merged).exp().unsqueeze(-1), v_rows.unsqueeze(2))
    _grouped(out, k.shape[1]).copy_(mixed)
    doc.copy_(merged)


def merge_anchor_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dout: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, plan: AnchorPlan,
                          scale: float) -> None:
    """Add the anchor's share of the gradients to the kernel backward's ``dq``, ``dk``, ``dv``, in place.

    Arguments:
        dq: ``(Tq, Hq, D)``; dk, dv: ``(T, Hkv, D)``: the gradients the kernel's backward gave for the
            documents' keys, computed from the *merged* ``out`` and ``lse`` (so already exact for them).
        dout: ``(Tq, Hq, D)``, the output's gradient.
        q, k, v, out, lse, plan, scale: as in :func:`merge_anchor`, ``out`` and ``lse`` merged.

    With the anchor's probability ``p = exp(s - lse)`` and ``ds = p * (dout . v[anchor] - dout . out)``
    (FlashAttention's backward for one key): ``dq += scale * ds * k[anchor]`` per row,
    ``dk[anchor] += scale * sum ds * q`` and ``dv[anchor] += sum p * dout`` over the rows and query
    heads that see it; sums in fp32, one rounding per stored element.
    """
    kernels = _kernels(q)
    if kernels is not None:
        kernels.merge_backward(dq, dk, dv, dout, q, k, v, out, lse, plan, scale)
        return
    kv_heads = k.shape[1]
    s, k_rows, v_rows, q_grouped = _scores(q, k, v, plan, scale)
    p = (s - _grouped(lse.T, kv_heads)).exp()  # [Tq, Hkv, group]: the anchor's probability, 0 where none
    do = _grouped(dout, kv_heads).float()
    row_dot = (do * _grouped(out, kv_heads)).sum(-1)  # FlashAttention's D_i = dO . O
    ds = (p * ((do * v_rows.unsqueeze(2)).sum(-1) - row_dot)).unsqueeze(-1)
    dq_grouped = _grouped(dq, kv_heads)
    dq_grouped.copy_(torch.addcmul(dq_grouped, ds, k_rows.unsqueeze(2), value=scale))
    per_anchor = torch.zeros(2, len(plan.anchors) + 1, *k.shape[1:], dtype=torch.float32, device=k.device)
    shares = torch.stack([(ds * q_grouped).sum(2) * scale, (p.unsqueeze(-1) * do).sum(2)])  # [2, Tq, Hkv, D]
    per_anchor.index_add_(1, plan.row_slot, shares)
    for grad, share in zip((dk, dv), per_anchor[:, :-1]):
        grad[plan.anchors] = (grad[plan.anchors] + share).to(grad.dtype)


def _scores(q, k, v, plan: AnchorPlan, scale: float):
    """fp32 ``s`` ``[Tq, Hkv, group]`` (``-inf`` for rows without anchor), each row's anchor key and value (fp32
    ``[Tq, Hkv, D]``), and q grouped ``[Tq, Hkv, group, D]`` in fp32."""
    k_rows, v_rows = k.index_select(0, plan.row_key).float(), v.index_select(0, plan.row_key).float()
    q_grouped = _grouped(q, k.shape[1]).float()
    return torch.add(plan.row_bias, (q_grouped * k_rows.unsqueeze(2)).sum(-1), alpha=scale), k_rows, v_rows, q_grouped


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[n, Hq, ...]`` as ``[n, Hkv, group, ...]`` (a view, whatever the strides)."""
    return x.unflatten(1, (kv_heads, -1))
