"""NeMo 2 integration (the ``nemo`` extra): AnchorAttention models, configs, recipes and a packed data module.

``from nemo_anchor.nemo import AnchorLlamaConfig, AnchorLlamaModel, ...`` imports NeMo (about 20 s)
on first use of a name; importing this package alone does not.

- ``nemo_anchor.nemo.config``: ``AnchorLlamaConfig``, ``AnchorMistralConfig``, ``AnchorQwen2Config`` and
  the paper's presets; ``model.config.attention_type`` in NeMo YAML selects the attention.
- ``nemo_anchor.nemo.models``: ``AnchorLlamaModel``, ``AnchorMistralModel``, ``AnchorQwen2Model`` with
  their ``hf`` importers and exporters (``nemo_anchor.nemo.hf_io``).
- ``nemo_anchor.nemo.recipes``: ``llm.pretrain`` recipes (``nemo llm pretrain --factory ...``).
- ``nemo_anchor.nemo.data``: ``AnchorPackedDataModule`` over ``nemo-anchor pack`` output.
- ``nemo_anchor.nemo.cpu``: what NeMo needs on a machine without CUDA (applied on import).
- Megatron-Bridge (NVIDIA's successor to the NeMo 2 LLM collection): ``nemo_anchor.bridge``.
"""
import importlib

_EXPORTS = {
    "AnchorLlamaConfig": "config", "AnchorLlama31Config": "config", "AnchorMistralConfig": "config",
    "AnchorQwen2Config": "config", "AnchorSmolLM2Config135M": "config", "AnchorLlama2Config7B": "config",
    "AnchorLlama3Config8B": "config", "AnchorMistral7BV03Config": "config", "AnchorQwen15Config1P8B": "config",
    "AnchorLlamaModel": "models", "AnchorMistralModel": "models", "AnchorQwen2Model": "models",
    "AnchorPackedDataModule": "data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
