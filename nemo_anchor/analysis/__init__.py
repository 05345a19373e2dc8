"""The BF16 RoPE probe: Section 2 and Figure 1 of Wang et al.

- :mod:`~nemo_anchor.analysis.shift_metrics`: D of Eq. 4 and D_logit of Eq. 5 for one sequence.
- :mod:`~nemo_anchor.analysis.probe`: the three variants (bf16, fp32, random_bf16), averaged over sequences.
- :mod:`~nemo_anchor.analysis.plots`: the Figure 1 PNG.
- :mod:`~nemo_anchor.analysis.cli`: ``nemo-anchor probe``.
"""
