"""What the benchmark scripts share: argument types whose errors are one line naming the option (argparse's
``error: argument --tokens: ...``), and the line that says which attention path a benchmark measured."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive whole numbers (``8192,32768``)."""
    return [positive_int(part) for part in text.split(",")]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def attention_path(backend: str, mode: str, device) -> str:
    """``backend (kernel family); how the anchor is attended to, and why``: the line each benchmark prints above
    its numbers (e.g. ``anchor merge: torch fallback (cpu tensors; the Triton path needs a GPU or
    TRITON_INTERPRET=1)``)."""
    from nemo_anchor.attention.functional import anchor_handling, kernel_family

    anchor = anchor_handling(backend, mode, device)
    return f"{backend} ({kernel_family(backend)}){f'; {anchor}' if anchor else ''}"
