"""NeMo 2 integration (the ``nemo`` extra): AnchorAttention model configs, recipes and a packed data module.

- ``nemo_anchor.nemo.config``: ``AnchorLlamaConfig``, ``AnchorMistralConfig``, ``AnchorQwen2Config`` and
  the paper's presets; ``model.config.attention_type`` in NeMo YAML selects the attention.
- ``nemo_anchor.nemo.recipes``: ``llm.pretrain`` recipes (``nemo llm pretrain --factory ...``).
- ``nemo_anchor.nemo.data``: ``AnchorPackedDataModule`` over ``nemo-anchor pack`` output.
- Megatron-Bridge (NVIDIA's successor to the NeMo 2 LLM collection): ``nemo_anchor.bridge``.

Submodules import NeMo (about 20 s), so nothing is imported here.
"""
