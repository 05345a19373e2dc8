"""Our ``model:`` section (:class:`~nemo_anchor.model.config.ModelConfig`) of a Megatron ``TransformerConfig``:
ONE converter for every config that describes a Llama-shaped Megatron GPT.

It reads a NeMo 2 config (``nemo_anchor.nemo.config``'s or NeMo's own), a Megatron-Bridge provider, or the
``config:`` entry of a NeMo 2 checkpoint's ``context/model.yaml`` (a dict, callables serialised as
``{_target_: ...}``). NeMo's HF exporters, ``export-hf`` of NeMo 2 checkpoints and the FLOP counts of
``llm.pretrain`` and Bridge's ``pretrain()`` all go through :func:`model_config_from_megatron`; its inverse
is :func:`nemo_anchor.model.gpt.transformer_config`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from nemo_anchor.model.config import LLAMA3_ROPE, ModelConfig

# The model family from the config's class (or a base class) name: NeMo's and ours
_ARCHITECTURES = (("Qwen2", "qwen2"), ("Mistral", "mistral"), ("Llama", "llama"))
# NeMo config classes with Llama 3.x RoPE scaling: their factors are class attributes, absent from model.yaml
_SCALED_ROPE = ("Llama31", "Llama32")
# what a Llama-shaped GPT is: anything else would convert without error and compute another model
_REQUIRED = (("normalization", "RMSNorm"), ("gated_linear_unit", True), ("activation_func", "silu"))


def model_config_from_megatron(config: Any, *, source: str = "model config",
                               default_architecture: Optional[str] = None) -> ModelConfig:
    """``ModelConfig`` of ``config`` (an object with ``TransformerConfig``'s fields, or a NeMo 2 ``config:`` dict).

    ``source`` names the config in errors (ValueError: ``{source}: config.KEY ...``). The family comes from
    the class name; ``default_architecture`` is used when it names none (a Bridge provider).
    """
    if isinstance(config, Mapping):
        def get(key, default=None):
            return config.get(key, default)
        target = str(config.get("_target_", ""))
        class_names = [target.rsplit(".", 1)[-1]]
    else:
        def get(key, default=None):
            return getattr(config, key, default)
        target = f"{type(config).__module__}.{type(config).__qualname__}"
        class_names = [cls.__name__ for cls in type(config).__mro__]

    def value_of(key):
        value = get(key)
        if isinstance(value, Mapping):  # callables are serialised as {_target_: module.function, ...}
            value = str(value.get("_target_", "")).rsplit(".", 1)[-1]
        return getattr(value, "__name__", value) if callable(value) else value

    def required(key):
        value = get(key)
        if value is None:
            raise KeyError(key)
        return value

    def need(key, *expected):
        value = value_of(key)
        if value not in expected:
            raise ValueError(f"{source}: config.{key}={value!r} is not supported (expected {expected[0]!r})")

    architecture = next((arch for marker, arch in _ARCHITECTURES if any(marker in name for name in class_names)),
                        default_architecture)
    if architecture is None:
        raise ValueError(f"{source}: unknown architecture {target!r}; supported: NeMo Llama, Mistral and "
                         f"Qwen2 configs and nemo_anchor.nemo's")
    scaling = {}
    if any(marker in name for marker in _SCALED_ROPE for name in class_names):
        if get("scale_factor") is None or get("old_context_len") is None:
            raise ValueError(f"{source}: config._target_={target!r} is not supported: its Llama 3.1/3.2 RoPE "
                             f"scaling is not read from NeMo configs; export it to Hugging Face with NeMo and "
                             f"import that")
        scaling = dict(rope_scaling="llama3", rope_scaling_factor=get("scale_factor"),
                       original_max_position_embeddings=get("old_context_len"))
    elif get("rope_scaling") is True:  # a Bridge provider's Llama 3.x scaling
        scaling = dict(rope_scaling="llama3", rope_scaling_factor=get("rope_scaling_factor"),
                       original_max_position_embeddings=LLAMA3_ROPE["original_max_position_embeddings"])
    for key, expected in _REQUIRED:
        need(key, expected)
    need("position_embedding_type", "rope", "yarn")
    try:
        if value_of("position_embedding_type") == "yarn":
            scaling = dict(rope_scaling="yarn", rope_scaling_factor=required("yarn_rotary_scaling_factor"),
                           original_max_position_embeddings=required("yarn_original_max_position_embeddings"))
        heads = required("num_attention_heads")
        hidden = required("hidden_size")
        kv_channels = get("kv_channels")
        recompute = {"full": "full", "selective": "selective"}.get(get("recompute_granularity"), "none")
        return ModelConfig(
            architecture=architecture,
            attention_type=get("attention_type", "anchor"),
            num_layers=required("num_layers"),
            hidden_size=hidden,
            ffn_hidden_size=required("ffn_hidden_size"),
            num_attention_heads=heads,
            num_query_groups=get("num_query_groups") or heads,
            head_dim=None if kv_channels in (None, hidden // heads) else kv_channels,
            vocab_size=get("vocab_size"),
            seq_length=get("seq_length", 4096),
            rotary_base=str(float(get("rotary_base", 10000))),
            norm_epsilon=get("layernorm_epsilon", 1e-5),
            init_method_std=get("init_method_std", 0.02),
            tie_embeddings=bool(get("share_embeddings_and_output_weights", False)),
            add_qkv_bias=bool(get("add_qkv_bias", False)),
            rope_in_fp32=bool(get("rope_in_fp32", False)),
            recompute=recompute,
            recompute_num_layers=get("recompute_num_layers") if recompute == "full" else None,
            pipeline_model_parallel_size=get("pipeline_model_parallel_size") or 1,
            **scaling,
        )
    except KeyError as err:
        raise ValueError(f"{source}: config.{err.args[0]} is missing") from None
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
