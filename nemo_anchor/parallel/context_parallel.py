"""Context parallelism over packed windows, for every attention type, exact against one process.

``context_parallel_attention`` is what ``AnchorCoreAttention`` runs when Megatron's context-parallel
group has more than one rank; ``shard_batch`` hands each rank its tokens of a collated batch
(``batch_for_this_rank``: with Megatron's group, on the device, for our trainer and NeMo's data step). The
layout is Megatron's load-balanced one (:mod:`nemo_anchor.parallel.load_balance`): rank r holds
chunks r and 2cp-1-r of every window, so documents, anchors and RoPE positions travel with the
split and only the attention needs to communicate.

Two strategies, chosen by ``model.cp_comm_type`` (Megatron's names):

- ``a2a`` (Ulysses): an all-to-all turns the sequence shards of q, k, v into head shards of the
  whole pack; each rank runs the single-process attention over every token for ``H / cp`` heads;
  a second all-to-all turns the output back into sequence shards. The attention arithmetic is the
  single-process arithmetic, head by head. Needs query and key/value heads divisible by cp.
- ``all_gather``: keys and values are gathered; each rank attends its own two query chunks per
  window to the keys before them (the anchor included) through ``anchor_attention``'s
  ``q_offset``. Any head count; the backward reduce-scatters the key/value gradients.
"""
from __future__ import annotations

import functools
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import torch

from nemo_anchor.attention import anchor_attention
from nemo_anchor.attention.layout import PackLayout, pack_layout
from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.parallel.collectives import all_gather, all_to_all
from nemo_anchor.parallel.load_balance import check_windows, rank_chunks, rank_major_order, rank_positions

COMM_TYPES = ("a2a", "all_gather")


def check_head_split(num_attention_heads: int, num_query_groups: int, context_parallel_size: int,
                     cp_comm_type: str) -> None:
    """Raise ValueError when ``cp_comm_type`` cannot split these heads over ``context_parallel_size`` ranks."""
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"model.cp_comm_type={cp_comm_type!r}: choose one of {list(COMM_TYPES)}")
    if context_parallel_size == 1 or cp_comm_type != "a2a":
        return
    for key, value in (("num_attention_heads", num_attention_heads), ("num_query_groups", num_query_groups)):
        if value % context_parallel_size:
            raise ValueError(
                f"model.{key}={value} is not divisible by model.context_parallel_size={context_parallel_size}: "
                f"cp_comm_type=a2a gives every context-parallel rank 1/{context_parallel_size} of the query and "
                f"key/value heads. Use model.cp_comm_type=all_gather (any head count) or a "
                f"context_parallel_size that divides {value}")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    cu_windows: torch.Tensor | None = None,
    *,
    layout: PackLayout | None = None,
    mask: str,
    backend="auto",
    softmax_scale: float | None = None,
    cp_group,
    comm_type: str = "a2a",
    deterministic: bool = False,
) -> torch.Tensor:
    """``anchor_attention`` over a pack whose tokens are spread over a context-parallel group.

    Every rank of ``cp_group`` calls this together with its own tokens.

    Arguments:
        q: ``(t, Hq, D)`` this rank's queries in the load-balanced layout: chunks r and 2cp-1-r
            of every window of ``cu_windows``, window after window (r = ``cp_group.rank()``).
        k, v: ``(t, Hkv, D)`` the same tokens' keys and values (grouped-query heads not expanded).
        cu_seqlens, cu_windows: integer tensors, the document and window boundaries of the
            *whole* pack of ``cp * t`` tokens (the same on every rank); window lengths must be
            multiples of ``2 * cp``.
        layout: instead of the two, the whole pack's
            :class:`~nemo_anchor.attention.layout.PackLayout`, read once for every layer.
        mask, backend, softmax_scale, deterministic: as ``mode``, ``backend``, ``softmax_scale``,
            ``deterministic`` of :func:`nemo_anchor.attention.anchor_attention`.
        cp_group: the context-parallel process group.
        comm_type: ``"a2a"`` (needs Hq and Hkv divisible by cp) or ``"all_gather"``.

    Returns:
        ``(t, Hq, D)``: for each local row, what ``anchor_attention`` gives that token on the whole
        pack. Differentiable in q, k, v; the backward communicates within ``cp_group``.

    Raises:
        ValueError: inconsistent shapes or boundaries, a window not divisible by ``2 * cp``, heads
            that ``a2a`` cannot split, an unknown ``comm_type``.
    """
    cp_size = cp_group.size()
    attend = functools.partial(anchor_attention, mode=mask, backend=backend, softmax_scale=softmax_scale,
                               deterministic=deterministic)
    if cp_size == 1:
        return attend(q, k, v, cu_seqlens, cu_windows=cu_windows, layout=layout)
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q (t, Hq, D) and k, v (t, Hkv, D) must hold the same t local tokens, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    check_head_split(q.shape[1], k.shape[1], cp_size, comm_type)
    total = cp_size * q.shape[0]
    if layout is None:
        for name, cu in (("cu_seqlens", cu_seqlens), ("cu_windows", cu_windows)):
            if isinstance(cu, torch.Tensor) and cu.dim() == 1 and len(cu) and int(cu[-1]) != total:
                _raise_not_the_whole_pack(name, int(cu[-1]), cp_size, q.shape[0])
        layout = pack_layout(cu_seqlens, cu_windows, total)
    elif layout.total != total:
        _raise_not_the_whole_pack("the layout", layout.total, cp_size, q.shape[0])
    check_windows(layout.window_bounds, cp_size)
    if comm_type == "a2a":
        return _head_sharded_attention(q, k, v, layout, cp_group, attend)
    return _gathered_kv_attention(q, k, v, layout, cp_group, attend)


