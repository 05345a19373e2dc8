"""Layer specs: Megatron's GPT layer spec with ``core_attention`` swapped for ours.

We plug in through ``ModuleSpec`` instead of forking Megatron's layers: the spec is a deep copy
of Megatron's own (local modules, or Transformer Engine modules where TE imports), and only its
``self_attention.submodules.core_attention`` changes.
"""
from __future__ import annotations

import copy

from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.model.core_attention import AnchorCoreAttention


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
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec(attention_type, backend)
    return spec
