"""What the devices decide, decided by the process that trains on them, never by the one that builds the recipe.

Cluster users build a NeMo-Run recipe or a Megatron-Bridge ``ConfigContainer`` on a login node without
GPUs and train it elsewhere. So the recipes leave every device-dependent setting unset (``None``) and
the training process fills it here from the devices it sees:

- Megatron-LM's Llama-recipe fusions (:data:`nemo_anchor.gpu.FUSIONS`): on with CUDA and Transformer Engine, RoPE's
  only where :func:`~nemo_anchor.model.rope.rope_fusion_allowed`; off on the CPU;
- gradient reduction overlapped with the backward and the distributed optimizer's parameter
  all-gather with the next forward, and asynchronous checkpoint saves: with CUDA;
- bf16 mixed precision with CUDA, fp32 on the CPU (the NeMo and Bridge front doors; ``nemo-anchor
  train`` takes ``trainer.precision`` as written);
- the process-group backend: NCCL with CUDA, gloo without.

A value the user set is kept. What the CPU cannot run at all is turned off whatever was asked:
Transformer Engine's fused RoPE and persistent norm without TE, weights allocated on a GPU without CUDA.
"""
from __future__ import annotations

import torch

from nemo_anchor import gpu
from nemo_anchor.model.rope import rope_fusion_allowed

# fused kernels that only Transformer Engine provides (Megatron's local spec computes the same unfused)
_TE_ONLY = ("apply_rope_fusion", "persist_layer_norm")


def cuda() -> bool:
    """Whether this process sees a CUDA device."""
    return torch.cuda.is_available()


def resolve_model_config(config) -> None:
    """Fill a Megatron ``TransformerConfig``'s unset fusions (None) and its CPU initialisation in place.

    Raises:
        ValueError: ``apply_rope_fusion`` set on a model whose RoPE the fused kernel gets wrong (YaRN, ``rope_in_fp32``).
    """
    allowed = rope_fusion_allowed(config)
    if config.apply_rope_fusion and not allowed:
        raise ValueError("apply_rope_fusion=True with YaRN or rope_in_fp32: Megatron's fused THD RoPE drops YaRN's "
                         "attention scaling, and rope_in_fp32 asks for the unfused fp32 rotation; leave it unset")
    for name, value in gpu.fusions(rope_allowed=allowed).items():
        if getattr(config, name) is None:
            setattr(config, name, value)
    if gpu.transformer_engine_pytorch()[0] is None:
        for name in _TE_ONLY:
            setattr(config, name, False)
    if not cuda():
        config.use_cpu_initialization = True  # Megatron would otherwise allocate the weights on a GPU


def resolve_ddp_config(ddp) -> None:
    """Fill a Megatron ``DistributedDataParallelConfig``'s unset overlaps (None) in place: on with CUDA,
    the parameter all-gather's only with the distributed optimizer (whose all-gather it is)."""
    if ddp.overlap_grad_reduce is None:
        ddp.overlap_grad_reduce = cuda()
    if ddp.overlap_param_gather is None:
        ddp.overlap_param_gather = cuda() and ddp.use_distributed_optimizer


def mixed_precision() -> str:
    """The precision a recipe that leaves it unset trains in here: NeMo / Lightning's names."""
    return "bf16-mixed" if cuda() else "32"


def backend() -> str:
    """The ``torch.distributed`` backend for this process's devices."""
    return "nccl" if cuda() else "gloo"


def async_save() -> bool:
    """Whether checkpoints can be written asynchronously here (Megatron's async writer needs CUDA)."""
    return cuda()


AUTO = "auto"  # a Megatron-Bridge recipe's mixed_precision / dist.distributed_backend left to the devices


def resolve_bridge_config(config) -> None:
    """Fill a Megatron-Bridge ``ConfigContainer``'s unset device choices in place, before its ``pretrain()``.

    ``mixed_precision`` and ``dist.distributed_backend`` "auto", the DDP overlaps and
    ``checkpoint.async_save`` None (``nemo_anchor.bridge.recipes`` leaves them so). The model's
    choices are the provider's ``finalize()``, which ``pretrain()`` calls.
    """
    if config.mixed_precision == AUTO:
        config.mixed_precision = "bf16_mixed" if cuda() else None
    if config.dist.distributed_backend == AUTO:
        config.dist.distributed_backend = backend()
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        # megatron-core 0.19's distributed optimizer over torch's Adam (no Apex or TE Adam, as on the CPU) does not
        # reload its state exactly (its sharded_state_dict(is_loading=True), distrib_optimizer.py:1532, needs the
        # state to exist first; allocated at step 0 a 3-step run resumed to 6 left step 5 off): the plain optimizer
        config.optimizer.use_distributed_optimizer = config.ddp.use_distributed_optimizer = False
    resolve_ddp_config(config.ddp)
    if config.checkpoint.async_save is None:
        config.checkpoint.async_save = async_save() and config.checkpoint.save is not None