def _raise_not_the_whole_pack(name: str, end: int, cp_size: int, local: int):
    raise ValueError(f"{name} ends at {end}, but the context-parallel group holds cp x t = {cp_size} x {local} = "
                     f"{cp_size * local} tokens: pass the boundaries of the whole (unsharded) pack")


def _head_sharded_attention(q, k, v, layout, group, attend):
    """Ulysses: sequence shards -> head shards of the whole pack -> attention -> sequence shards."""
    order, inverse = rank_major_order(layout.window_bounds, group.size(), q.device)
    q_all, k_all, v_all = _ToHeadShards.apply(q, k, v, order, inverse, group)
    return _ToSequenceShards.apply(attend(q_all, k_all, v_all, layout=layout), order, inverse, group)


# The two exchanges of a2a write what Transformer Engine's THD a2a (``flash_attn_a2a_communicate``) writes:
# each way, one copy into the send buffer (its head blocks, one per rank) and one reorder of the tokens
# (rank-major <-> position order), forward and backward. ``order``, ``inverse``: ``rank_major_order``.

class _ToHeadShards(torch.autograd.Function):
    """This rank's tokens, all heads -> every token of the pack, ``H / cp`` heads, in position order."""

    @staticmethod
    def forward(ctx, q, k, v, order, inverse, group):
        cp, t = group.size(), q.shape[0]
        ctx.heads, ctx.inverse, ctx.group = [x.shape[1] // cp for x in (q, k, v)], inverse, group
        send = q.new_empty(cp, t, sum(ctx.heads), q.shape[2])  # block j goes to rank j
        for x, block in zip((q, k, v), send.split(ctx.heads, dim=2)):
            block.copy_(x.unflatten(1, (cp, -1)).transpose(0, 1))
        received = all_to_all(send, group).flatten(0, 1)  # every rank's tokens, rank after rank
        return received.index_select(0, inverse).split(ctx.heads, dim=1)

    @staticmethod
    def backward(ctx, *grads):
        cp = ctx.group.size()
        send = grads[0].new_empty(len(ctx.inverse), sum(ctx.heads), grads[0].shape[2])
        for grad, block in zip(grads, send.split(ctx.heads, dim=1)):
            block.index_copy_(0, ctx.inverse, grad)  # back to rank-major order
        received = all_to_all(send.unflatten(0, (cp, -1)), ctx.group)  # block j: rank j's heads of my tokens
        local = []
        for block in received.split(ctx.heads, dim=2):
            grad = block.new_empty(block.shape[1], cp * block.shape[2], block.shape[3])
            grad.unflatten(1, (cp, -1)).copy_(block.transpose(0, 1))
            local.append(grad)
        return (*local, None, None, None)


class _ToSequenceShards(torch.autograd.Function):
    """Every token of the pack, ``H / cp`` heads, in position order -> this rank's tokens, all heads."""

    @staticmethod
    def forward(ctx, out, order, inverse, group):
        cp = group.size()
        ctx.inverse, ctx.group = inverse, group
        received = all_to_all(out.index_select(0, order).unflatten(0, (cp, -1)), group)
        local = out.new_empty(received.shape[1], cp * out.shape[1], out.shape[2])
        local.unflatten(1, (cp, -1)).copy_(received.transpose(0, 1))  # block j: rank j's heads
        return local

    @staticmethod
    def backward(ctx, grad):
        received = all_to_all(grad.unflatten(1, (ctx.group.size(), -1)).transpose(0, 1).contiguous(), ctx.group)
        return received.flatten(0, 1).index_select(0, ctx.inverse), None, None, None


@dataclass(frozen=True)
class _ChunkQueries:
    """One ``anchor_attention`` call of the all_gather strategy: a query chunk against its window's keys."""

    rows: slice  # the chunk's local rows
    keys: slice  # positions in the pack: its window's start up to the chunk's end (later keys are masked)
    q_offset: int  # the chunk's first position, relative to keys.start
    layout: PackLayout  # the documents of the keys, one window


@functools.lru_cache(maxsize=64)
def _chunk_queries(docs: tuple[int, ...], windows: tuple[int, ...], cp_size: int, cp_rank: int):
    calls, row = [], 0
    for i, (start, end) in enumerate(rank_chunks(windows, cp_size, cp_rank)):
        window_start = windows[i // 2]
        inside = docs[bisect_right(docs, window_start):bisect_left(docs, end)]
        bounds = (0, *(d - window_start for d in inside), end - window_start)
        calls.append(_ChunkQueries(slice(row, row + end - start), slice(window_start, end), start - window_start,
                                   PackLayout.of(bounds)))
        row += end - start
    return tuple(calls)


def _gathered_kv_attention(q, k, v, layout, group, attend):
    """All-gather keys and values; each rank attends its own query chunks."""
    order, inverse = rank_major_order(layout.window_bounds, group.size(), q.device)
    chunks = _chunk_queries(layout.doc_bounds, layout.window_bounds, group.size(), group.rank())
    gathered = all_gather(torch.cat([k, v], dim=1), group)  # one send copy (Megatron's k, v are views of qkv)
    keys = _KeysOfChunks.apply(gathered, k.shape[1], order, inverse, tuple(c.keys for c in chunks))
    queries = q.split([c.rows.stop - c.rows.start for c in chunks])
    return torch.cat([attend(q_chunk, keys[2 * i], keys[2 * i + 1], layout=c.layout, q_offset=c.q_offset)
                      for i, (c, q_chunk) in enumerate(zip(chunks, queries))])


class _KeysOfChunks(torch.autograd.Function):
    """The gathered keys and values in position order, as each query chunk's range of them: views
    ``k_0, v_0, k_1, v_1, ...``.

    The backward adds each range's gradient into one buffer in place, as Transformer Engine's all_gather
    context parallelism does, where autograd's slice backward makes a pack-sized gradient per range.
    """

    @staticmethod
    def forward(ctx, gathered, kv_heads, order, inverse, ranges):
        ctx.kv_heads, ctx.order, ctx.ranges = kv_heads, order, ranges
        in_order = gathered.index_select(0, inverse)
        return tuple(view for r in ranges for view in in_order[r].split(kv_heads, dim=1))

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0].new_zeros(len(ctx.order), 2 * ctx.kv_heads, grads[0].shape[2])
        for i, r in enumerate(ctx.ranges):
            grad[r, :ctx.kv_heads].add_(grads[2 * i])
            grad[r, ctx.kv_heads:].add_(grads[2 * i + 1])
        return grad.index_select(0, ctx.order), None, None, None, None


@dataclass(frozen=True)
class ShardPlan:
    """Which tokens of a collated batch one context-parallel rank holds.

    Attributes:
        index: int64 ``[t]``: the flat index into the batch's ``B * T`` tokens of each local row;
            -1 for padding (see :func:`shard_batch`).
        shape: the shape of the rank's per-token tensors (``t`` elements).
        cu_seqlens, cu_windows: int32 boundaries of the pack the group shares (global).
    """

    index: torch.Tensor
    shape: tuple[int, int]
    cu_seqlens: torch.Tensor
    cu_windows: torch.Tensor


def shard_plan(cu_seqlens: torch.Tensor, cu_windows: torch.Tensor, cp_size: int, cp_rank: int,
               attention_type: str) -> ShardPlan:
    """The tokens rank ``cp_rank`` of ``cp_size`` holds of a batch of packed windows (see :func:`shard_batch`)."""
    docs = torch.as_tensor(cu_seqlens, dtype=torch.int32)
    windows = torch.as_tensor(cu_windows, dtype=torch.int32)
    window_bounds = tuple(windows.tolist())
    if get_attention_type(attention_type).rope_restarts == "window":
        check_windows(window_bounds, cp_size)
        batch_size = len(window_bounds) - 1
        index = rank_positions(window_bounds, cp_size, cp_rank)
        return ShardPlan(index, (batch_size, len(index) // batch_size), docs, windows)
    padded, source = _pad_documents(docs, 2 * cp_size)
    index = source[rank_positions(tuple(padded.tolist()), cp_size, cp_rank)]
    return ShardPlan(index, (1, len(index)), padded, padded)


def pads_documents(attention_type: str, context_parallel_size: int) -> bool:
    """Whether :func:`shard_batch` pads every document (positions restart per document), so that a
    micro-batch's length varies with its documents."""
    return context_parallel_size > 1 and get_attention_type(attention_type).rope_restarts != "window"


def _pad_documents(cu_seqlens: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document boundaries with every document padded at its end to a multiple of ``multiple``,
    and for each padded position its original position (-1 for padding)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded_lengths = (lengths + multiple - 1) // multiple * multiple
    padded = torch.cat([padded_lengths.new_zeros(1), padded_lengths.cumsum(0)])
    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    original = torch.arange(int(cu_seqlens[-1]))
    source = torch.full((int(padded[-1]),), -1, dtype=torch.long)
    source[padded[document] + original - cu_seqlens[document].long()] = original
    return padded.to(torch.int32), source


def shard_batch(batch: dict, cp_group, attention_type: str) -> dict:
    """This rank's share of a collated batch (``nemo_anchor.data.collate_windows``) for context parallelism.

    Arguments:
        batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[B, T]`` and int32
            ``cu_seqlens`` (documents) / ``cu_windows`` (``[0, T, ..., B*T]``) over the ``B * T`` tokens.
        cp_group: the context-parallel process group (only its size and this rank's index are used).
        attention_type: the model's ``attention_type``; it decides where RoPE positions restart.

    Returns:
        The same keys. Every ``[B, T, ...]`` tensor becomes ``[B, T / cp, ...]``: chunks r and
        2cp-1-r of each window, the layout Megatron's THD RoPE and
        :func:`context_parallel_attention` expect; ``cu_seqlens``/``cu_windows`` stay global.
        Other entries pass through.

        When positions restart at every document (``intra_doc_reset``), Megatron's RoPE splits
        each *document* into 2cp chunks, so documents must be multiples of 2cp long: every
        document is padded at its end up to one (padding: token, label, position 0, loss_mask 0;
        only later padding of the same document attends to it, so the real tokens compute exactly
        what they would unpadded) and becomes its own window. Per-token tensors are then
        ``[1, P / cp, ...]`` for the padded length P, and ``cu_seqlens`` = ``cu_windows`` = the
        padded document boundaries.

    Raises:
        ValueError: a window length not divisible by ``2 * cp``; an unknown attention type.
    """
    cp_size = cp_group.size()
    if cp_size == 1:
        return batch
    tokens = batch["tokens"]
    plan = shard_plan(batch["cu_seqlens"], batch["cu_windows"], cp_size, cp_group.rank(), attention_type)
    is_padding = plan.index < 0
    sharded = {"cu_seqlens": plan.cu_seqlens, "cu_windows": plan.cu_windows}
    for key, value in batch.items():
        if key in sharded:
            continue
        if torch.is_tensor(value) and value.shape[:2] == tokens.shape:
            local = value.flatten(0, 1)[plan.index.clamp(min=0)]
            local[is_padding] = 0
            value = local.view(*plan.shape, *value.shape[2:])
        sharded[key] = value
    return sharded


def batch_for_this_rank(batch: dict, attention_type: str, device: torch.device) -> dict:
    """A collated batch as this rank's model takes it: its context-parallel share (:func:`shard_batch`
    over Megatron's context-parallel group) with every tensor on ``device``, and ``layout``, the
    boundaries' :class:`~nemo_anchor.attention.layout.PackLayout` read from the host copy before the
    transfer (the model would otherwise read them back from the device: a host sync per micro-batch)."""
    from megatron.core import parallel_state

    if parallel_state.get_context_parallel_world_size() > 1:
        batch = shard_batch(batch, parallel_state.get_context_parallel_group(), attention_type)
    layout = pack_layout(batch["cu_seqlens"], batch["cu_windows"])
    moved = {key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
             for key, value in batch.items()}
    return {**moved, "layout": layout}
