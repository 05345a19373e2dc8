"""Process groups: torchrun (env://) or a single local process, then Megatron's parallel state.

The world is split as Megatron splits it: tensor x context x data x pipeline parallel ranks
(``parallel_state.initialize_model_parallel``). Collectives run on the run's device: NCCL and
CUDA tensors on GPUs, gloo and CPU tensors otherwise.

Every group waits at most ``trainer.distributed_timeout_minutes`` (:data:`DEFAULT_TIMEOUT_MINUTES`, Megatron-LM's
and Megatron-Bridge's ``distributed_timeout_minutes`` default) in one collective: a rank that stops making progress
(hung, stopped, its node frozen) makes the others fail that long after, instead of waiting forever (torchrun does
not detect hangs). :func:`collective_timed_out` recognises that failure, so the trainer can say it in one line.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nemo_anchor.parallel.cpu_shims import install_cpu_shims

# Megatron-LM's --distributed-timeout-minutes and Megatron-Bridge's dist.distributed_timeout_minutes default
DEFAULT_TIMEOUT_MINUTES = 10.0
# how gloo and NCCL word a collective that outlived its group's timeout
_TIMEOUT_WORDS = ("Timed out waiting", "collective operation timeout")


@dataclass(frozen=True)
class ParallelSizes:
    """How the world is split; the data-parallel size is what is left."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel size in a world of ``world_size``; ValueError naming the fix if it does not divide."""
        if world_size % self.model_parallel:
            raise ValueError(
                f"model.tensor_model_parallel_size={self.tensor} x model.pipeline_model_parallel_size="
                f"{self.pipeline} x model.context_parallel_size={self.context} = {self.model_parallel} must "
                f"divide the number of processes ({world_size}): launch a multiple of {self.model_parallel} "
                f"processes (torchrun --nproc_per_node/--nnodes) or choose sizes whose product divides "
                f"{world_size}; the data-parallel size is what is left")
        return world_size // self.model_parallel


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    sizes: ParallelSizes
    data_parallel_rank: int
    data_parallel_size: int
    tensor_parallel_rank: int
    pipeline_parallel_rank: int
    device: torch.device

    @property
    def context_parallel_size(self) -> int:
        return self.sizes.context

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_parallel_rank == self.sizes.pipeline - 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective that waited longer than its group's timeout for another rank (gloo raises
    it in the waiting rank; NCCL's watchdog aborts the process, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default)."""
    return isinstance(error, RuntimeError) and any(words in str(error) for words in _TIMEOUT_WORDS)


def initialize_parallel(context_parallel_size: int = 1, seed: int = 1234, *, tensor_parallel_size: int = 1,
                        pipeline_parallel_size: int = 1,
                        timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> ParallelContext:
    """Initialise torch.distributed (gloo on the CPU, nccl on GPUs) and Megatron's groups, each collective waiting at
    most ``timeout_minutes`` for the other ranks (a group made earlier in this process keeps its own).

    Under torchrun the environment gives rank and world size; otherwise this is a world of one.
    Re-initialises Megatron's groups when the requested sizes differ from the current ones.
    Where CUDA is expected and torch sees none, raises :class:`nemo_anchor.launch.CudaExpected` first.
    """
    from megatron.core import parallel_state, tensor_parallel

    from nemo_anchor import launch

    install_cpu_shims()
    sizes = ParallelSizes(tensor_parallel_size, pipeline_parallel_size, context_parallel_size)
    cuda = launch.cuda()  # stops where CUDA is expected and absent, unless the CPU was chosen
    if not dist.is_initialized():
        parallel_state.destroy_model_parallel()  # groups of an earlier, destroyed default group are stale
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # no torchrun: a world of one, without leaving rendezvous variables for child processes
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    data_parallel_size = sizes.data_parallel(world)
    if parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size()) != (sizes.tensor, sizes.pipeline, sizes.context):
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tensor, pipeline_model_parallel_size=sizes.pipeline,
            context_parallel_size=sizes.context, distributed_timeout_minutes=timeout_minutes)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world,
        sizes=sizes,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=data_parallel_size,
        tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        pipeline_parallel_rank=parallel_state.get_pipeline_model_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
    )


def ensure_initialized() -> None:
    """A process group and Megatron's groups for readers of checkpoints (export, inference).

    Leaves an existing setup alone: a trainer reading its starting weights keeps its own
    tensor/pipeline/context split.
    """
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        initialize_parallel()
