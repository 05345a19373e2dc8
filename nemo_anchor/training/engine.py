"""Megatron-Core's training engine, assembled for packed windows.

What Megatron-LM and NeMo run, built from Megatron-Core's own pieces:

- the model (this pipeline stage of it) in Megatron's ``Float16Module`` for bf16 runs (bf16
  parameters and kernels) and Megatron's ``DistributedDataParallel`` (fp32 gradient buffers,
  bucketed reduction over the data x context-parallel group);
- with CUDA, Megatron-LM's GPU defaults (:func:`megatron_configs`): gradient reduction and the
  distributed optimizer's parameter all-gather overlapped with compute; with Transformer Engine,
  Megatron-LM's fusions (cross-entropy, bias-SwiGLU, RoPE, persistent layer norm, weight-gradient accumulation);
- ``get_megatron_optimizer``: AdamW on fp32 master weights with fp32 state, sharded over the
  data x context-parallel ranks with ``trainer.distributed_optimizer`` (ZeRO-1);
- ``OptimizerParamScheduler`` for warmup and decay;
- one optimizer step as ``get_forward_backward_func`` runs it (micro-batches, pipeline
  schedules), with ``finalize_model_grads`` dividing the summed gradients by the global batch's
  loss-token count: the loss is the mean over every loss token of the global batch, whatever
  the parallel layout.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from nemo_anchor.cpu_bf16 import bf16_matmuls_in_fp32
from nemo_anchor.model.gpt import AnchorTransformerConfig, build_gpt_model, transformer_config
from nemo_anchor.parallel.context_parallel import pads_documents
from nemo_anchor.parallel.distributed import ParallelContext
from nemo_anchor.training.config import RunConfig
from nemo_anchor.training.forward import megatron_forward_step


@dataclass
class Engine:
    model: DistributedDataParallel  # this rank's pipeline stage, wrapped
    optimizer: object  # a MegatronOptimizer
    scheduler: OptimizerParamScheduler

    @property
    def gpt(self):
        """The unwrapped ``GPTModel`` (this pipeline stage)."""
        module = self.model.module
        return module.module if isinstance(module, Float16Module) else module


def megatron_configs(config: RunConfig, device: torch.device
                     ) -> tuple[AnchorTransformerConfig, DistributedDataParallelConfig]:
    """Megatron's model and DDP configs of this run, with Megatron-LM's Llama-recipe defaults on a GPU.

    With CUDA, gradient reduction overlaps the backward and, with the distributed optimizer, the
    parameter all-gather overlaps the next forward (:func:`parameters_gathered` around what reads
    the parameters outside a step); with Transformer Engine, weight-gradient accumulation is fused
    into the GEMMs, and Megatron's fused cross-entropy, bias-SwiGLU, persistent layer norm and RoPE
    (where :func:`nemo_anchor.launch.rope_fusion_allowed`) are on (``nemo_anchor.launch.model_settings``).
    The CPU (gloo) runs every collective synchronously and unfused.
    """
    overlap = device.type == "cuda"
    distributed_optimizer = config.trainer.distributed_optimizer
    model_config = transformer_config(config.model, bf16=config.trainer.precision == "bf16")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer,
    )
    return model_config, ddp_config


def build_engine(config: RunConfig, ctx: ParallelContext, vocab_size: int,
                 initialize: Callable[[torch.nn.Module], None] | None = None) -> Engine:
    """Model, optimizer and scheduler of this rank; ``initialize(gpt)`` sets starting weights (fp32)."""
    bf16 = config.trainer.precision == "bf16"
    model_config, ddp_config = megatron_configs(config, ctx.device)
    gpt = build_gpt_model(config.model, vocab_size, config=model_config, pre_process=ctx.is_first_stage,
                          post_process=ctx.is_last_stage).to(ctx.device)
    if initialize is not None:
        initialize(gpt)  # before the optimizer copies the weights into its fp32 masters
    module = Float16Module(gpt.config, gpt) if bf16 else gpt
    model = DistributedDataParallel(gpt.config, ddp_config, module)
    o, t = config.optim, config.trainer
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.beta1,
        adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad or 0.0, bf16=bf16,
        params_dtype=torch.float32, use_distributed_optimizer=t.distributed_optimizer,
    ), [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(t.max_steps, o.warmup_steps + 1), lr_decay_style=o.schedule, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=t.max_steps, wd_incr_style="constant")
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = model.no_sync
    gpt.config.variable_seq_lengths = _variable_microbatch_length(config)
    return Engine(model, optimizer, scheduler)


@contextlib.contextmanager
def parameters_gathered(engine: Engine):
    """Every parameter complete while the block runs (evaluation, checkpoint saves), as Megatron-LM's loop does.

    With ``overlap_param_gather`` the optimizer step leaves each rank only its own shard updated
    and the forward pre-hooks all-gather the rest during the next forward; here the hooks are
    taken off with a synchronous all-gather, and put back afterwards. Nothing to do otherwise.
    """
    if not engine.model.use_forward_hook:
        yield
        return
    engine.model.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        engine.model.enable_forward_pre_hook()


def _variable_microbatch_length(config: RunConfig) -> bool:
    """True when pipeline stages must send each activation's shape ahead of it (Megatron's
    ``variable_seq_lengths``): context parallelism pads every document of a per-document layout
    to a multiple of 2 x its size, so micro-batches differ in length."""
    m = config.model
    return m.pipeline_model_parallel_size > 1 and pads_documents(m.attention_type, m.context_parallel_size)


def _microbatches(batches: list[dict], between: Callable[[], None] | None):
    """``batches`` as Megatron's schedules draw them, one ``next()`` per micro-batch, ``between()`` called
    before each but the first (it may raise to abandon the step)."""
    for index, batch in enumerate(batches):
        if index and between is not None:
            between()
        yield batch


def run_microbatches(engine: Engine, config: RunConfig, batches: list[dict], *, forward_only: bool,
                     between: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward (and backward) every micro-batch; returns float64 ``[loss sum, loss tokens]`` over the world.

    ``batches`` are this rank's micro-batches (collated, context-parallel sharded, on the device).
    Gradients are reduced and divided by the global token count inside, via ``finalize_model_grads``.
    ``between()`` runs before each micro-batch but the first; an exception it raises leaves the schedule
    there (without pipeline parallelism every rank draws its micro-batches in the same order, so ranks
    that agree in ``between`` leave at the same one, before the gradients of the last are reduced).
    """
    # Megatron's schedules take the full micro-batch length and divide it by the context- (and, with
    # sequence parallelism, tensor-) parallel size for the pipeline's send/recv shapes; batches hold
    # this context-parallel rank's share of the packed tokens
    tokens_per_microbatch = batches[0]["tokens"].numel() * config.model.context_parallel_size
    with bf16_matmuls_in_fp32(config.trainer.precision, batches[0]["tokens"].device):
        reported = get_forward_backward_func()(
            forward_step_func=megatron_forward_step,
            data_iterator=_microbatches(batches, between), model=[engine.model], num_microbatches=len(batches),
            seq_length=tokens_per_microbatch, micro_batch_size=1, forward_only=forward_only)
    totals = torch.zeros(2, dtype=torch.float64, device=batches[0]["tokens"].device)
    # the last stage reports; tensor-parallel ranks hold the same loss, so only one of them counts
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        for entry in reported:
            totals += entry["loss"].double()
    dist.all_reduce(totals)
    return totals


def train_step(engine: Engine, config: RunConfig, batches: list[dict],
               between: Callable[[], None] | None = None) -> dict:
    """One optimizer step over this rank's micro-batches; the returned values are the same on every rank.

    ``between`` (see :func:`run_microbatches`) may abandon the step: the weights, the optimizer and the
    schedule are then as the previous step left them (only the gradient buffers, cleared by the next step,
    hold part of this one)."""
    engine.model.zero_grad_buffer()
    engine.optimizer.zero_grad()
    totals = run_microbatches(engine, config, batches, forward_only=False, between=between)
    engine.scheduler.step(1)  # optimizer step k (1-based) runs at the schedule's lr for k
    updated, grad_norm, _ = engine.optimizer.step()
    if not updated:
        raise FloatingPointError("the optimizer skipped the step (non-finite gradients)")
    return {"loss": float(totals[0] / totals[1]), "lr": engine.optimizer.param_groups[0]["lr"],
            "grad_norm": float(grad_norm), "loss_tokens": int(totals[1])}
