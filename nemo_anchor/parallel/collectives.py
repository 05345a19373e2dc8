"""The two differentiable collectives context parallelism needs, for gloo (CPU) and nccl (GPU) alike.

Written out because ``torch.distributed.nn.functional`` is deprecated in torch 2.13 and its
replacement (functional collectives) warns about un-awaited tensors on gloo; Megatron's own
``tensor_parallel.mappings`` allocate on CUDA.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` -> ``[n, ...]``: block j of the result is block ``rank`` of rank j's ``x``.

    ``n`` is the group size. Differentiable: the backward is the same exchange, because an
    all-to-all of equal blocks is its own inverse.
    """
    return _AllToAll.apply(x, group)


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[t, ...]`` -> ``[n * t, ...]``: rows ``j*t .. (j+1)*t - 1`` are rank j's ``x``.

    Differentiable: the backward reduce-scatters (sums) the gradient back to its owners.
    """
    return _AllGather.apply(x, group)


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None
