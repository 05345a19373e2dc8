"""Figure 1 of Wang et al. from a probe's results (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from nemo_anchor.evaluation.outputs import save_figure  # noqa: E402

_COLOURS = {"bf16": "tab:blue", "fp32": "tab:orange", "random_bf16": "tab:green"}
_LABELS = {"bf16": "pretrained, BFloat16", "fp32": "pretrained, Float32", "random_bf16": "random init, BFloat16"}


def plot_figure1(results: dict, reference_shift: int, path: str | Path) -> None:
    """Write a three-panel PNG shaped like Figure 1.

    Left: D against Δ1 (categorical axis, Δ1 = Δ2 left out as in the paper); middle: per-token
    difference between Δ1 = 0 and Δ2; right: D_logit against sequence length. Log-scaled values,
    since fp32 sits orders of magnitude below bf16.
    """
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.6))
    for variant, measured in results.items():
        style = {"color": _COLOURS.get(variant), "label": _LABELS.get(variant, variant)}
        shifts = [shift for shift in measured["D"] if int(shift) != reference_shift]
        left.plot(range(len(shifts)), [measured["D"][shift] for shift in shifts], marker="o", **style)
        left.set_xticks(range(len(shifts)), shifts, rotation=60)
        middle.plot(range(len(measured["per_token"])), measured["per_token"], linewidth=0.8, **style)
        lengths = [int(length) for length in measured["D_logit"]]
        right.plot(lengths, list(measured["D_logit"].values()), marker="o", **style)
    left.set(title=f"Attention difference D (Δ2 = {reference_shift})", xlabel="Δ1", ylabel="D")
    middle.set(
        title=f"Per-token difference (Δ1 = 0, Δ2 = {reference_shift})", xlabel="key token index", ylabel="difference"
    )
    right.set(title="First-token logit difference D_logit", xlabel="sequence length", ylabel="D_logit")
    right.set_xscale("log", base=2)
    for axis in (left, middle, right):
        axis.set_yscale("log", nonpositive="mask")
        axis.grid(alpha=0.3)
    left.legend()
    save_figure(figure, path)
