"""FLOPs of one training step: Megatron's dense count plus attention on the pairs the mask keeps.

A matmul of ``[m, n] @ [n, k]`` is ``2 m n k`` FLOPs; backward is twice forward (data and weight
gradients), so a step is 3x forward. Per token and layer, forward (Llama shape, as Megatron's
``num_floating_point_operations`` counts it):

- QKV projection ``2 h (Hq + 2 Hkv) d`` (grouped-query attention), output projection ``2 Hq d h``;
- SwiGLU MLP ``2 h f * 3`` (gate, up, down);
- logits ``2 h V`` once per token (not per layer).

Attention is counted on the (query, key) pairs the mask keeps rather than on ``T^2``: per kept
pair ``4 Hq d`` forward (``q k^T`` and ``p v``). Norms, RoPE, softmax and embeddings are left out,
as Megatron does.

Two counts come out (:class:`StepFlops`): the *model* FLOPs, which MFU is measured by (PaLM's
definition, and Megatron-LM's reported TFLOP/s: what the model needs, however it is run), and the
*hardware* FLOPs, which add the forward work activation recomputation runs again
(``model.recompute=full``: the recomputed layers' forward; ``selective``: the attention core's):
HFU, the work the device does.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

from nemo_anchor.attention.layout import pack_layout
from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.model.config import ModelConfig


class StepFlops(NamedTuple):
    """FLOPs of one optimizer step: ``model`` (3x forward, for MFU) and ``hardware`` (plus recomputation, for HFU)."""

    model: float
    hardware: float


def train_step_flops(model: ModelConfig, vocab_size: int, windows: Iterable[torch.Tensor]) -> StepFlops:
    """FLOPs of one optimizer step over ``windows`` (the ``cu_seqlens`` of every window of the global batch:
    int ``[num_docs + 1]``, ``[0, ..., T]``).

    The attention mask is ``model.attention_type``'s; recomputation follows ``model.recompute``.
    """
    h, d, f = model.hidden_size, model.kv_channels, model.ffn_hidden_size
    hq, hkv, layers = model.num_attention_heads, model.num_query_groups, model.num_layers
    mode = get_attention_type(model.attention_type).mask
    tokens = pairs = 0
    for cu_seqlens in windows:
        tokens += int(cu_seqlens[-1])
        pairs += pack_layout(cu_seqlens).kept_pairs(mode)
    dense_per_layer = tokens * (2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 3 * 2 * h * f)
    core_per_layer = pairs * 4 * hq * d
    logits = tokens * 2 * h * vocab_size
    forward = layers * (dense_per_layer + core_per_layer) + logits
    if model.recompute == "full":
        per_stage = model.recompute_num_layers or layers // model.pipeline_model_parallel_size
        recomputed = per_stage * model.pipeline_model_parallel_size * (dense_per_layer + core_per_layer)
    elif model.recompute == "selective":
        recomputed = layers * core_per_layer
    else:
        recomputed = 0
    return StepFlops(model=float(3 * forward), hardware=float(3 * forward + recomputed))
