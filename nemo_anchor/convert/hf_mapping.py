"""Our ``model:`` config and canonical Megatron weights <-> Hugging Face Llama / Mistral / Qwen2.

The three HF classes share one weight layout (``model.layers.N.self_attn.q_proj`` ...); they
differ in their config: Qwen2 always has q/k/v biases, Mistral may have a sliding window, Llama
may have biases on every attention projection. We map exactly what both sides can express and
refuse the rest with an error that names the field.

Families: Llama 2, Llama 3 and 3.1/3.2 (``rope_scaling`` of type ``llama3``), SmolLM2 (Llama with
tied embeddings), Mistral v0.3 (no sliding window, any ``head_dim``), Qwen2/2.5 (q/k/v biases,
tied or untied).

RoPE: HF ``rope_theta`` is the resolved base (the paper's schedule, NTK already folded in), and
YaRN becomes ``rope_scaling = {"rope_type": "yarn", "factor", "original_max_position_embeddings"}``
with HF's defaults (beta_fast 32, beta_slow 1, attention factor 0.1 ln s + 1), which are
Megatron's too. Llama 3.x scaling is ``{"rope_type": "llama3", "factor", "low_freq_factor": 1,
"high_freq_factor": 4, "original_max_position_embeddings": 8192}``: Megatron-Core fixes all but
the factor, so other values are refused. ``max_position_embeddings`` is the trained window.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch

from nemo_anchor.compat import hf_rope, hf_rope_fields
from nemo_anchor.convert.megatron_state import fuse_qkv, split_qkv
from nemo_anchor.convert.weight_match import config_key_explainer, match_weights
from nemo_anchor.hf_dir import CONFIG_FILE, hf_weight_shapes, read_hf_tensors
from nemo_anchor.model.config import LLAMA3_ROPE, ModelConfig

# HF rope_scaling keys we read, per rope_type, with the values Megatron-Core implements (None: any value)
_ROPE_KEYS = {
    "default": {},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0,
             "mscale": 1.0, "mscale_all_dim": 0.0, "truncate": True},
    "llama3": {"factor": None, **LLAMA3_ROPE},
}

# our architecture -> (transformers config class, model class)
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def to_hf_config(cfg: ModelConfig, vocab_size: int, *, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                 dtype: torch.dtype = torch.float32):
    """The ``transformers`` config of the HF class for ``cfg.architecture``."""
    import transformers

    if cfg.qkv_bias and cfg.architecture != "qwen2":
        raise ValueError(f"model.add_qkv_bias=True: HF {HF_CLASSES[cfg.architecture][1]} has no q/k/v-only biases; "
                         f"set model.architecture=qwen2 to export this model")
    rope_scaling = None
    if cfg.rope_scaling in ("yarn", "llama3") and cfg.architecture == "mistral":
        raise ValueError(f"model.rope_scaling={cfg.rope_scaling}: HF MistralForCausalLM has no RoPE scaling; export "
                         f"this model as architecture llama (same weights and layout)")
    if cfg.rope_scaling == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": float(cfg.rope_scaling_factor),
                        "original_max_position_embeddings": int(cfg.original_max_position_embeddings)}
    elif cfg.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": float(cfg.rope_scaling_factor), **LLAMA3_ROPE}
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        hidden_act="silu",
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_epsilon,
        **hf_rope_fields(cfg.resolved_rotary_base(), rope_scaling),
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_method_std,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype=dtype,
    )
    if cfg.architecture == "llama":
        fields.update(attention_bias=False, mlp_bias=False)
    elif cfg.architecture == "mistral":
        fields.pop("rope_scaling", None)  # transformers 4.x MistralConfig has no such field
        fields.update(sliding_window=None)
    else:
        fields.update(use_sliding_window=False)
    return getattr(transformers, HF_CLASSES[cfg.architecture][0])(**fields)


def model_config_from_hf(hf_config, *, source: str = "config.json", **overrides) -> ModelConfig:
    """Our ``model:`` section for a transformers Llama/Mistral/Qwen2 config (``overrides`` win)."""
    arch = hf_config.model_type

    def refuse(field, value, why):
        raise ValueError(f"{source}: {field}={value!r} is not supported: {why}")

    if arch not in HF_CLASSES:
        refuse("model_type", arch, f"choose one of {sorted(HF_CLASSES)}")
    if hf_config.hidden_act != "silu":
        refuse("hidden_act", hf_config.hidden_act, "the Megatron model uses SwiGLU (silu)")
    if arch == "llama" and (hf_config.attention_bias or hf_config.mlp_bias):
        refuse("attention_bias/mlp_bias", (hf_config.attention_bias, hf_config.mlp_bias), "Llama without biases only")
    window = getattr(hf_config, "sliding_window", None)
    if (arch == "qwen2" and hf_config.use_sliding_window) or (
            arch == "mistral" and window is not None and window < hf_config.max_position_embeddings):
        refuse("sliding_window", window, "sliding-window attention is not implemented")
    if float(getattr(hf_config, "partial_rotary_factor", None) or 1.0) != 1.0:
        refuse("partial_rotary_factor", hf_config.partial_rotary_factor, "RoPE on the whole head only")
    rope_theta, hf_scaling = hf_rope(hf_config)
    scaling = _rope_scaling_from_hf(hf_scaling, refuse)
    rope_type = scaling.get("rope_type", "default")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    fields = dict(
        architecture=arch,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=hf_config.num_key_value_heads or heads,
        head_dim=None if head_dim * heads == hf_config.hidden_size else head_dim,
        vocab_size=hf_config.vocab_size,
        seq_length=hf_config.max_position_embeddings,
        rotary_base=str(rope_theta),
        norm_epsilon=hf_config.rms_norm_eps,
        init_method_std=hf_config.initializer_range,
        tie_embeddings=bool(hf_config.tie_word_embeddings),
    )
    if rope_type == "yarn":
        fields.update(rope_scaling="yarn", rope_scaling_factor=float(scaling["factor"]),
                      original_max_position_embeddings=int(
                          scaling.get("original_max_position_embeddings") or hf_config.max_position_embeddings))
    elif rope_type == "llama3":
        fields.update(rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    fields.update(overrides)
    return ModelConfig(**fields)


def _rope_scaling_from_hf(scaling: dict, refuse) -> dict:
    """The HF RoPE scaling dict, normalised to carry ``rope_type``; anything Megatron cannot do is refused."""
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in _ROPE_KEYS:
        refuse("rope_scaling.rope_type", rope_type, f"choose one of {sorted(_ROPE_KEYS)}")
    allowed = _ROPE_KEYS[rope_type]
    for key, value in scaling.items():
        if value is None:  # unset: the default, which is Megatron's
            continue
        if key not in allowed:
            refuse(f"rope_scaling.{key}", value, f"not read for rope_type {rope_type!r}")
        if allowed[key] is not None and value != allowed[key]:
            refuse(f"rope_scaling.{key}", value, f"Megatron-Core implements {rope_type!r} with {allowed[key]!r} only")
    if rope_type != "default" and not scaling.get("factor"):
        refuse("rope_scaling.factor", scaling.get("factor"), f"rope_type {rope_type!r} needs a factor")
    if rope_type == "llama3":  # every key must be present: transformers has no defaults for them
        for key, value in LLAMA3_ROPE.items():
            if scaling.get(key) is None:
                refuse(f"rope_scaling.{key}", None, f"rope_type 'llama3' needs {key}={value}")
    return {"rope_type": rope_type, **scaling}


def _hf_layer_names(i: int) -> dict[str, str]:
    """Canonical Megatron name -> HF name, for the one-to-one tensors of layer ``i``."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "self_attention.linear_proj.weight": h + "self_attn.o_proj.weight",
        m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
        m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight",
    }


