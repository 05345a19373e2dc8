"""Evaluations of Section 4.2 of Wang et al.: RULER-style tasks, perplexity by position, checkpoint averaging.

- :mod:`~nemo_anchor.evaluation.ruler`: the tasks, generated offline with the model's tokenizer.
- :mod:`~nemo_anchor.evaluation.scoring`: RULER's string-match metrics.
- :mod:`~nemo_anchor.evaluation.perplexity`: next-token loss per position bucket.
- :mod:`~nemo_anchor.evaluation.checkpoints`: the last K checkpoints of a training run.
- :mod:`~nemo_anchor.evaluation.runner`: greedy decoding, scoring and averaging over models.
- :mod:`~nemo_anchor.evaluation.models`, :mod:`~nemo_anchor.evaluation.corpus`: loading models and token windows
  (shared with the probe in :mod:`nemo_anchor.analysis`).
- :mod:`~nemo_anchor.evaluation.report`, :mod:`~nemo_anchor.evaluation.outputs`: tables, plots, atomic files.
- :mod:`~nemo_anchor.evaluation.cli`: ``nemo-anchor eval``.
"""
