"""Megatron-Core GPT weights under one spelling, whatever wrote them.

The same Llama-shaped model reaches us under three sets of names:

- ``GPTModel.state_dict()`` of the local spec: per layer, ``decoder.layers.3.input_layernorm.weight``;
- the Transformer-Engine spec, whose fused modules own the norms:
  ``decoder.layers.3.self_attention.linear_qkv.layer_norm_weight`` and
  ``decoder.layers.3.mlp.linear_fc1.layer_norm_weight``;
- ``dist_checkpointing`` checkpoints (ours and NeMo 2's), which always use the TE spelling and
  stack the layers into one tensor with a leading ``num_layers`` axis:
  ``decoder.layers.self_attention.linear_qkv.weight`` ``[L, ...]``.

:func:`canonical_state` turns any of them into the local spelling, one tensor per layer; that
*canonical state* is what the HF conversion reads and writes. Tensors keep Megatron's layouts:
``linear_qkv`` rows grouped per query group ``[q heads of the group; k; v]``, ``linear_fc1`` rows
``[gate; up]``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import torch

from nemo_anchor.export.weight_match import config_key_explainer, match_weights
from nemo_anchor.model.config import ModelConfig

_TE_TO_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LOCAL_TO_TE = {local: te for te, local in _TE_TO_LOCAL.items()}
_STACKED_LAYER_KEY = re.compile(r"^decoder\.layers\.(?!\d)(.+)$")
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def canonical_state(tensors: Mapping[str, torch.Tensor], num_layers: int, *, source: str = "checkpoint") -> dict:
    """Local-spec names, one tensor per layer; ``_extra_state`` entries (TE/FP8 metadata) dropped."""
    state = {}
    for key, value in tensors.items():
        if key.endswith("_extra_state"):
            continue
        stacked = _STACKED_LAYER_KEY.match(key)
        if stacked is None:
            state[_local_name(key)] = value
            continue
        if value.dim() == 0 or value.shape[0] != num_layers:
            raise ValueError(f"{source}: {key} stacks {tuple(value.shape)[:1]} layers, the model config has "
                             f"num_layers={num_layers}")
        for layer, per_layer in enumerate(value.unbind(0)):
            state[_local_name(f"decoder.layers.{layer}.{stacked.group(1)}")] = per_layer
    return state


def _local_name(key: str) -> str:
    layer = _LAYER_KEY.match(key)
    if layer is None:
        return key
    index, rest = layer.groups()
    return f"decoder.layers.{index}.{_TE_TO_LOCAL.get(rest, rest)}"


def expected_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The canonical state of ``cfg``: every name with its shape."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.kv_channels
    qkv_rows = (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    shapes = {"embedding.word_embeddings.weight": (vocab_size, h), "decoder.final_layernorm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["output_layer.weight"] = (vocab_size, h)
    for i in range(cfg.num_layers):
        layer = f"decoder.layers.{i}."
        shapes[layer + "input_layernorm.weight"] = (h,)
        shapes[layer + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
        if cfg.qkv_bias:
            shapes[layer + "self_attention.linear_qkv.bias"] = (qkv_rows,)
        shapes[layer + "self_attention.linear_proj.weight"] = (h, cfg.num_attention_heads * d)
        shapes[layer + "pre_mlp_layernorm.weight"] = (h,)
        shapes[layer + "mlp.linear_fc1.weight"] = (2 * f, h)
        shapes[layer + "mlp.linear_fc2.weight"] = (h, f)
    return shapes


def check_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig, vocab_size: int, *, source: str) -> None:
    """ValueError naming the first mismatched, missing or unused tensor of a canonical state
    (:func:`~nemo_anchor.export.weight_match.match_weights`), with both shapes and the config key."""
    found = {key: tuple(value.shape) for key, value in state.items()}
    if cfg.tie_embeddings:
        found.pop("output_layer.weight", None)  # some writers keep the tied copy
    match_weights(found, expected_shapes(cfg, vocab_size), source=source, explain=_config_key(cfg, vocab_size))


# model config keys that fix a canonical tensor's shape along each axis
_AXIS_KEYS = {
    "word_embeddings": ("vocab_size", "hidden_size"), "output_layer": ("vocab_size", "hidden_size"),
    "linear_qkv": ("(num_attention_heads + 2 x num_query_groups) x kv_channels", "hidden_size"),
    "linear_proj": ("hidden_size", "num_attention_heads x kv_channels"),
    "linear_fc1": ("2 x ffn_hidden_size", "hidden_size"), "linear_fc2": ("hidden_size", "ffn_hidden_size"),
    "layernorm": ("hidden_size",),
}


def _config_key(cfg: ModelConfig, vocab_size: int):
    """``explain(name, axis)``: the model config key (and value) deciding a canonical tensor's shape."""
    values = {"vocab_size": vocab_size, "hidden_size": cfg.hidden_size,
              "(num_attention_heads + 2 x num_query_groups) x kv_channels":
                  f"({cfg.num_attention_heads} + 2 x {cfg.num_query_groups}) x {cfg.kv_channels}",
              "num_attention_heads x kv_channels": f"{cfg.num_attention_heads} x {cfg.kv_channels}",
              "2 x ffn_hidden_size": f"2 x {cfg.ffn_hidden_size}", "ffn_hidden_size": cfg.ffn_hidden_size}
    return config_key_explainer(
        "the model config", _AXIS_KEYS, values, is_layer=_LAYER_KEY.match, layers=f"num_layers={cfg.num_layers}",
        head="output_layer.weight", tied=f"tie_embeddings={cfg.tie_embeddings}",
        fallback=f"{cfg.architecture}, add_qkv_bias={cfg.qkv_bias}")