def megatron_to_hf_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A checked canonical Megatron state (see ``megatron_state``) -> the HF ``state_dict``."""
    embed = state["embedding.word_embeddings.weight"]
    hf = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": embed if cfg.tie_embeddings else state["output_layer.weight"],
    }
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        hf.update({theirs: state[ours] for ours, theirs in _hf_layer_names(i).items()})
        q, k, v = split_qkv(state[m + "self_attention.linear_qkv.weight"], cfg)
        hf.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v})
        if cfg.architecture == "qwen2":  # Qwen2's projections always carry biases: zeros when we trained none
            qkv_bias = state.get(m + "self_attention.linear_qkv.bias")
            if qkv_bias is None:
                qkv_bias = torch.zeros(q.shape[0] + k.shape[0] + v.shape[0], dtype=q.dtype)
            qb, kb, vb = split_qkv(qkv_bias, cfg)
            hf.update({h + "self_attn.q_proj.bias": qb, h + "self_attn.k_proj.bias": kb, h + "self_attn.v_proj.bias": vb})
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        hf.update({h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up})
    return {k: v.contiguous() for k, v in hf.items()}


def hf_to_megatron_state(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, *, source: str) -> dict[str, torch.Tensor]:
    """An HF ``state_dict`` -> the canonical Megatron state of ``cfg`` (ValueError naming a missing tensor)."""
    def get(name):
        try:
            return hf[name]
        except KeyError:
            raise ValueError(f"{source}: Hugging Face weights lack {name}") from None

    state = {
        "embedding.word_embeddings.weight": get("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": get("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        state["output_layer.weight"] = get("lm_head.weight")
    for i in range(cfg.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        state.update({ours: get(theirs) for ours, theirs in _hf_layer_names(i).items()})
        attn = h + "self_attn."
        state[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"), cfg)
        if cfg.qkv_bias:
            state[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), cfg)
        state[m + "mlp.linear_fc1.weight"] = torch.cat([get(h + "mlp.gate_proj.weight"), get(h + "mlp.up_proj.weight")])
    return state


# HF config keys that fix a tensor's shape along an axis; see hf_config_key
_HF_AXIS_KEYS = {
    "embed_tokens": ("vocab_size", "hidden_size"), "lm_head": ("vocab_size", "hidden_size"),
    "q_proj": ("num_attention_heads x head_dim", "hidden_size"),
    "k_proj": ("num_key_value_heads x head_dim", "hidden_size"),
    "v_proj": ("num_key_value_heads x head_dim", "hidden_size"),
    "o_proj": ("hidden_size", "num_attention_heads x head_dim"),
    "gate_proj": ("intermediate_size", "hidden_size"), "up_proj": ("intermediate_size", "hidden_size"),
    "down_proj": ("hidden_size", "intermediate_size"),
    "layernorm": ("hidden_size",), "norm": ("hidden_size",),
}
_HF_LAYER = re.compile(r"model\.layers\.\d+\.")
_HF_IGNORED = ("rotary_emb.inv_freq",)  # buffers older transformers saved; recomputed from the config


def hf_expected_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the HF ``state_dict`` of ``cfg`` with its shape (``lm_head.weight`` included)."""
    from nemo_anchor.convert.megatron_state import expected_shapes

    meta = {name: torch.empty(shape, device="meta") for name, shape in expected_shapes(cfg, vocab_size).items()}
    if cfg.architecture == "qwen2" and not cfg.qkv_bias:
        cfg = dataclasses.replace(cfg, add_qkv_bias=True)  # exported with zero biases
        meta.update({name: torch.empty(shape, device="meta")
                     for name, shape in expected_shapes(cfg, vocab_size).items() if name.endswith("qkv.bias")})
    return {name: tuple(t.shape) for name, t in megatron_to_hf_state(meta, cfg).items()}


