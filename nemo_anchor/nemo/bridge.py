"""AnchorAttention through Megatron-Bridge: a ``GPTModelProvider`` with an ``attention_type``.

Optional: Megatron-Bridge installs only on CUDA machines (it builds mamba-ssm and imports
Transformer Engine), so importing this module without it raises ImportError saying so.
``provider.provide()`` builds a Llama-shaped Megatron-Core ``GPTModel`` with our layer spec.
"""
from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F

from nemo_anchor.nemo.mixin import AnchorConfigMixin

try:
    from megatron.bridge.models.gpt_provider import GPTModelProvider
except Exception as error:  # noqa: BLE001 - a CPU-only Transformer Engine raises RuntimeError, not ImportError
    raise ImportError(
        "nemo_anchor.nemo.bridge needs Megatron-Bridge (`pip install megatron-bridge` on a CUDA machine); "
        f"importing it failed: {type(error).__name__}: {error}. NeMo 2 users: nemo_anchor.nemo.config") from error


@dataclass
class AnchorGPTModelProvider(AnchorConfigMixin, GPTModelProvider):
    """Megatron-Bridge provider of an AnchorAttention Llama-shaped GPT (set the sizes as for any provider)."""

    normalization: str = "RMSNorm"
    activation_func: Callable = F.silu
    gated_linear_unit: bool = True
    position_embedding_type: str = "rope"
    add_bias_linear: bool = False
    share_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
