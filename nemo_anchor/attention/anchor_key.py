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
torch, about twenty ops forward and thirty backward over all query rows at once (rows without an
anchor get ``s = -inf``, which leaves them bit for bit unchanged). That fallback allocates fp32
copies of q, out and the output gradient (``[Tq, Hq, D]``) and of every row's anchor key and value
(``[Tq, Hkv, D]``); it never runs on a GPU where triton is installed (every CUDA torch wheel
brings it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nemo_anchor import gpu
from nemo_anchor.attention.layout import QueryBlock, VarlenPlan, varlen_plan

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
    ``slot_keys``: int64 ``[n_anchors + 1]``: the key position of each anchor, then 0 (a placeholder slot).
    ``row_slot``: int64 ``[Tq]``: the anchor (index into ``slot_keys``) of each row of q; ``n_anchors`` for none.
    ``row_bias``: fp32 ``[Tq, 1]``: 0 for rows that see an anchor, ``-inf`` for the others.
    """

    documents: VarlenPlan
    tiles: torch.Tensor
    slot_tiles: torch.Tensor
    slot_keys: torch.Tensor
    row_slot: torch.Tensor
    row_bias: torch.Tensor


@functools.lru_cache(maxsize=64)
def anchor_plan(blocks: tuple[QueryBlock, ...], q_offset: int, device: torch.device) -> AnchorPlan:
    """The plan of the query blocks ``blocks`` (queries from packed position ``q_offset``) on ``device``.

    Host work and non-blocking copies only: building it does not wait for the device.
    """
    runs: dict[int, list[tuple[int, int]]] = {}  # anchor -> its rows of q, in order
    for block in blocks:
        if block.anchor is not None:
            runs.setdefault(block.anchor, []).append((block.start - q_offset, block.end - q_offset))
    q_len = blocks[-1].end - q_offset
    tiles, slot_tiles = [], [0]
    row_slot = torch.full((q_len,), len(runs), dtype=torch.int64)
    row_bias = torch.full((q_len, 1), float("-inf"))
    for slot, (anchor, rows) in enumerate(runs.items()):
        for start, end in rows:
            tiles += [(first, min(end, first + TILE_ROWS), anchor) for first in range(start, end, TILE_ROWS)]
            row_slot[start:end] = slot
            row_bias[start:end] = 0.0
        slot_tiles.append(len(tiles))

    def on_device(x) -> torch.Tensor:
        return x.to(device, non_blocking=True)

    plain = tuple(QueryBlock(b.key_start, b.start, b.end, None) for b in blocks)
    return AnchorPlan(varlen_plan(plain, device), on_device(torch.tensor(tiles, dtype=torch.int32)),
                      on_device(torch.tensor(slot_tiles, dtype=torch.int32)),
                      on_device(torch.tensor([*runs, 0], dtype=torch.int64)), on_device(row_slot), on_device(row_bias))


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
    kernels, _ = gpu.anchor_key_triton()
    if kernels is not None and kernels.runs_on(q.device):
        kernels.merge(out, lse, q, k, v, plan, scale)
        return
    s, k_rows, v_rows, q32 = _scores(q, k, v, plan, scale)
    doc = lse.T  # [Tq, Hq]
    # logaddexp written out (torch.logaddexp rounds differently with the tensor's size, see cpu._merge)
    merged = torch.maximum(doc, s) + torch.log1p(torch.exp(-(doc - s).abs()))
    keep, take = _grouped((doc - merged).exp(), k.shape[1]), _grouped((s - merged).exp(), k.shape[1])
    mixed = torch.addcmul(_grouped(out, k.shape[1]).float() * keep[..., None], take[..., None], v_rows[:, :, None])
    out.copy_(mixed.flatten(1, 2))
    lse.copy_(merged.T)


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
    kernels, _ = gpu.anchor_key_triton()
    if kernels is not None and kernels.runs_on(q.device):
        kernels.merge_backward(dq, dk, dv, dout, q, k, v, out, lse, plan, scale)
        return
    kv_heads = k.shape[1]
    s, k_rows, v_rows, q32 = _scores(q, k, v, plan, scale)
    p = _grouped((s - lse.T).exp(), kv_heads)  # [Tq, Hkv, group]; 0 where no anchor
    do = _grouped(dout, kv_heads).float()
    row_dot = (do * _grouped(out, kv_heads).float()).sum(-1)  # FlashAttention's D_i = dO . O
    ds = p * (torch.einsum("tkgd,tkd->tkg", do, v_rows) - row_dot)
    dq.copy_(torch.addcmul(_grouped(dq, kv_heads).float(), ds[..., None] * scale, k_rows[:, :, None]).flatten(1, 2))
    anchors = plan.slot_keys[:-1]
    for grad, share in ((dk, torch.einsum("tkg,tkgd->tkd", ds, q32) * scale), (dv, torch.einsum("tkg,tkgd->tkd", p, do))):
        per_anchor = torch.zeros(len(plan.slot_keys), *grad.shape[1:], dtype=torch.float32, device=grad.device)
        per_anchor.index_add_(0, plan.row_slot, share)
        grad[anchors] = (grad[anchors].float() + per_anchor[:-1]).to(grad.dtype)


def _scores(q, k, v, plan: AnchorPlan, scale: float):
    """fp32 ``s`` ``[Tq, Hq]`` (``-inf`` for rows without anchor), each row's anchor key and value (fp32
    ``[Tq, Hkv, D]``), and q in fp32 grouped ``[Tq, Hkv, group, D]``."""
    keys = plan.slot_keys.index_select(0, plan.row_slot)  # each row's anchor position
    k_rows, v_rows = k.index_select(0, keys).float(), v.index_select(0, keys).float()
    q32 = _grouped(q, k.shape[1]).float()
    s = torch.einsum("tkgd,tkd->tkg", q32, k_rows).flatten(1) * scale + plan.row_bias
    return s, k_rows, v_rows, q32


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[n, Hq, ...]`` as ``[n, Hkv, group, ...]`` (a view, whatever the strides)."""
    return x.unflatten(1, (kv_heads, -1))
