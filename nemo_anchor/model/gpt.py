"""A Megatron-Core ``GPTModel`` in the Llama shape with an AnchorAttention layer spec.

Llama shape: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, no biases (Qwen2: qkv bias),
untied embeddings by default. Packed windows go in as THD (``packed_forward``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_attr_wrapped_model

from nemo_anchor import launch
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.packed_seq import make_packed_seq_params
from nemo_anchor.model.spec import get_block_spec, get_layer_spec
from nemo_anchor.model.vocab import PaddedVocabGPTModel, padded_vocab_size


@dataclass
class YarnFields:
    """What Megatron's ``GPTModel`` reads from its config for ``position_embedding_type="yarn"``, which
    ``TransformerConfig`` does not declare; shared by our config and the NeMo / Bridge configs."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True


@dataclass
class AnchorTransformerConfig(YarnFields, TransformerConfig):
    """Megatron's config plus the fields our layers and YaRN read."""

    anchor_attention_type: str = "anchor"  # nemo_anchor.attention.paradigms name; fixes mask and RoPE restarts
    rope_in_fp32: bool = False


def _recompute_settings(cfg: ModelConfig) -> dict:
    """Megatron's recompute fields for ``model.recompute`` (and ``recompute_num_layers``)."""
    if cfg.recompute == "selective":  # the attention core only: Megatron's default selective module
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if cfg.recompute == "full":  # whole layers; "block": the first N layers of each stage, the rest keep activations
        per_stage = cfg.num_layers // cfg.pipeline_model_parallel_size
        return {"recompute_granularity": "full", "recompute_method": "block",
                "recompute_num_layers": cfg.recompute_num_layers or per_stage}
    return {}


def transformer_config(cfg: ModelConfig, *, bf16: bool = False,
                       device_settings: dict[str, bool] | None = None) -> AnchorTransformerConfig:
    """Megatron's config of the model, with what this process's devices decide (``nemo_anchor.launch``: the
    fusions of Megatron-LM's Llama recipes on a GPU with Transformer Engine, RoPE's where it is exact; the
    fused weight-gradient accumulation writes Megatron's DDP's ``main_grad``, which every door trains with).

    ``device_settings``: :data:`nemo_anchor.launch.DECIDED_AT_LAUNCH` as given, the devices unasked, for a recipe
    built where it does not train (Bridge's provider leaves them to its training process)."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    return AnchorTransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
        bf16=bf16,
        params_dtype=torch.float32,  # built in fp32; bf16 runs wrap the model in Megatron's Float16Module
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        perform_initialization=True,
        **(device_settings or launch.model_settings(rope_allowed=launch.rope_fusion_allowed(cfg))),
        masked_softmax_fusion=False,  # the core attention computes its own softmax
        bias_dropout_fusion=False,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cfg.context_parallel_size,
        cp_comm_type=cfg.cp_comm_type,
        # the loss is a sum over tokens, divided by the global batch's token count in finalize_model_grads
        calculate_per_token_loss=True,
        anchor_attention_type=cfg.attention_type,
        rope_in_fp32=cfg.rope_in_fp32,
        # Megatron applies YaRN's attention temperature whenever this factor is not 1, even for plain
        # RoPE, so it must stay 1 unless YaRN is on (NTK is folded into the base instead).
        yarn_rotary_scaling_factor=cfg.rope_scaling_factor if cfg.rope_scaling == "yarn" else 1.0,
        yarn_original_max_position_embeddings=cfg.original_max_position_embeddings,
        **_recompute_settings(cfg),
    )


def build_gpt_model(cfg: ModelConfig, vocab_size: int, *, bf16: bool = False, spec_backend_te: bool | None = None,
                    pre_process: bool = True, post_process: bool = True,
                    config: AnchorTransformerConfig | None = None) -> GPTModel:
    """Build the model, or this pipeline stage of it (``pre_process``: embeddings, ``post_process``: logits).

    ``vocab_size`` is the true vocabulary: a tensor-parallel split it does not divide pads it, and the
    padding stays out of the logits and the checkpoints (:mod:`nemo_anchor.model.vocab`).
    Megatron's parallel state must be initialised with the config's sizes (``nemo_anchor.parallel``).
    Parameters are fp32; ``bf16`` only records the compute dtype (wrap in ``Float16Module`` to cast).
    ``config``: Megatron's config to build with, default ``transformer_config(cfg, bf16=bf16)``.
    """
    if config is None:
        config = transformer_config(cfg, bf16=bf16)
    padded = padded_vocab_size(vocab_size, cfg.tensor_model_parallel_size)
    padding = {} if padded == vocab_size else {"true_vocab_size": vocab_size}
    return (PaddedVocabGPTModel if padding else GPTModel)(
        **padding,
        config=config,
        transformer_layer_spec=get_block_spec(get_layer_spec(cfg.attention_type, cfg.attention_backend,
                                                             spec_backend_te), config),
        vocab_size=padded,
        max_sequence_length=cfg.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="yarn" if cfg.rope_scaling == "yarn" else "rope",
        rotary_base=cfg.resolved_rotary_base(),
        rope_scaling=cfg.rope_scaling == "llama3",
        rope_scaling_factor=cfg.rope_scaling_factor,
    )


def packed_forward(model: GPTModel, batch: dict, cp_group=None) -> torch.Tensor:
    """Run B packed windows as one THD sequence; returns the per-token loss ``[B, T]`` (fp32).

    ``batch`` is ``nemo_anchor.data.collate_windows`` output (tokens/labels/position_ids
    ``[B, T]``, ``cu_seqlens``/``cu_windows`` int32 over the flattened tokens, and their host
    ``layout`` when ``batch_for_this_rank`` made the batch). With ``labels``
    absent, returns logits ``[B, T, V]`` instead. A pipeline stage before the last returns its hidden
    states unchanged.
    """
    tokens = batch["tokens"]
    b, t = tokens.shape
    params = make_packed_seq_params(batch["cu_seqlens"], batch["cu_windows"], model.config.anchor_attention_type,
                                    cp_group, layout=batch.get("layout"))
    labels = batch.get("labels")
    out = model(
        input_ids=tokens.reshape(1, b * t),
        position_ids=batch["position_ids"].reshape(1, b * t),
        attention_mask=None,
        labels=None if labels is None else labels.reshape(1, b * t),
        packed_seq_params=params,
    )
    if not get_attr_wrapped_model(model, "post_process"):
        return out  # a pipeline stage's hidden states [s, b, h], sent to the next stage as they are
    return out.float().reshape(b, t, *out.shape[2:])
