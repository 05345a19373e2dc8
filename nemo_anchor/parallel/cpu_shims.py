"""The one place where Megatron-Core 0.16.1 is taught to run without CUDA.

Megatron's model, DDP, distributed optimizer, gradient clipping, pipeline schedules and
checkpoint writer assume a GPU: they allocate on ``torch.cuda.current_device()`` or
``device='cuda'``, open CUDA streams, synchronise, keep CUDA RNG state, and check
``param.type() == 'torch.cuda.FloatTensor'``. Everything here is installed only when
``torch.cuda.is_available()`` is False, so GPU runs use Megatron untouched, and each shim maps
one CUDA assumption to its CPU equivalent without changing the arithmetic:

- :class:`_TorchOnCpu`: the modules in ``_CUDA_ASSUMING_MODULES`` see a ``torch`` whose CUDA
  device *is* the CPU: factories asked for ``device='cuda'`` allocate on the CPU,
  ``torch.cuda.current_device()`` is the CPU, streams and synchronisation are no-ops.
- RNG tracker: ``CudaRNGStatesTracker`` and activation recompute save/restore CUDA RNG state;
  on the CPU the tracked state is the CPU generator's.
- pinned host tensors: ``torch.tensor(x, pin_memory=True).to("cuda")`` (NeMo's step logging) stays
  an ordinary CPU tensor.
- ``get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory=True`` then ``.cuda()``.
- type checks: the optimizers tell bf16 from fp32 parameters by CUDA tensor type names; inside
  those functions CPU tensors report the CUDA name of their dtype.
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import torch

_installed = False

# Megatron modules (relative to megatron.core) that allocate on, synchronise with or stream on CUDA.
_CUDA_ASSUMING_MODULES = (
    "models.common.embeddings.rotary_pos_embedding",
    "models.common.embeddings.yarn_rotary_pos_embedding",
    "models.gpt.gpt_model",
    "utils",
    "tensor_parallel.layers",
    "tensor_parallel.mappings",
    "tensor_parallel.utils",
    "transformer.transformer_layer",
    "distributed.param_and_grad_buffer",
    "distributed.distributed_data_parallel",
    "distributed.finalize_model_grads",
    "optimizer.optimizer",
    "optimizer.distrib_optimizer",
    "optimizer.clip_grads",
    "pipeline_parallel.schedules",
    "pipeline_parallel.p2p_communication",
    "dist_checkpointing.strategies.filesystem_async",
    "dist_checkpointing.strategies.state_dict_saver",
    "transformer.utils",  # get_default_causal_mask allocates on "cuda" (reached from megatron-core 0.19's forward)
    "timers",  # synchronises CUDA (Megatron-Bridge's training loop times with it)
)


def install_cpu_shims() -> bool:
    """Install every shim once if CUDA is absent; returns whether shims are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        route_cuda_to_cpu(f"megatron.core.{name}" for name in _CUDA_ASSUMING_MODULES)
        _patch_rng_tracker()
        _patch_cp_position_embedding()
        _patch_cuda_type_checks()
        _installed = True
    return True


def route_cuda_to_cpu(module_names) -> None:
    """The named modules (full names) see a ``torch`` whose CUDA device is the CPU (:class:`_TorchOnCpu`)."""
    cpu_torch = _TorchOnCpu()
    for name in module_names:
        importlib.import_module(name).torch = cpu_torch


def _cpu_if_cuda(device):
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _NoStream:
    """A CUDA stream on a machine without one: work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record_event(self, *args, **kwargs):
        return None


class _CudaOnCpu:
    """``torch.cuda`` as a shimmed module sees it: its current device is the CPU."""

    Stream = _NoStream

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def synchronize(*args, **kwargs):
        return None

    @staticmethod
    def empty_cache():
        return None

    # the CPU generator is what the CPU RNG tracker (below) tracks in place of CUDA's
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)

    @staticmethod
    def default_stream(*args, **kwargs):
        return _NoStream()

    current_stream = default_stream

    @staticmethod
    def stream(*args, **kwargs):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


class _TorchOnCpu:
    """``torch`` for a module that assumes CUDA: ``device='cuda'`` and the current CUDA device mean the CPU."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in _FACTORIES:
            return value

        @functools.wraps(value)
        def on_cpu(*args, device=None, pin_memory=False, **kwargs):
            tensor = value(*args, device=_cpu_if_cuda(device), **kwargs)
            return tensor.as_subclass(_HostTensor) if pin_memory else tensor

        return on_cpu


class _HostTensor(torch.Tensor):
    """A tensor asked to be pinned for a copy to CUDA: the copy (``.to("cuda")``, ``.cuda()``) is itself."""

    def to(self, *args, **kwargs):
        args = tuple(_cpu_if_cuda(a) if isinstance(a, (str, torch.device)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)

    def cuda(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Tracks named CPU generator states where Megatron tracks CUDA ones."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def cpu_manual_seed(seed, te_rng_tracker=False, inference_rng_tracker=False, *_, **__):
        mrandom.initialize_rng_tracker()
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.model_parallel_cuda_manual_seed = cpu_manual_seed
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed = cpu_manual_seed


def _patch_cp_position_embedding() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])

    rope_utils.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


_CUDA_TYPE_NAMES = {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                    torch.bfloat16: "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def _cpu_tensors_report_cuda_types():
    """Within the block ``tensor.type()`` names a CPU float tensor as its CUDA counterpart."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not self.is_cuda and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_cuda_type_checks() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    def reporting_cuda_types(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            with _cpu_tensors_report_cuda_types():
                return function(*args, **kwargs)

        return wrapper

    # the functions that branch on or assert CUDA type names (megatron-core 0.16.1)
    for owner, name in ((distrib_optimizer.DistributedOptimizer, "__init__"),
                        (optimizer.Float16OptimizerWithFloat16Params, "__init__")):
        original = owner.__dict__[name]
        if isinstance(original, (staticmethod, classmethod)):
            setattr(owner, name, type(original)(reporting_cuda_types(original.__func__)))
        else:
            setattr(owner, name, reporting_cuda_types(original))
    clip_grads.clip_grad_by_total_norm_fp32 = reporting_cuda_types(clip_grads.clip_grad_by_total_norm_fp32)
    for module in (optimizer, distrib_optimizer):
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
