"""Triton kernels of :mod:`nemo_anchor.attention.anchor_key`: the window anchor merged in one launch per pass.

Imported through :func:`nemo_anchor.gpu.anchor_key_triton` (it needs ``triton``). Each program
takes one *tile* of the plan (at most ``TILE_ROWS`` consecutive query rows that see one anchor)
and one key/value head, loads the anchor's key and value row once, and walks the tile's rows
``BLOCK_M`` at a time for each query head of its group (query head ``h`` reads key/value head
``h // group``), everything in fp32 registers, one rounding per stored element:

- ``forward_kernel`` reads ``q``, ``out`` and ``lse`` and rewrites ``out`` and ``lse`` in place;
- ``backward_kernel`` adds the anchor's share to ``dq`` in place and writes the tile's sums of the
  anchor's key and value gradients to an fp32 ``partial`` buffer ``[2, n_tiles, Hkv, D]`` (no
  atomics: deterministic);
- ``finish_kernel`` adds each anchor's tiles of ``partial`` to its row of ``dk`` and ``dv``.

The log-sum-exp correction is FlashAttention-4's ``flash_attn_combine`` and Transformer Engine's
``thd_out_correction`` for two partial results, one of which is a single key.
Imported with ``TRITON_INTERPRET=1`` they run on CPU tensors under Triton's interpreter instead
(tests/test_anchor_key_triton.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

KERNELS = ("forward_kernel", "backward_kernel", "finish_kernel")
BLOCK_M = 32  # query rows per step of a program: three [BLOCK_M, D] fp32 blocks live in the backward


@triton.jit
def forward_kernel(out, lse, q, k, v, tiles, scale, out_t, out_h, lse_h, lse_t, q_t, q_h, k_t, k_h, v_t, v_h,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(tiles + 3 * tile), tl.load(tiles + 3 * tile + 1)
    anchor = tl.load(tiles + 3 * tile + 2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    in_d = d < HEAD_DIM
    k_a = tl.load(k + anchor * k_t + kv_head * k_h + d, mask=in_d, other=0.0).to(tl.float32)
    v_a = tl.load(v + anchor * v_t + kv_head * v_h + d, mask=in_d, other=0.0).to(tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for first in range(start, end, BLOCK_M):
            rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
            in_rows = rows < end
            both = in_rows[:, None] & in_d[None, :]
            q_rows = tl.load(q + rows[:, None] * q_t + head * q_h + d[None, :], mask=both, other=0.0).to(tl.float32)
            s = tl.sum(q_rows * k_a[None, :], axis=1) * scale
            lse_rows = lse + head * lse_h + rows * lse_t
            doc = tl.load(lse_rows, mask=in_rows, other=0.0)
            merged = tl.maximum(doc, s) + tl.log(1.0 + tl.exp(-tl.abs(doc - s)))
            out_rows = out + rows[:, None] * out_t + head * out_h + d[None, :]
            o = tl.load(out_rows, mask=both, other=0.0).to(tl.float32)
            o = o * tl.exp(doc - merged)[:, None] + tl.exp(s - merged)[:, None] * v_a[None, :]
            tl.store(out_rows, o.to(out.dtype.element_ty), mask=both)
            tl.store(lse_rows, merged, mask=in_rows)


@triton.jit
def backward_kernel(dq, partial, dout, q, k, v, out, lse, tiles, scale, half, dq_t, dq_h, do_t, do_h, q_t, q_h,
                    k_t, k_h, v_t, v_h, out_t, out_h, lse_h, lse_t, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(tiles + 3 * tile), tl.load(tiles + 3 * tile + 1)
    anchor = tl.load(tiles + 3 * tile + 2).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    in_d = d < HEAD_DIM
    k_a = tl.load(k + anchor * k_t + kv_head * k_h + d, mask=in_d, other=0.0).to(tl.float32)
    v_a = tl.load(v + anchor * v_t + kv_head * v_h + d, mask=in_d, other=0.0).to(tl.float32)
    dk_a = tl.zeros([BLOCK_D], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for first in range(start, end, BLOCK_M):
            rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
            in_rows = rows < end
            both = in_rows[:, None] & in_d[None, :]
            q_rows = tl.load(q + rows[:, None] * q_t + head * q_h + d[None, :], mask=both, other=0.0).to(tl.float32)
            do = tl.load(dout + rows[:, None] * do_t + head * do_h + d[None, :], mask=both, other=0.0).to(tl.float32)
            o = tl.load(out + rows[:, None] * out_t + head * out_h + d[None, :], mask=both, other=0.0).to(tl.float32)
            merged = tl.load(lse + head * lse_h + rows * lse_t, mask=in_rows, other=0.0)
            s = tl.sum(q_rows * k_a[None, :], axis=1) * scale
            p = tl.where(in_rows, tl.exp(s - merged), 0.0)  # the anchor's probability
            row_dot = tl.sum(do * o, axis=1)  # FlashAttention's D_i = dO . O
            ds = p * (tl.sum(do * v_a[None, :], axis=1) - row_dot)
            dq_rows = dq + rows[:, None] * dq_t + head * dq_h + d[None, :]
            grad = tl.load(dq_rows, mask=both, other=0.0).to(tl.float32) + (ds * scale)[:, None] * k_a[None, :]
            tl.store(dq_rows, grad.to(dq.dtype.element_ty), mask=both)
            dk_a += tl.sum(ds[:, None] * q_rows, axis=0)
            dv_a += tl.sum(p[:, None] * do, axis=0)
    base = (tile * KV_HEADS + kv_head) * HEAD_DIM
    tl.store(partial + base + d, dk_a * scale, mask=in_d)
    tl.store(partial + half + base + d, dv_a, mask=in_d)


@triton.jit
def finish_kernel(dk, dv, partial, slot_tiles, anchors, half, dk_t, dk_h, dv_t, dv_h, KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    slot, kv_head = tl.program_id(0), tl.program_id(1)
    first, last = tl.load(slot_tiles + slot), tl.load(slot_tiles + slot + 1)
    anchor = tl.load(anchors + slot)
    d = tl.arange(0, BLOCK_D)
    in_d = d < HEAD_DIM
    dk_a = tl.zeros([BLOCK_D], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(first, last):  # in order: the same sums every run
        base = (tile * KV_HEADS + kv_head) * HEAD_DIM
        dk_a += tl.load(partial + base + d, mask=in_d, other=0.0)
        dv_a += tl.load(partial + half + base + d, mask=in_d, other=0.0)
    dk_row = dk + anchor * dk_t + kv_head * dk_h + d
    dv_row = dv + anchor * dv_t + kv_head * dv_h + d
    tl.store(dk_row, (tl.load(dk_row, mask=in_d, other=0.0).to(tl.float32) + dk_a).to(dk.dtype.element_ty), mask=in_d)
    tl.store(dv_row, (tl.load(dv_row, mask=in_d, other=0.0).to(tl.float32) + dv_a).to(dv.dtype.element_ty), mask=in_d)


# what ``triton.jit`` above made of the kernels: interpreted (TRITON_INTERPRET=1 when this module was
# imported) they run on CPU tensors, compiled (a ``JITFunction``) on CUDA ones. Read off the kernel, not off
# ``triton.knobs`` (Triton >= 3.4 only), so every Triton the [gpu] extra allows answers the same.
INTERPRETED = not isinstance(forward_kernel, triton.runtime.JITFunction)


def runs_on(device: torch.device) -> bool:
    """Whether these kernels run on tensors of ``device``."""
    return device.type == ("cpu" if INTERPRETED else "cuda")


def merge(out, lse, q, k, v, plan, scale: float) -> None:
    """:func:`nemo_anchor.attention.anchor_key.merge_anchor` in one launch."""
    kv_heads, head_dim = k.shape[1], q.shape[2]
    forward_kernel[(plan.tiles.shape[0], kv_heads)](
        out, lse, q, k, v, plan.tiles, scale, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        GROUP=q.shape[1] // kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=BLOCK_M)


def merge_backward(dq, dk, dv, dout, q, k, v, out, lse, plan, scale: float) -> None:
    """:func:`nemo_anchor.attention.anchor_key.merge_anchor_backward` in two launches (and one allocation)."""
    kv_heads, head_dim = k.shape[1], q.shape[2]
    n_tiles, block_d = plan.tiles.shape[0], triton.next_power_of_2(head_dim)
    partial = torch.empty(2, n_tiles, kv_heads, head_dim, dtype=torch.float32, device=q.device)
    half = n_tiles * kv_heads * head_dim
    backward_kernel[(n_tiles, kv_heads)](
        dq, partial, dout, q, k, v, out, lse, plan.tiles, scale, half, dq.stride(0), dq.stride(1),
        dout.stride(0), dout.stride(1), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        KV_HEADS=kv_heads, GROUP=q.shape[1] // kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=BLOCK_M)
    finish_kernel[(plan.anchors.shape[0], kv_heads)](
        dk, dv, partial, plan.slot_tiles, plan.anchors, half, dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d)
