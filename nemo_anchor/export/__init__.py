"""Hugging Face export/import and inference loading.

- ``nemo_anchor.export.hf``: ``export_hf``, ``import_hf`` (CLI: ``export-hf``, ``import-hf``);
- ``nemo_anchor.export.inference``: ``load_checkpoint`` (our Megatron model as a causal LM) and ``load_hf_model``;
- ``nemo_anchor.export.hf_attention``: importing it registers ``attn_implementation="anchor"`` with transformers;
- ``nemo_anchor.export.pretrained``: ``prepare_smollm2`` (SmolLM2-135M-Instruct as a cached HF directory,
  offline; CLI: ``prepare-smollm2``).

The format readers and name mappings they share with the trainer are ``nemo_anchor.convert``.
Submodules import Megatron and transformers on use; nothing is imported here.
"""
