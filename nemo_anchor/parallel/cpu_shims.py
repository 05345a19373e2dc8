"""The one place where Megatron-Core 0.16.1 is taught to run without CUDA.

Megatron assumes a GPU in a handful of spots that matter for training on the CPU (each found by
running our tests on a CPU-only machine). Each shim below replaces exactly one of them with its CPU equivalent and is
installed only when ``torch.cuda.is_available()`` is False, so GPU runs use Megatron untouched.

- RNG tracker: ``CudaRNGStatesTracker`` and activation recompute save/restore CUDA RNG state;
  on the CPU the tracked state is the CPU generator's.
- ``RotaryEmbedding.get_emb`` / ``YarnRotaryEmbedding.forward`` move ``inv_freq`` to
  ``torch.cuda.current_device()`` on first use.
- ``get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory=True`` then ``.cuda()``.
- ``GlobalMemoryBuffer`` (scratch of Megatron's own ``DotProductAttention``) allocates on CUDA.
- ``dist_checkpointing`` saving calls ``torch.cuda.synchronize`` / ``torch.cuda.current_device``.
"""
from __future__ import annotations

import functools

import torch

_installed = False


def install_cpu_shims() -> bool:
    """Install every shim once if CUDA is absent; returns whether shims are active."""
    global _installed
    if torch.cuda.is_available():
        return False
    if not _installed:
        _patch_rng_tracker()
        _patch_rotary_embedding()
        _patch_cp_position_embedding()
        _patch_global_memory_buffer()
        _patch_checkpoint_saving()
        _installed = True
    return True


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

    def cpu_manual_seed(seed, te_rng_tracker=False, inference_rng_tracker=False, **_):
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


def _patch_rotary_embedding() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    def keep_on_cpu(method):
        # Megatron only moves these buffers while they sit on the CPU; reporting a non-CPU
        # device type during the call skips the move and leaves the math unchanged.
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            with _cuda_device_is_cpu():
                return method(self, *args, **kwargs)

        return wrapper

    rotary_pos_embedding.RotaryEmbedding.get_emb = keep_on_cpu(rotary_pos_embedding.RotaryEmbedding.get_emb)
    yarn = yarn_rotary_pos_embedding.YarnRotaryEmbedding
    yarn.forward = functools.lru_cache(maxsize=32)(keep_on_cpu(yarn.forward.__wrapped__))


class _cuda_device_is_cpu:
    """Within the block, ``tensor.to(device=torch.cuda.current_device())`` stays on the CPU."""

    def __enter__(self):
        self._saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"

    def __exit__(self, *exc):
        torch.cuda.current_device = self._saved


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


def _patch_global_memory_buffer() -> None:
    from megatron.core import utils

    original = utils.GlobalMemoryBuffer.get_tensor

    @functools.wraps(original)
    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        with _cuda_device_is_cpu():
            return original(self, tensor_shape, dtype, name, mem_alloc_context)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor


def _patch_checkpoint_saving() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver

    class _TorchWithoutCudaSync:
        """``torch`` as seen by the async writer, whose only CUDA call is a synchronize."""

        def __getattr__(self, name):
            return getattr(torch, name)

        class cuda:  # noqa: N801 - mirrors torch.cuda
            @staticmethod
            def synchronize(*_args, **_kwargs):
                return None

            @staticmethod
            def current_device():
                return "cpu"

            def __getattr__(self, name):
                return getattr(torch.cuda, name)

    filesystem_async.torch = _TorchWithoutCudaSync()
    state_dict_saver.torch = _TorchWithoutCudaSync()
