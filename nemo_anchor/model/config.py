"""The ``model:`` section: a Llama-shaped decoder and its attention type, as one dataclass.

It is the OmegaConf schema of the YAML section and the single source for the Megatron
``TransformerConfig`` (:func:`nemo_anchor.model.gpt.transformer_config`) and the HF export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nemo_anchor.attention.functional import backend_refusal
from nemo_anchor.attention.paradigms import attention_type_names, get_attention_type

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_SCALINGS = ("none", "yarn", "ntk", "llama3")
# Megatron-Core's Llama 3.x RoPE scaling fixes these (Llama 3.1 and 3.2 use them); only the factor varies.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Section 4.3 of the paper: the RoPE base grows with the training window.
_PAPER_ROPE_BASES = ((4096, 10_000.0), (16_384, 1e6), (32_768, 1e6), (65_536, 5e6), (131_072, 1e7), (262_144, 5e7))


def paper_rotary_base(seq_length: int) -> float:
    """The paper's schedule: 1M for 16K-32K, 5M for 64K, 10M for 128K, 50M for 256K (10K up to 4K)."""
    for limit, base in _PAPER_ROPE_BASES:
        if seq_length <= limit:
            return base
    return _PAPER_ROPE_BASES[-1][1]


@dataclass
class ModelConfig:
    architecture: str = "llama"  # llama | mistral | qwen2: decides the HF export class (qwen2 adds qkv bias)
    attention_type: str = "anchor"  # full | intra_doc | intra_doc_reset | anchor
    attention_backend: str = "auto"  # see nemo_anchor.attention.anchor_attention
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int = 352
    num_attention_heads: int = 4
    num_query_groups: int = 2
    head_dim: Optional[int] = None  # default hidden_size // num_attention_heads
    vocab_size: Optional[int] = None  # default: the tokenizer's
    seq_length: int = 1024  # training window; exported as max_position_embeddings
    rotary_base: str = "auto"  # a number, or "auto" for the paper's schedule by seq_length
    rope_scaling: str = "none"  # none | yarn | ntk | llama3 (Llama 3.1/3.2 frequency rescaling)
    rope_scaling_factor: float = 1.0  # s = T_new / T_original for yarn and ntk; llama3's "factor"
    original_max_position_embeddings: int = 4096
    rope_in_fp32: bool = False  # rotate q/k in fp32 (cos/sin are always computed in fp32)
    norm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    add_qkv_bias: Optional[bool] = None  # default: True for qwen2
    tie_embeddings: bool = False
    tensor_model_parallel_size: int = 1  # Megatron tensor parallelism, with sequence parallelism when > 1
    pipeline_model_parallel_size: int = 1  # Megatron pipeline stages (num_layers / stages layers each)
    context_parallel_size: int = 1
    cp_comm_type: str = "a2a"  # a2a | all_gather
    recompute: str = "none"  # none | selective (core attention) | full (whole layers)
    recompute_num_layers: Optional[int] = None  # full: layers recomputed per pipeline stage (default: all)
    init_from_hf: Optional[str] = None  # local HF directory to start from

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def bad(key, value, why):
            raise ValueError(f"model.{key}={value!r}: {why}")

        if self.architecture not in ARCHITECTURES:
            bad("architecture", self.architecture, f"choose one of {list(ARCHITECTURES)}")
        if self.attention_type not in attention_type_names():
            bad("attention_type", self.attention_type, f"choose one of {attention_type_names()}")
        refusal = backend_refusal(self.attention_backend, get_attention_type(self.attention_type).mask)
        if refusal:
            bad("attention_backend", self.attention_backend, refusal)
        if self.rope_scaling not in ROPE_SCALINGS:
            bad("rope_scaling", self.rope_scaling, f"choose one of {list(ROPE_SCALINGS)}")
        if self.recompute not in ("none", "selective", "full"):
            bad("recompute", self.recompute, "choose one of ['none', 'selective', 'full']")
        if self.cp_comm_type not in ("a2a", "all_gather"):
            bad("cp_comm_type", self.cp_comm_type, "choose one of ['a2a', 'all_gather']")
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "seq_length", "context_parallel_size", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size"):
            if int(getattr(self, key)) < 1:
                bad(key, getattr(self, key), "must be a positive integer")
        for key in ("vocab_size", "head_dim"):  # null: the tokenizer's / hidden_size // num_attention_heads
            if getattr(self, key) is not None and int(getattr(self, key)) < 1:
                bad(key, getattr(self, key), "must be a positive integer (or null)")
        if self.num_attention_heads % self.num_query_groups:
            bad("num_query_groups", self.num_query_groups,
                f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            bad("hidden_size", self.hidden_size, f"must be divisible by num_attention_heads={self.num_attention_heads}")
        if self.rope_scaling != "none" and self.rope_scaling_factor < 1:
            bad("rope_scaling_factor", self.rope_scaling_factor, "must be >= 1 with rope scaling")
        original = LLAMA3_ROPE["original_max_position_embeddings"]
        if self.rope_scaling == "llama3" and self.original_max_position_embeddings != original:
            bad("original_max_position_embeddings", self.original_max_position_embeddings,
                f"must be {original} with rope_scaling=llama3 (Megatron-Core's Llama 3.x scaling fixes it)")
        self._validate_parallelism(bad)
        self.resolved_rotary_base()

    def _validate_parallelism(self, bad) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        for key in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            if getattr(self, key) % tp:
                bad(key, getattr(self, key), f"must be divisible by model.tensor_model_parallel_size={tp} "
                                             f"(each tensor-parallel rank holds 1/{tp} of it)")
        if self.num_layers % pp:
            bad("num_layers", self.num_layers,
                f"must be divisible by model.pipeline_model_parallel_size={pp} (equal pipeline stages)")
        if self.recompute_num_layers is not None:
            per_stage = self.num_layers // pp
            if self.recompute != "full":
                bad("recompute_num_layers", self.recompute_num_layers, "only applies with model.recompute=full")
            if not 1 <= self.recompute_num_layers <= per_stage:
                bad("recompute_num_layers", self.recompute_num_layers,
                    f"must lie in [1, {per_stage}] (the layers of one pipeline stage)")
        if self.context_parallel_size > 1:
            from nemo_anchor.parallel.context_parallel import check_head_split

            # each tensor-parallel rank splits its own heads over the context-parallel ranks
            check_head_split(self.num_attention_heads // tp, self.num_query_groups // tp, self.context_parallel_size,
                             self.cp_comm_type)

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2" if self.add_qkv_bias is None else self.add_qkv_bias

    def resolved_rotary_base(self) -> float:
        """The RoPE base actually used: the schedule for "auto", NTK-aware rescaling for ``ntk``."""
        if str(self.rotary_base) == "auto":
            base = paper_rotary_base(self.seq_length)
        else:
            try:
                base = float(self.rotary_base)
            except ValueError:
                raise ValueError(f"model.rotary_base={self.rotary_base!r}: a number or 'auto'") from None
            if base <= 1:
                raise ValueError(f"model.rotary_base={self.rotary_base!r}: must be > 1")
        if self.rope_scaling == "ntk":
            # NTK-aware scaling (LocalLLaMA 2023): base * s^(d / (d - 2)).
            d = self.kv_channels
            base *= self.rope_scaling_factor ** (d / (d - 2))
        return base
