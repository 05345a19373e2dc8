"""One model's weights and config across formats: below the trainer, the exporters and the front doors.

- ``nemo_anchor.convert.megatron_state``: Megatron-Core GPT weights under one spelling (local and
  Transformer Engine names, stacked ``dist_checkpointing`` layers), building a model and loading into it;
- ``nemo_anchor.convert.hf_mapping``: Hugging Face <-> Megatron weights and configs;
- ``nemo_anchor.convert.hf_slices``: that mapping on this rank's slices of safetensors files;
- ``nemo_anchor.convert.sources``: reading HF directories, nemo-anchor and NeMo 2 checkpoints;
- ``nemo_anchor.convert.weight_match``: the one rule that every tensor needed is there and every tensor given is used.

``nemo_anchor.training`` (``model.init_from_hf``), ``nemo_anchor.export`` (``export-hf``, ``import-hf``,
inference), ``nemo_anchor.evaluation`` and ``nemo_anchor.nemo`` read and write weights through these
modules; nothing here imports them. Submodules import Megatron and transformers on use.
"""
