"""BF16 training and inference on CPUs without BF16 matrix units, at fp32 matmul speed.

On a CPU without AVX512-BF16 or AMX (this project's 2-core CI machine, most AMD EPYC before Zen 4)
torch's bf16 GEMMs fall back to a slow path: a ``[4096, 576] @ [576, 1536]`` product takes 6.1 s
in bf16 against 70 ms in fp32, and the CPU flash-attention backward is 6x slower in bf16. That
would make every bf16 result on such a machine (the paper's probe, bf16 training) cost hours.

A bf16 GEMM, on a GPU's tensor cores as in torch's CPU kernel, reads bf16 operands, accumulates in
fp32 and rounds the result once to bf16. :func:`bf16_matmuls_in_fp32` computes exactly that with
the fp32 kernels: the operands are bf16 values, so upcasting them is exact, and the fp32 result
is rounded to bf16 once. Only the order of the fp32 accumulation can differ from the native
kernel (measured here: one bf16 ulp in about 0.01% of the elements; ``tests/test_cpu_bf16.py``
bounds it). Every other operation (norms, RoPE, softmax inputs, activations, optimizer casts)
still runs in bf16, so the rounding the paper studies is untouched.

Use it around work on a model: ``with bf16_matmuls_in_fp32(dtype, device): ...``. It does nothing
unless ``dtype`` is bf16 on a CPU without native BF16 matrix instructions, so fp32 and CUDA runs
are untouched.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

_aten = torch.ops.aten

# Ops whose floating outputs all take the dtype of their bf16 inputs: matrix products and the CPU
# flash-attention backward (its forward is as fast in bf16 as in fp32 and returns an fp32
# log-sum-exp, so it stays native). linear and matmul arrive whole under torch.inference_mode
# (inference tensors skip the autograd key where they are otherwise decomposed into mm).
_EMULATED_OPS = frozenset({
    _aten.linear.default,
    _aten.matmul.default,
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})


def cpuinfo(field: str) -> str | None:
    """The value of ``field`` (e.g. ``flags``, ``model name``) for the first CPU in /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo") as lines:
            return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field),
                        None)
    except OSError:
        return None


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has BF16 matrix instructions (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & set((cpuinfo("flags") or "").split()))


def _emulates_bf16(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and not cpu_has_native_bf16()


def _is_cpu_bf16(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.device.type == "cpu"


def _to_fp32(value):
    return value.float() if _is_cpu_bf16(value) else value


def _to_bf16(value):
    return value.bfloat16() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class Bf16MatmulsInFp32(TorchDispatchMode):
    """Runs bf16 CPU matrix products (and the CPU flash-attention backward) as fp32 kernels on bf16 values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _EMULATED_OPS and any(_is_cpu_bf16(a) for a in args):
            out = func(*tree_map(_to_fp32, args), **tree_map(_to_fp32, kwargs))
            return tree_map(_to_bf16, out)
        return func(*args, **kwargs)


def bf16_matmuls_in_fp32(dtype: torch.dtype | str, device: torch.device | str = "cpu"):
    """The context for running a model in ``dtype`` (torch dtype or ``"bf16"``) on ``device``:
    :class:`Bf16MatmulsInFp32` for bf16 on a CPU without native BF16 matrix instructions, else nothing."""
    if dtype in (torch.bfloat16, "bf16") and _emulates_bf16(device):
        return Bf16MatmulsInFp32()
    return contextlib.nullcontext()


def bf16_matmul_kind(device: torch.device | str = "cpu") -> str:
    """How bf16 matrix products run on ``device``, for the records results are written with."""
    if _emulates_bf16(device):
        return "fp32 kernels on bf16 values, rounded to bf16 (nemo_anchor.cpu_bf16)"
    return "native"
