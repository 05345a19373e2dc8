"""AnchorAttention through Megatron-Bridge: a ``GPTModelProvider`` with an ``attention_type``.

``provider.provide()`` builds the Llama-shaped Megatron-Core ``GPTModel`` our trainer builds
(:func:`nemo_anchor.model.gpt.build_gpt_model`): the same layer spec (``AnchorCoreAttention``;
Transformer Engine's linear and norm modules where TE imports, Megatron's local ones elsewhere)
and the same final norm. What the devices decide (Megatron's fusions, CPU initialisation) is left
unset in the provider, so that a recipe prints the same wherever it is built, and decided in
:meth:`~AnchorGPTModelProvider.finalize`, which Bridge's ``pretrain()`` calls in the training process
(``nemo_anchor.launch``, as for the other front doors).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Union

import torch.nn.functional as F
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_anchor import launch
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.gpt import transformer_config
from nemo_anchor.model.spec import get_block_spec
from nemo_anchor.training.mixin import AnchorConfigMixin, anchor_layer_spec

# fixed by the model, as in nemo-anchor train's: AnchorCoreAttention computes its own softmax, and there are no biases
_FIXED = ("masked_softmax_fusion", "bias_dropout_fusion")
# not taken from another provider: the building machine's device choices must not travel, nor its fixed fields
_NOT_COPIED = (*launch.DECIDED_AT_LAUNCH, *_FIXED)


def anchor_block_spec(config: "AnchorGPTModelProvider", vp_stage: int | None = None):
    """The provider's ``transformer_layer_spec``: our layer spec, with our final norm on the local path."""
    return get_block_spec(anchor_layer_spec(config), config)


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
    # the loss is a sum over tokens divided by the global batch's token count, as in our trainer
    calculate_per_token_loss: bool = True
    transformer_layer_spec: Union[ModuleSpec, Callable] = anchor_block_spec
    masked_softmax_fusion: bool = False
    bias_dropout_fusion: bool = False
    devices_decided_at_construction: ClassVar[bool] = False  # in finalize()

    def finalize(self) -> None:
        """Decide what this process's devices decide, then Bridge's (Megatron's deferred checks), keeping
        ``variable_seq_lengths`` of a dense model (packed windows through pipeline stages).

        Megatron's post-init refuses that flag with the default MoE token dispatcher even without experts
        (``megatron/core/transformer/transformer_config.py:2644``); Bridge sets it after that check for
        its own in-batch packing (``models/transformer_config.py:184-189``), and so does this.
        """
        launch.resolve_model_config(self)
        variable = self.variable_seq_lengths and not self.num_moe_experts
        self.variable_seq_lengths = self.variable_seq_lengths and not variable
        super().finalize()
        self.variable_seq_lengths = self.variable_seq_lengths or variable

    def provide_distributed_model(self, *args, use_cpu_initialization: bool | None = None, **kwargs):
        """Bridge's, keeping the config's ``use_cpu_initialization`` unless told otherwise.

        Bridge's ``get_model`` (``models/model_provider.py:646``) overwrites the config's flag with
        this argument, default False, and its training setup (``training/setup.py:540``) never passes
        it, so without CUDA the model would be moved to a GPU that is not there.
        """
        if use_cpu_initialization is None:
            use_cpu_initialization = self.use_cpu_initialization
        return super().provide_distributed_model(*args, use_cpu_initialization=use_cpu_initialization, **kwargs)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, vocab_size: int, *, bf16: bool = False) -> "AnchorGPTModelProvider":
        """The provider of the model ``nemo-anchor train`` builds for our ``model:`` section ``cfg``."""
        # the devices are the training process's to decide (finalize): not asked where the recipe is built
        ours = transformer_config(cfg, bf16=bf16, device_settings=dict.fromkeys(launch.DECIDED_AT_LAUNCH, False))
        fields = {f.name: getattr(ours, f.name) for f in dataclasses.fields(TransformerConfig)
                  if f.init and f.name not in launch.DECIDED_AT_LAUNCH}
        yarn = {k: getattr(ours, k) for k in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
                                              "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim",
                                              "yarn_correction_range_round_to_int")} if cfg.rope_scaling == "yarn" else {}
        return cls(
            **fields, **yarn,
            attention_type=cfg.attention_type,
            attention_kernel=cfg.attention_backend,
            rope_in_fp32=cfg.rope_in_fp32,
            vocab_size=vocab_size,
            should_pad_vocab=False,
            seq_length=cfg.seq_length,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="yarn" if cfg.rope_scaling == "yarn" else "rope",
            rotary_base=cfg.resolved_rotary_base(),
            rope_scaling=cfg.rope_scaling == "llama3",
            rope_scaling_factor=cfg.rope_scaling_factor,
        )

    @classmethod
    def from_provider(cls, provider: GPTModelProvider, attention_type: str = "anchor") -> "AnchorGPTModelProvider":
        """The same model as a Bridge-made ``provider`` (``AutoBridge.to_megatron_provider()``) with our attention."""
        if not isinstance(provider, GPTModelProvider) or type(provider).provide is not GPTModelProvider.provide:
            raise ValueError(f"{type(provider).__name__} is not a plain GPTModelProvider: AnchorAttention supports "
                             f"Llama-shaped dense GPTs (Llama, Mistral, Qwen2, SmolLM2)")
        fields = {f.name: getattr(provider, f.name) for f in dataclasses.fields(GPTModelProvider)
                  if f.init and f.name != "transformer_layer_spec" and f.name not in _NOT_COPIED}
        return cls(**fields, attention_type=attention_type)
