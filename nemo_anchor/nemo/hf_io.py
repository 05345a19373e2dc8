"""Hugging Face import and export of the AnchorAttention NeMo models, strict about every weight.

:class:`AnchorImporter` and :class:`AnchorExporter` make the ``hf`` connectors that
``nemo_anchor.nemo.models`` registers on ``AnchorLlamaModel``, ``AnchorMistralModel`` and
``AnchorQwen2Model``, so these use them::

    llm.import_ckpt(model=AnchorLlamaModel(AnchorLlamaConfig()), source="hf://DIR", output_path=OUT)
    llm.export_ckpt(path=OUT, target="hf", output_path=HF)
    nemo llm import model=nemo_anchor.nemo.AnchorLlamaModel source=hf://DIR output_path=OUT -y

They reuse NeMo's own connectors (weight mappings and q/k/v, gate/up transforms) and change three things:

- the config: the Anchor config is built from the HF config by ``nemo_anchor.convert.hf_mapping``
  (the project's reading of HF configs, with every RoPE scaling it supports: NTK folded into the
  base, YaRN, Llama 3.1's), and written back to HF by it on export;
- the names: NeMo's mappings name Transformer Engine's fused layers
  (``linear_qkv.layer_norm_weight``); on Megatron's local layer spec (no TE) the norms are
  ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``. NeMo 2.7.3's Llama importer then
  leaves every layer norm at its initial 1.0 without an error, and ``HFLlamaExporter.convert_state``
  raises IndexError (``nemo/collections/llm/gpt/model/llama.py:555-642, 855-939``); the names are
  translated to the spec the model was built with;
- strictness: every weight of the target must be written and every weight of the source read,
  or the conversion stops with an error naming the weights; the HF files are compared with their
  config.json before the import (``check_hf_dir``, as ``import-hf`` does), and an exported NeMo
  checkpoint's weights with its config (``check_nemo2_weights``), naming the tensor, both shapes
  and the config key.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterable

import torch
from nemo.lightning import io
from nemo.lightning.pytorch.utils import dtype_from_hf

from nemo_anchor.convert.hf_mapping import LLAMA3_ROPE, check_hf_dir, model_config_from_hf, to_hf_config
from nemo_anchor.convert.megatron_config import model_config_from_megatron
from nemo_anchor.convert.megatron_state import TE_TO_LOCAL
from nemo_anchor.convert.sources import check_nemo2_weights
from nemo_anchor.nemo import config as anchor_config


class UnmappedWeightError(ValueError):
    """A conversion that would leave a weight of the target unwritten, or drop one of the source."""


# ---------------------------------------------------------------- configs

def anchor_config_from_hf(hf_dir: str, family: type):
    """The Anchor NeMo config (``family``: AnchorLlamaConfig, AnchorMistralConfig, AnchorQwen2Config) of an HF model."""
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    cfg = model_config_from_hf(hf_config, source=f"{hf_dir}/config.json")
    try:
        generation_config = GenerationConfig.from_pretrained(hf_dir)
    except OSError:
        generation_config = None
    dtype = dtype_from_hf(hf_config)
    fields = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, seq_length=cfg.seq_length, rotary_base=cfg.resolved_rotary_base(),
        layernorm_epsilon=cfg.norm_epsilon, init_method_std=cfg.init_method_std,
        share_embeddings_and_output_weights=cfg.tie_embeddings, vocab_size=cfg.vocab_size,
        make_vocab_size_divisible_by=_largest_power_of_two_dividing(cfg.vocab_size, 128),
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        generation_config=generation_config,
    )
    config_class = family
    if cfg.rope_scaling == "yarn":
        fields.update(position_embedding_type="yarn", yarn_rotary_scaling_factor=cfg.rope_scaling_factor,
                      yarn_original_max_position_embeddings=cfg.original_max_position_embeddings)
    elif cfg.rope_scaling == "llama3":
        if family is not anchor_config.AnchorLlamaConfig:
            raise ValueError(f"{hf_dir}/config.json: Llama 3.1 RoPE scaling on a {family.__name__}: import it as "
                             f"AnchorLlamaModel")
        config_class = anchor_config.AnchorLlama31Config
        fields.update(scale_factor=cfg.rope_scaling_factor, low_freq_factor=LLAMA3_ROPE["low_freq_factor"],
                      high_freq_factor=LLAMA3_ROPE["high_freq_factor"], old_context_len=cfg.original_max_position_embeddings)
    return config_class(**fields)


def _largest_power_of_two_dividing(value: int, at_most: int) -> int:
    base = at_most
    while value % base:
        base //= 2
    return base


# ---------------------------------------------------------------- strict weight mapping

def _megatron_keys(module) -> list[str] | None:
    inner = getattr(module, "module", None)
    if inner is None or not hasattr(inner, "decoder"):
        return None
    return list(inner.state_dict())


def _to_local(key: str) -> str:
    for te, local in TE_TO_LOCAL.items():  # NeMo's mappings name TE's fused modules
        if key.endswith(te):
            return key[: -len(te)] + local
    return key


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def _patterns(keys: Iterable) -> list[re.Pattern]:
    found = []
    for key in keys:
        found.extend(_pattern(k) for k in ((key,) if isinstance(key, str) else key))
    return found


def _tensors(module) -> dict[str, torch.Tensor]:
    inner = getattr(module, "module", module)
    return {k: v for k, v in inner.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _tied_hf_head(module, key: str) -> bool:
    """An HF model's ``lm_head.weight`` that is its input embedding (saved once, as the embedding)."""
    return key == "lm_head.weight" and getattr(getattr(module, "config", None), "tie_word_embeddings", False)


