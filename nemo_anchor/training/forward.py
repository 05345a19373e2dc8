"""The forward step of one micro-batch of packed windows: ONE definition for both trainers.

``nemo-anchor train`` (``nemo_anchor.training.engine``, through Megatron's
``get_forward_backward_func``) and NeMo's ``llm.pretrain`` (``nemo_anchor.training.mixin``, through
the config's ``forward_step_fn``) run a micro-batch through :func:`forward_step`, so the two can
only differ in how they reduce the per-token loss, never in what the model sees. Nothing here
imports NeMo.
"""
from __future__ import annotations

import functools
from typing import Iterator

import torch
from megatron.core import parallel_state

from nemo_anchor.model.gpt import packed_forward


def context_parallel_group():
    """This rank's context-parallel group, or None when there is no context parallelism."""
    if parallel_state.get_context_parallel_world_size() > 1:
        return parallel_state.get_context_parallel_group()
    return None


def forward_step(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token loss ``[B, T]`` of a collated (and context-parallel sharded) batch, run as one THD pack.

    ``model`` is anything whose ``config`` carries ``anchor_attention_type`` and whose call takes
    Megatron ``GPTModel``'s arguments: a ``GPTModel``, Megatron's DDP / ``Float16Module`` around
    one, or NeMo's ``llm.GPTModel``.
    """
    return packed_forward(model, batch, context_parallel_group())


def masked_loss_sum(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """(sum of the masked per-token loss, its token count, the two for reporting): Megatron's per-token loss contract."""
    mask = loss_mask.float().reshape(-1)
    loss_sum = (per_token_loss.float().reshape(-1) * mask).sum()
    tokens = mask.sum()
    return loss_sum, tokens.to(torch.int), {"loss": torch.stack([loss_sum.detach(), tokens])}


def megatron_forward_step(data_iterator: Iterator[dict], model):
    """Megatron's ``forward_step_func``: :func:`forward_step` and its masked loss sum."""
    batch = next(data_iterator)
    return forward_step(model, batch), functools.partial(masked_loss_sum, batch["loss_mask"])
