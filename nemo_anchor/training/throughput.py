"""Achieved TFLOP/s per device, MFU and HFU (model and hardware FLOPs utilisation), and the peak they are measured against.

The peak is ``trainer.peak_tflops`` when set; otherwise the published dense bf16 peak of a known
GPU (bf16 runs), else a short matmul measurement on the device in the training precision (the
CPU, fp32 runs, unknown GPUs). The step's FLOPs come from :func:`nemo_anchor.model.flops.train_step_flops`:
``tflops_per_device`` and ``mfu`` count the model's FLOPs only (as Megatron-LM and PaLM report them), ``hfu``
adds the forward work activation recomputation runs again.
"""
from __future__ import annotations

import json
import platform
import time

import torch

from nemo_anchor.atomic import OutputError, atomic_file, file_lock
from nemo_anchor.cache import cache_root
from nemo_anchor.cpu_bf16 import bf16_matmuls_in_fp32, cpuinfo
from nemo_anchor.data import PackedDataset
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.flops import StepFlops, train_step_flops

# dense (no sparsity) bf16 tensor-core peaks from the vendor's data sheets, in TFLOP/s; the first
# name contained in torch.cuda.get_device_name() wins, so the more specific names come first
PUBLISHED_BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0),
    ("A100", 312.0), ("A10", 125.0), ("L40S", 362.0), ("L4", 121.0),
)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def published_peak_tflops(device_name: str) -> float | None:
    return next((peak for name, peak in PUBLISHED_BF16_PEAK_TFLOPS if name in device_name), None)


def measure_matmul_tflops(device: torch.device, precision: str, seconds: float = 0.2) -> float:
    """TFLOP/s of square matmuls in ``precision`` (bf16 | fp32) on ``device``: the fastest of the calls made
    in about ``seconds``, so that a burst of load from other processes does not lower the peak (an MFU
    measured against a lowered peak can exceed 100%).

    Sizes: 512 on the CPU, 8192 on a GPU. bf16 on a CPU without native bf16 matmuls is measured as
    training runs it there (:mod:`nemo_anchor.cpu_bf16`).
    """
    n = 512 if device.type == "cpu" else 8192
    a, b = (torch.randn(n, n, device=device).to(DTYPES[precision]) for _ in range(2))
    fastest, started = float("inf"), time.perf_counter()
    with bf16_matmuls_in_fp32(DTYPES[precision], device):  # what training in that precision runs
        torch.matmul(a, b)  # warm-up: kernel selection, packing buffers
        calls = 0
        while calls < 3 or time.perf_counter() - started < seconds:
            start = time.perf_counter()
            torch.matmul(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            fastest = min(fastest, time.perf_counter() - start)
            calls += 1
    return 2 * n ** 3 / fastest / 1e12


def resolve_peak_tflops(configured: float | None, device: torch.device, precision: str) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it comes from) for a run in ``precision`` on ``device``."""
    if configured is not None:
        return float(configured), "trainer.peak_tflops"
    if device.type == "cuda" and precision == "bf16":
        name = torch.cuda.get_device_name(device)
        published = published_peak_tflops(name)
        if published is not None:
            return published, f"published dense bf16 peak of {name}"
    measured = measure_matmul_tflops(device, precision)
    if device.type == "cpu":
        return remembered_cpu_peak(precision, measured)
    return measured, f"{precision} matmul measured on {device.type} at start"


def remembered_cpu_peak(precision: str, measured: float) -> tuple[float, str]:
    """The fastest ``precision`` matmul rate seen on this CPU model at this thread count: ``measured`` or a
    faster one from an earlier run, kept in ``cache_root() / cpu_peak_tflops.json``.

    A measurement taken while other processes load the CPU comes out low, and MFU against it high
    (above 100% when the load lifts); the machine's peak is the fastest it has shown.
    """
    path = cache_root() / "cpu_peak_tflops.json"
    key = f"{cpuinfo('model name') or platform.processor() or 'cpu'}, {torch.get_num_threads()} threads, {precision}"
    try:
        # every rank of a run, on every host sharing the cache, reads, compares and writes: one at a time,
        # or a slower rank's write would undo a faster one's
        with file_lock(path.with_name(path.name + ".lock")):
            return _remember_faster(path, key, precision, measured)
    except (OSError, OutputError):  # a read-only cache only loses the memory
        return measured, f"{precision} matmul measured on cpu at start"


def _remember_faster(path, key: str, precision: str, measured: float) -> tuple[float, str]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}  # a damaged cache is measured again
    remembered = float(known.get(key, 0.0))
    if measured <= remembered:
        return remembered, f"fastest {precision} matmul measured on this CPU ({path})"
    with atomic_file(path) as staging:
        staging.write_text(json.dumps({**known, key: measured}, indent=1))
    return measured, f"{precision} matmul measured on cpu at start (remembered in {path})"


def faster_cpu_precision(seconds: float = 0.2) -> tuple[str, dict[str, float]]:
    """The precision (bf16 | fp32) whose matmuls run faster on this CPU, and the TFLOP/s measured for each."""
    measured = {p: measure_matmul_tflops(torch.device("cpu"), p, seconds) for p in ("fp32", "bf16")}
    return max(measured, key=measured.get), measured


def global_batch_flops(model: ModelConfig, vocab_size: int, dataset: PackedDataset, windows: list[int]) -> StepFlops:
    """FLOPs of one optimizer step over the windows ``windows`` of ``dataset`` (the whole global batch)."""
    return train_step_flops(model, vocab_size, [torch.from_numpy(dataset.window_cu_seqlens(i)) for i in windows])


def rates(flops: StepFlops, seconds: float, devices: int, peak_tflops: float) -> dict[str, float]:
    """Of ``flops`` done in ``seconds`` on ``devices``: ``tflops_per_device`` (model FLOPs), ``mfu`` and ``hfu``
    (model and hardware FLOPs per second as fractions of ``peak_tflops``)."""
    achieved = flops.model / seconds / devices / 1e12
    return {"tflops_per_device": achieved, "mfu": achieved / peak_tflops,
            "hfu": flops.hardware / seconds / devices / 1e12 / peak_tflops}
