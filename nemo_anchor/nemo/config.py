"""NeMo 2 model configs that build AnchorAttention models, and the paper's model presets.

A plain ``llm.LlamaConfig`` given ``attention_type: anchor`` in YAML drops the key with a
warning and trains full attention. These configs own the field: :class:`AnchorConfigMixin` adds
``attention_type`` (plus the kernel backend and fp32 RoPE rotation), makes
``transformer_layer_spec`` build our spec (Megatron's GPT layer spec with
``AnchorCoreAttention``), and swaps NeMo's data/forward steps for ones that carry document and
window boundaries to the core attention through ``AnchorPackedSeqParams``.

Presets follow the paper (Section 5.3, Table 1): Llama-2-7B, Llama-3-8B, Mistral-7B-v0.3 and
Qwen-1.5-1.8B shapes, continued at a 128K window with RoPE base 1e7. Changing ``seq_length``
does not move the base: recipes pass ``rotary_base=paper_rotary_base(seq_length)`` explicitly.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from nemo.collections import llm

from nemo_anchor import gpu
from nemo_anchor.model.attention_types import get_attention_type
from nemo_anchor.model.gpt import packed_forward
from nemo_anchor.model.rope import install_rope_precision_hook
from nemo_anchor.model.spec import get_layer_spec

# Keys of a collated batch (``nemo_anchor.data.collate_windows``) that the forward step reads.
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_windows")


def anchor_layer_spec(config: "AnchorConfigMixin") -> ModuleSpec:
    """NeMo's ``transformer_layer_spec`` hook: our layer spec for ``config.attention_type``."""
    return get_layer_spec(config.attention_type, config.attention_kernel, qk_layernorm=config.qk_layernorm)


def anchor_data_step(dataloader_iter) -> dict[str, torch.Tensor]:
    """NeMo's ``data_step_fn``: the next collated batch on this rank's device and context-parallel shard.

    NeMo's ``gpt_data_step`` would drop ``cu_windows`` (it keeps only the keys it knows) and its
    context-parallel split ignores document boundaries, so packed windows take this path.
    """
    from megatron.core import parallel_state

    batch = next(dataloader_iter)
    if isinstance(batch, tuple):  # (batch, batch_idx, dataloader_idx) from Lightning's fetcher
        batch = batch[0]
    missing = [k for k in _BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}: feed AnchorPackedDataModule (nemo_anchor.data.collate_windows) batches")
    batch = {k: batch[k] for k in _BATCH_KEYS}
    if parallel_state.get_context_parallel_world_size() > 1:
        from nemo_anchor.parallel.context_parallel import shard_batch

        batch = shard_batch(batch, parallel_state.get_context_parallel_group())
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def anchor_forward_step(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """NeMo's ``forward_step_fn``: per-token loss ``[B, T]`` of B packed windows run as one THD pack."""
    from megatron.core import parallel_state

    cp_group = (parallel_state.get_context_parallel_group()
                if parallel_state.get_context_parallel_world_size() > 1 else None)
    return packed_forward(model, batch, cp_group)


@dataclass
class AnchorConfigMixin:
    """Put first among the bases of a NeMo ``GPTConfig`` subclass (and declare it a dataclass)."""

    attention_type: str = "anchor"  # full | intra_doc | intra_doc_reset | anchor
    attention_kernel: str = "auto"  # nemo_anchor.attention backend; `attention_backend` is Megatron's
    rope_in_fp32: bool = False  # rotate q/k in fp32 (the unfused RoPE path)
    transformer_layer_spec: Union[ModuleSpec, Callable] = anchor_layer_spec
    forward_step_fn: Callable = anchor_forward_step
    data_step_fn: Callable = anchor_data_step

    def __post_init__(self):
        get_attention_type(self.attention_type)  # ValueError naming the choices
        if self.attention_backend == AttnBackend.local:
            raise ValueError("attention_backend=local makes NeMo replace the core attention with Megatron's "
                             "DotProductAttention; leave it at auto to keep AnchorCoreAttention")
        if self.window_size is not None:
            raise ValueError(f"window_size={self.window_size}: sliding-window attention is not supported "
                             "with AnchorCoreAttention; set window_size to null")
        if gpu.transformer_engine_pytorch()[0] is None:
            # Without TE the layers come from Megatron's local spec, whose torch RMSNorm and
            # unfused RoPE compute the same thing as the fused kernels these flags ask for.
            self.apply_rope_fusion = False
            self.persist_layer_norm = False
        super().__post_init__()

    @property
    def anchor_attention_type(self) -> str:
        """The name ``nemo_anchor.model`` reads (``AnchorTransformerConfig``); NeMo YAML says ``attention_type``."""
        return self.attention_type

    def configure_model(self, tokenizer, pre_process=None, post_process=None, vp_stage=None):
        install_rope_precision_hook()  # honours rope_in_fp32 on the unfused RoPE path
        return super().configure_model(tokenizer, pre_process, post_process, vp_stage)


@dataclass
class AnchorLlamaConfig(AnchorConfigMixin, llm.LlamaConfig):
    """``llm.LlamaConfig`` with AnchorAttention."""


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


# recipe preset name -> (config class, NeMo model class)
PRESETS = {
    "llama2_7b": (AnchorLlama2Config7B, llm.LlamaModel),
    "llama3_8b": (AnchorLlama3Config8B, llm.LlamaModel),
    "mistral_7b_v0.3": (AnchorMistral7BV03Config, llm.MistralModel),
    "qwen1.5_1.8b": (AnchorQwen15Config1P8B, llm.Qwen2Model),
}