def _refuse_unused_source(source, mapping: dict, transforms: list) -> None:
    read = _patterns(list(mapping) + [t.source_key for t in transforms])
    unused = [k for k in _tensors(source) if not any(p.match(k) for p in read) and not _tied_hf_head(source, k)]
    if unused:
        raise UnmappedWeightError(f"the conversion does not read {len(unused)} weight(s) of the source: "
                                  f"{', '.join(unused[:8])}")


def _refuse_unwritten_target(target) -> None:
    unwritten = [k for k, v in _tensors(target).items()
                 if v.is_floating_point() and torch.isnan(v).any() and not _tied_hf_head(target, k)]
    if unwritten:
        raise UnmappedWeightError(f"the conversion leaves {len(unwritten)} weight(s) of the target unwritten: "
                                  f"{', '.join(unwritten[:8])}")


def strict_apply_transforms(source, target, mapping: dict, transforms: list = (), **kwargs):
    """``io.apply_transforms`` with names on the model's layer spec, refusing unread or unwritten weights."""
    transforms = list(transforms)
    megatron = _megatron_keys(target) or _megatron_keys(source) or []
    if any(k.endswith(".input_layernorm.weight") for k in megatron):  # Megatron's local spec
        mapping = {_to_local(k): _to_local(v) for k, v in mapping.items()}
    _refuse_unused_source(source, mapping, transforms)
    with torch.no_grad():  # what nothing writes stays NaN
        for tensor in _tensors(target).values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    result = _NEMO_APPLY_TRANSFORMS(source, target, mapping=mapping, transforms=transforms, **kwargs)
    _refuse_unwritten_target(target)
    return result


_NEMO_APPLY_TRANSFORMS = io.apply_transforms


@contextlib.contextmanager
def _strict_transforms():
    """NeMo's connectors call ``io.apply_transforms`` by attribute: for their duration it is the strict one."""
    io.apply_transforms = strict_apply_transforms
    try:
        yield
    finally:
        io.apply_transforms = _NEMO_APPLY_TRANSFORMS


# ---------------------------------------------------------------- connectors

def _local_hf_dir(source: str) -> str:
    """The local directory of an importer's source: itself, or a Hub model id's snapshot (what
    ``from_pretrained`` reads)."""
    if Path(source).is_dir():
        return source
    from huggingface_hub import snapshot_download

    return snapshot_download(source)


class AnchorImporter:
    """Mixed in before a NeMo HF importer: Anchor model and config, strict weights."""

    MODEL_CLASS: type  # set where the importer is registered: nemo_anchor.nemo.models
    CONFIG_FAMILY: type

    def init(self):
        return self.MODEL_CLASS(self.config, tokenizer=self.tokenizer)

    @property
    def config(self):
        return anchor_config_from_hf(str(self), self.CONFIG_FAMILY)

    def apply(self, output_path):
        # transformers fills a tensor the files lack, or a layer config.json adds, at random: compare the files
        # with config.json first, as import-hf does, naming the tensor, both shapes and the config key
        check_hf_dir(_local_hf_dir(str(self)))
        return super().apply(output_path)

    def convert_state(self, source, target):
        with _strict_transforms():
            return super().convert_state(source, target)


class AnchorExporter:
    """Mixed in before a NeMo HF exporter: the HF config from the project's mapping, strict weights."""

    @property
    def config(self):
        source = io.load_context(str(self), subpath="model.config")
        tokenizer = getattr(self.tokenizer, "tokenizer", None)
        return to_hf_config(model_config_from_megatron(source), source.vocab_size,
                            bos_token_id=getattr(tokenizer, "bos_token_id", None),
                            eos_token_id=getattr(tokenizer, "eos_token_id", None),
                            pad_token_id=getattr(tokenizer, "pad_token_id", None),
                            dtype=source.params_dtype)

    def apply(self, output_path):
        # NeMo's load of weights that disagree with the checkpoint's config ends in a hint to load less strictly
        # (ckpt_load_strictness); compare them first, naming the tensor, both shapes and the config key
        check_nemo2_weights(Path(str(self)))
        return super().apply(output_path)

    def convert_state(self, source, target, *args, **kwargs):
        with _strict_transforms():
            return super().convert_state(source, target, *args, **kwargs)