def split_qkv(fused: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's grouped ``linear_qkv`` rows (weight or bias) -> (q, k, v) rows in head order."""
    groups, d = cfg.num_query_groups, cfg.kv_channels
    per_group = cfg.num_attention_heads // groups
    grouped = fused.reshape(groups, (per_group + 2) * d, *fused.shape[1:])
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *fused.shape[1:]) for t in (q, k, v))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    groups = cfg.num_query_groups
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def load_into_model(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Copy a checked canonical state into a Megatron ``GPTModel``: this rank's shard of it.

    Works for either spec and any tensor/pipeline split: each tensor of the model's own
    ``sharded_state_dict()`` names its global tensor (checkpoint spelling, layer index as a
    prepended axis) and the slice of it this rank holds, which is copied from ``state``.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    filled = set()
    with torch.no_grad():
        for value in model.sharded_state_dict().values():
            if isinstance(value, ShardedTensorFactory):
                parts = value.build()  # e.g. SwiGLU's fc1: gate and up, views into the parameter
                parts = parts if isinstance(parts, (list, tuple)) else [parts]
            elif isinstance(value, ShardedTensor):
                parts = [value]
            else:  # _extra_state and other non-tensor entries
                continue
            for part in parts:
                index = part.global_slice()
                layers, within = index[:part.prepend_axis_num], index[part.prepend_axis_num:]
                if len(layers) > 1:
                    raise ValueError(f"{source}: {part.key} has {len(layers)} prepended axes; expected at most "
                                     f"the layer index")
                name = _local_name(_STACKED_LAYER_KEY.sub(rf"decoder.layers.{layers[0]}.\1", part.key)
                                   if layers else part.key)
                if name not in state:
                    raise ValueError(f"{source}: no weights for {name}")
                full = state[name]
                piece = full[within]  # lazy tensors (hf_slices) read only this slice
                if tuple(piece.shape) != tuple(part.data.shape):
                    raise ValueError(f"{source}: {name} has shape {tuple(full.shape)}, which does not hold "
                                     f"this model's slice {within} of shape {tuple(part.data.shape)}")
                part.data.copy_(piece)
                filled.add(name)
    unused = sorted(set(state) - filled - {"output_layer.weight"})  # tied models own no output layer
    if unused and not _is_pipeline_stage(model):
        raise ValueError(f"{source}: the model has no parameters for {unused[:4]}")


def _is_pipeline_stage(model: torch.nn.Module) -> bool:
    """True when ``model`` holds only some layers (pipeline parallelism): other stages use the rest."""
    return not (getattr(model, "pre_process", True) and getattr(model, "post_process", True))


def build_model(cfg: ModelConfig, vocab_size: int) -> torch.nn.Module:
    """A single-process Megatron GPTModel of ``cfg`` for conversion and inference (fp32 weights).

    Context parallelism and activation recompute are training-time choices and are switched off.
    """
    from nemo_anchor.model.gpt import build_gpt_model
    from nemo_anchor.parallel.distributed import initialize_parallel

    initialize_parallel()
    return build_gpt_model(dataclasses.replace(cfg, context_parallel_size=1, recompute="none"), vocab_size)
