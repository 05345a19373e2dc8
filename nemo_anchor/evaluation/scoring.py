"""RULER's scoring: case-insensitive substring matches of the expected strings, in percent."""
from __future__ import annotations

import re
from typing import Sequence

_CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f]")


def postprocess_prediction(text: str) -> str:
    """RULER's ``postprocess_pred``: control characters become newlines, outer whitespace is dropped."""
    return _CONTROL_CHARACTERS.sub("\n", text.strip()).strip()


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean over samples of the fraction of a sample's references found in its prediction, in [0, 100]."""
    _check_pairs(predictions, references)
    per_sample = [
        sum(ref.lower() in pred.lower() for ref in refs) / len(refs) for pred, refs in zip(predictions, references)
    ]
    return 100.0 * sum(per_sample) / len(per_sample)


def _check_pairs(predictions, references) -> None:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need as many predictions as references (> 0), got {len(predictions)} and {len(references)}")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every sample needs at least one reference string")
