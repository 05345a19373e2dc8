"""Layer specs: Megatron's GPT layer spec with ``core_attention`` swapped for ours.

We plug in through ``ModuleSpec`` instead of forking Megatron's layers: the spec is a deep copy
of Megatron's own (local modules, or Transformer Engine modules where TE imports), and only its
``self_attention`` changes: its module is :class:`~nemo_anchor.model.rope.AnchorSelfAttention`
(Megatron's ``SelfAttention``, rotating packed tokens by the positions the packed-sequence
parameters carry) and its ``core_attention`` is ours.
"""
from __future__ import annotations

import copy

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.model.core_attention import AnchorCoreAttention
from nemo_anchor.model.rope import AnchorSelfAttention


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for the local (non-TE) spec, usable with sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism only because it does not mark its
    weight: under sequence parallelism each tensor-parallel rank normalises its own slice of the
    tokens, so the weight's gradient is a partial sum that ``finalize_model_grads`` must all-reduce
    over the tensor-parallel group, which it does for parameters marked ``sequence_parallel``.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def core_attention_spec(attention_type: str, backend: str = "auto") -> ModuleSpec:
    kind = get_attention_type(attention_type)
    return ModuleSpec(module=AnchorCoreAttention, params={"mask": kind.mask, "backend": backend})


def get_layer_spec(attention_type: str, backend: str = "auto", use_transformer_engine: bool | None = None,
                   qk_layernorm: bool = False) -> ModuleSpec:
    """GPT decoder layer spec (RMSNorm, SwiGLU-ready MLP) with AnchorCoreAttention for ``attention_type``.

    ``use_transformer_engine=None`` picks TE's fused linear/norm modules when TE imports.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    from nemo_anchor import gpu

    if use_transformer_engine is None:
        use_transformer_engine = gpu.transformer_engine_pytorch()[0] is not None
    if use_transformer_engine:
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        base = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    spec = copy.deepcopy(base)
    spec.submodules.self_attention.module = AnchorSelfAttention
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(attention_type, backend)
    if not use_transformer_engine:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
        if qk_layernorm:
            attention = spec.submodules.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


def get_block_spec(layer_spec: ModuleSpec, config) -> ModuleSpec | TransformerBlockSubmodules:
    """The decoder of this pipeline stage: ``layer_spec`` repeated, and the final norm to match.

    Megatron picks the final norm itself for a layer spec (TE's, apex's or ``WrappedTorchNorm``);
    local specs name ours so that the whole model supports sequence parallelism.
    """
    if layer_spec.submodules.input_layernorm is not RMSNorm:
        return layer_spec
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)
