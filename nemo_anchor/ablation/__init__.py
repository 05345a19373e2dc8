"""The paper's controlled ablation as one command (Tables 2-5, Figure 4 of Wang et al.).

Every variant (an attention type, optionally with domain-tag or interleaved-chunk packing) trains
from the same starting weights on the same documents with the same seed and steps, then is
evaluated the same way, averaged over its last K checkpoints.

- :mod:`~nemo_anchor.ablation.variants`: variant names (``anchor``, ``anchor+tag`` ...).
- :mod:`~nemo_anchor.ablation.config`: the ablation YAML (the trainer's sections plus ``pack`` and ``eval``).
- :mod:`~nemo_anchor.ablation.plan`: the output directory's layout and each variant's training config.
- :mod:`~nemo_anchor.ablation.runner`: pack, train (skipping finished variants, resuming interrupted
  ones), evaluate; or print one ``torchrun`` launch per variant.
- :mod:`~nemo_anchor.ablation.measure`: one variant's metrics over its last K checkpoints.
- :mod:`~nemo_anchor.ablation.report`, :mod:`~nemo_anchor.ablation.plots`: ``ablation.json``, the markdown
  table with noise statements, the plots.
- :mod:`~nemo_anchor.ablation.cli`: ``nemo-anchor ablate``.
"""