def hf_config_key(cfg: ModelConfig, vocab_size: int, source: str = "config.json") -> Callable:
    """``explain(name, axis)`` for :func:`~nemo_anchor.convert.weight_match.match_weights`: the config.json
    key (and its value) that decides tensor ``name`` along ``axis`` (None: whether it exists)."""
    values = {"vocab_size": vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
              "num_attention_heads x head_dim": f"{cfg.num_attention_heads} x {cfg.kv_channels}",
              "num_key_value_heads x head_dim": f"{cfg.num_query_groups} x {cfg.kv_channels}"}
    return config_key_explainer(
        source, _HF_AXIS_KEYS, values, is_layer=_HF_LAYER.match, layers=f"num_hidden_layers={cfg.num_layers}",
        head="lm_head.weight", tied=f"tie_word_embeddings={cfg.tie_embeddings}",
        fallback=f"{cfg.architecture}, num_hidden_layers={cfg.num_layers}")


def check_hf_weights(found: Mapping[str, tuple[int, ...]], cfg: ModelConfig, vocab_size: int, *, source: str,
                     config_source: str = "config.json", read: Optional[Callable] = None) -> None:
    """ValueError unless the HF tensors ``found`` (name -> shape) are exactly those ``cfg`` describes.

    With tied embeddings an ``lm_head.weight`` in the weights is accepted only as a copy of
    ``model.embed_tokens.weight``: ``read(names) -> {name: tensor}`` reads the two to compare.
    """
    found = {name: shape for name, shape in found.items() if not name.endswith(_HF_IGNORED)}
    expected = hf_expected_shapes(cfg, vocab_size)
    if cfg.tie_embeddings:
        del expected["lm_head.weight"]
        if "lm_head.weight" in found and read is not None and found["lm_head.weight"] == found.get(
                "model.embed_tokens.weight"):
            pair = read({"lm_head.weight", "model.embed_tokens.weight"})
            if torch.equal(pair["lm_head.weight"], pair["model.embed_tokens.weight"]):
                found = {name: shape for name, shape in found.items() if name != "lm_head.weight"}
    match_weights(found, expected, source=source, explain=hf_config_key(cfg, vocab_size, config_source))


def check_hf_dir(path, cfg: Optional[ModelConfig] = None) -> ModelConfig:
    """ValueError unless the weights files of HF directory ``path`` hold exactly the tensors its config.json
    describes, compared from the safetensors headers before anything is built from them; returns the config.

    The one check of an HF directory that every door runs before reading one: ``import-hf``,
    ``model.init_from_hf``, ``eval``/``probe``, NeMo's importer and exporter (``nemo_anchor.nemo.hf_io``)
    and Megatron-Bridge's (``nemo_anchor.bridge.convert``). transformers (and the converters built on
    it) would initialise a tensor the files lack, or a layer config.json adds, at random without an error.
    ``cfg``: the config already read from ``path`` (read here when None).
    """
    path = Path(path)
    if cfg is None:
        import transformers

        cfg = model_config_from_hf(transformers.AutoConfig.from_pretrained(path, local_files_only=True),
                                   source=str(path / CONFIG_FILE))
    check_hf_weights(hf_weight_shapes(path), cfg, cfg.vocab_size, source=str(path),
                     config_source=str(path / CONFIG_FILE), read=lambda names: read_hf_tensors(path, names))
    return cfg
