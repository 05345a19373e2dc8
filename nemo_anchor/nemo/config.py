"""NeMo 2 model configs that build AnchorAttention models, and the paper's model presets.

A plain ``llm.LlamaConfig`` has no ``attention_type``: NeMo refuses or drops the YAML key and
trains full attention. These configs own the field through
:class:`~nemo_anchor.training.mixin.AnchorConfigMixin` (layer spec, data and forward steps).

Presets follow the paper (Section 5.3, Table 1): Llama-2-7B, Llama-3-8B, Mistral-7B-v0.3 and
Qwen-1.5-1.8B shapes, continued at a 128K window with RoPE base 1e7. Changing ``seq_length``
does not move the base: recipes pass ``rotary_base=paper_rotary_base(seq_length)`` explicitly.
"""

from dataclasses import dataclass
from typing import List, Optional

import torch
from nemo.collections import llm
from nemo.collections.llm.gpt.model.llama import Llama31Config

from nemo_anchor.nemo import compat, cpu
from nemo_anchor.training.mixin import AnchorConfigMixin

compat.install()  # NeMo 2.7.3's optimizer call against megatron-core 0.16, wherever it runs
cpu.install()  # NeMo on a machine without CUDA; nothing on CUDA machines


@dataclass
class AnchorLlamaConfig(AnchorConfigMixin, llm.LlamaConfig):
    """``llm.LlamaConfig`` with AnchorAttention."""


@dataclass
class AnchorLlama31Config(AnchorConfigMixin, Llama31Config):
    """``llm.Llama31Config`` (Llama 3.1/3.2 RoPE frequency scaling) with AnchorAttention."""


@dataclass
class AnchorMistralConfig(AnchorConfigMixin, llm.MistralConfig7B):
    """``llm.MistralConfig7B`` with AnchorAttention (Mistral-7B-v0.3 has no sliding window)."""

    window_size: Optional[List[int]] = None
    params_dtype: torch.dtype = torch.float32


@dataclass
class AnchorQwen2Config(AnchorConfigMixin, llm.Qwen2Config):
    """``llm.Qwen2Config`` (q/k/v biases) with AnchorAttention. Qwen has no BOS: the anchor is EOS."""


_PAPER_WINDOW = 131_072
_PAPER_BASE = 1e7  # Table 1: 10M at 128K (5M at 64K, 1M at 16K-32K)


@dataclass
class AnchorLlama2Config7B(AnchorLlamaConfig):
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 11008
    num_attention_heads: int = 32
    num_query_groups: int = 32
    seq_length: int = _PAPER_WINDOW
    rotary_base: float = _PAPER_BASE


@dataclass
class AnchorLlama3Config8B(AnchorLlamaConfig):
    num_layers: int = 32
    hidden_size: int = 4096
    ffn_hidden_size: int = 14336
    num_attention_heads: int = 32
    num_query_groups: int = 8
    init_method_std: float = 0.01
    seq_length: int = _PAPER_WINDOW
    rotary_base: float = _PAPER_BASE


@dataclass
class AnchorMistral7BV03Config(AnchorMistralConfig):
    seq_length: int = _PAPER_WINDOW
    rotary_base: float = _PAPER_BASE


@dataclass
class AnchorQwen15Config1P8B(AnchorQwen2Config):
    num_layers: int = 24
    hidden_size: int = 2048
    ffn_hidden_size: int = 5504
    num_attention_heads: int = 16
    num_query_groups: int = 16
    seq_length: int = _PAPER_WINDOW
    rotary_base: float = _PAPER_BASE


@dataclass
class AnchorSmolLM2Config135M(AnchorLlamaConfig):
    """SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M): a model a CPU can continue to pretrain."""

    num_layers: int = 30
    hidden_size: int = 576
    ffn_hidden_size: int = 1536
    num_attention_heads: int = 9
    num_query_groups: int = 3
    kv_channels: int = 64
    vocab_size: int = 49152
    share_embeddings_and_output_weights: bool = True
    init_method_std: float = 0.041666666666666664
    seq_length: int = 8192
    rotary_base: float = 100_000.0


# recipe preset name -> config class; ``nemo_anchor.nemo.models.MODEL_CLASSES`` gives its NeMo model class
PRESETS = {
    "llama2_7b": AnchorLlama2Config7B,
    "llama3_8b": AnchorLlama3Config8B,
    "mistral_7b_v0.3": AnchorMistral7BV03Config,
    "qwen1.5_1.8b": AnchorQwen15Config1P8B,
    "smollm2_135m": AnchorSmolLM2Config135M,
}
