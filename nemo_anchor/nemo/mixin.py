"""Where checkpoints written before the mixin moved to :mod:`nemo_anchor.training.mixin` find it.

NeMo and Megatron-Bridge record the import path of every function a config holds (the layer spec, the data
step) in each checkpoint's context; those saved by nemo-anchor 2026-11-24 name this module.
"""
from nemo_anchor.training.mixin import AnchorConfigMixin, anchor_data_step, anchor_layer_spec

__all__ = ["AnchorConfigMixin", "anchor_data_step", "anchor_layer_spec"]
