"""What the CUDA kernels ask of their inputs, checked once for every backend: one message per requirement."""
from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def cuda_reason(kernel: str, q: torch.Tensor, *, dtypes: tuple[torch.dtype, ...] = HALF,
                max_head_dim: int | None = None, capabilities: tuple[int, ...] | None = None,
                min_capability: tuple[int, int] | None = None, returns_lse: bool = True) -> str | None:
    """Why ``kernel`` cannot run on queries like ``q``, or None.

    Arguments:
        returns_lse: whether the backend reads the kernel's log-sum-exp (the anchor merge and the backward
            do). On ROCm FlashAttention's varlen kernels return it padded per sequence, ``[B, H, max_q]``,
            where CUDA's are packed ``[H, total_q]``: refused there until that layout is read.
        dtypes: the dtypes it supports.
        max_head_dim: when given, head_dim must also be a multiple of 8 (FlashAttention's tiles).
        capabilities: the compute-capability majors it is built for (9: Hopper, 10: Blackwell).
        min_capability: the oldest compute capability it runs on.
    """
    if not q.is_cuda:
        return f"{kernel} runs on CUDA tensors only, got device {q.device}"
    if returns_lse and torch.version.hip:
        return (f"{kernel} on ROCm (HIP {torch.version.hip}) returns its log-sum-exp as [batch, heads, max_seqlen_q], "
                f"which nemo-anchor does not read yet (it reads CUDA's packed [heads, tokens])")
    if q.dtype not in dtypes:
        return f"{kernel} supports {' and '.join(str(d).removeprefix('torch.') for d in dtypes)} only, got {q.dtype}"
    head_dim = q.shape[-1]
    if max_head_dim is not None and (head_dim > max_head_dim or head_dim % 8):
        return f"{kernel} needs head_dim a multiple of 8 and <= {max_head_dim}, got {head_dim}"
    if capabilities is None and min_capability is None:
        return None
    capability = torch.cuda.get_device_capability(q.device)
    if capabilities is not None and capability[0] not in capabilities:
        return f"{kernel} runs on compute capability {' and '.join(f'{c}.x' for c in capabilities)} only, got {capability}"
    if min_capability is not None and capability < min_capability:
        return f"{kernel} needs compute capability >= {min_capability[0]}.{min_capability[1]}, got {capability}"
    return None
