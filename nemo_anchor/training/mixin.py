"""What turns a Megatron ``TransformerConfig`` subclass into an AnchorAttention model config.

NeMo 2 configs (``nemo_anchor.nemo.config``) and the Megatron-Bridge provider
(``nemo_anchor.bridge.provider``) share :class:`AnchorConfigMixin`: an ``attention_type`` field, a
``transformer_layer_spec`` that builds our spec (Megatron's GPT layer spec with
``AnchorCoreAttention``), and data/forward steps that carry document and window boundaries to
the core attention through ``AnchorPackedSeqParams``. Nothing here imports NeMo.
"""
import functools
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Union

import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec

from nemo_anchor import launch
from nemo_anchor.attention.functional import backend_refusal
from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.data import variable_shape_batch
from nemo_anchor.model.gpt import YarnFields
from nemo_anchor.model.spec import get_layer_spec
from nemo_anchor.parallel.context_parallel import batch_for_this_rank
from nemo_anchor.training.forward import forward_step

# Keys of a collated batch (``nemo_anchor.data.collate_windows``) that the forward step reads.
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_windows")


def anchor_layer_spec(config: "AnchorConfigMixin") -> ModuleSpec:
    """The config's ``transformer_layer_spec`` hook: our layer spec for ``config.attention_type``."""
    return get_layer_spec(config.attention_type, config.attention_kernel, qk_layernorm=config.qk_layernorm)


def anchor_data_step(dataloader_iter, attention_type: str = "anchor") -> dict[str, torch.Tensor]:
    """NeMo's ``data_step_fn``: the next collated batch on this rank's device and context-parallel shard.

    NeMo's ``gpt_data_step`` would drop ``cu_windows`` (it keeps only the keys it knows) and its
    context-parallel split ignores document boundaries, so packed windows take this path. The
    configs bind ``attention_type``, which decides how windows are cut across ranks. Batches in
    Megatron-LM's fixed shapes (:func:`nemo_anchor.data.fixed_shape_batch`: padded ``cu_seqlens``,
    ``cu_seqlens_argmin``) are turned back on the host first. NeMo's and Bridge's packed fine-tuning batches
    are refused.
    """
    batch = next(dataloader_iter)
    if isinstance(batch, tuple):  # (batch, batch_idx, dataloader_idx) from Lightning's fetcher
        batch = batch[0]
    if "cu_seqlens_unpadded" in batch:
        raise ValueError("batch is a packed fine-tuning batch (NeMo's or Megatron-Bridge's GPTSFTPackedDataset: "
                         "cu_seqlens_unpadded), whose cu_seqlens mark sequences, not windows that begin with their "
                         "anchor: feed batches of nemo-anchor pack output (AnchorPackedDataModule, Bridge's "
                         "dataset.path)")
    batch = variable_shape_batch(batch)
    missing = [k for k in _BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch lacks {missing}: feed AnchorPackedDataModule (nemo_anchor.data.collate_windows) batches")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return batch_for_this_rank({k: batch[k] for k in _BATCH_KEYS}, attention_type, device)


@dataclass
class AnchorConfigMixin(YarnFields):
    """Put first among the bases of a ``GPTConfig`` / ``GPTModelProvider`` subclass declared ``@dataclass``."""

    attention_type: str = "anchor"  # full | intra_doc | intra_doc_reset | anchor
    attention_kernel: str = "auto"  # nemo_anchor.attention backend; `attention_backend` is Megatron's
    rope_in_fp32: bool = False  # rotate q/k in fp32 (the unfused RoPE path)
    transformer_layer_spec: Union[ModuleSpec, Callable] = anchor_layer_spec
    forward_step_fn: Callable = forward_step  # the forward step `nemo-anchor train` runs
    data_step_fn: Callable = anchor_data_step
    # None: decided by the devices of the process that builds the model (nemo_anchor.launch): on with CUDA and TE
    bias_activation_fusion: Optional[bool] = None
    cross_entropy_loss_fusion: Optional[bool] = None
    persist_layer_norm: Optional[bool] = None
    apply_rope_fusion: Optional[bool] = None
    gradient_accumulation_fusion: Optional[bool] = None
    # NeMo builds its configs in the training process; Bridge prints its provider with the recipe and
    # decides in finalize(), which its pretrain() calls
    devices_decided_at_construction: ClassVar[bool] = True

    def __post_init__(self):
        refusal = backend_refusal(self.attention_kernel, get_attention_type(self.attention_type).mask)
        if refusal:  # get_attention_type raised already for an unknown type, naming the choices
            raise ValueError(f"attention_kernel={self.attention_kernel!r}: {refusal}")
        if self.attention_backend == AttnBackend.local:
            raise ValueError("attention_backend=local makes NeMo replace the core attention with Megatron's "
                             "DotProductAttention; leave it at auto to keep AnchorCoreAttention")
        if self.window_size is not None:
            raise ValueError(f"window_size={self.window_size}: sliding-window attention is not supported "
                             "with AnchorCoreAttention; set window_size to null")
        if self.data_step_fn is anchor_data_step:
            self.data_step_fn = functools.partial(anchor_data_step, attention_type=self.attention_type)
        if self.devices_decided_at_construction:
            launch.resolve_model_config(self)
        if not self.num_attention_heads:
            # unsized: a placeholder whose shape comes from elsewhere, as in
            # llm.import_ckpt(model=AnchorLlamaModel(AnchorLlamaConfig()), source="hf://...");
            # Megatron's checks (which divide by the head count) run when a sized config is made
            return
        super().__post_init__()

    @property
    def anchor_attention_type(self) -> str:
        """The name ``nemo_anchor.model`` reads (``AnchorTransformerConfig``); NeMo YAML says ``attention_type``."""
        return self.attention_type
