"""Process groups: torchrun (env://) or a single local process, then Megatron's parallel state."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nemo_anchor.parallel.cpu_shims import install_cpu_shims


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    data_parallel_rank: int
    data_parallel_size: int
    context_parallel_size: int
    device: torch.device

    @property
    def cp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_parallel(context_parallel_size: int = 1, seed: int = 1234) -> ParallelContext:
    """Initialise torch.distributed (gloo on the CPU, nccl on GPUs) and Megatron's groups.

    Under torchrun the environment gives rank and world size; otherwise this is a world of one.
    Idempotent for the same ``context_parallel_size``.
    """
    from megatron.core import parallel_state, tensor_parallel

    install_cpu_shims()
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend)
        else:  # no torchrun: a world of one, without leaving rendezvous variables for child processes
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    if world % context_parallel_size:
        raise ValueError(
            f"model.context_parallel_size={context_parallel_size} must divide the world size {world}: "
            f"launch a multiple of {context_parallel_size} processes (torchrun --nproc_per_node)")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_context_parallel_world_size() != context_parallel_size:
            parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(context_parallel_size=context_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        context_parallel_size=context_parallel_size,
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
    )
