"""nemo-anchor: AnchorAttention long-context training for NVIDIA NeMo / Megatron-Core.

AnchorAttention (Wang et al., "When Precision Meets Position: BFloat16 Breaks Down RoPE in
Long-Context Training"): in a packed window of several documents every token attends causally
within its own document plus the window's first token (the shared anchor, BOS at position 0);
position ids stay continuous across the window.
"""

__version__ = "0.1.0"


def load_checkpoint(path, **kwargs):
    """Load a training output_dir, checkpoint directory or HF directory for inference.

    See :func:`nemo_anchor.export.inference.load_checkpoint`.
    """
    from nemo_anchor.export.inference import load_checkpoint as _load

    return _load(path, **kwargs)
