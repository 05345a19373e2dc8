"""The ablation's figures: loss curves of every variant on one axis, RULER score against length and
perplexity against position per variant (mean ± std over the last K checkpoints)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from nemo_anchor.evaluation.outputs import save_figure  # noqa: E402


def plot_loss_curves(report: dict, path: str | Path) -> None:
    """Training loss per step (lines) and held-out loss (dashed, markers), one colour per variant."""
    figure, axis = plt.subplots(figsize=(7, 4.4))
    for index, (name, measured) in enumerate(report["variants"].items()):
        colour = f"C{index}"
        steps, losses = zip(*measured["curves"]["loss"]) if measured["curves"]["loss"] else ((), ())
        axis.plot(steps, losses, color=colour, linewidth=1, label=f"{name} train")
        if measured["curves"]["valid_loss"]:
            steps, losses = zip(*measured["curves"]["valid_loss"])
            axis.plot(steps, losses, color=colour, linestyle="--", marker="o", label=f"{name} held-out")
    axis.set(title="Loss", xlabel="step", ylabel="loss (nats/token)")
    axis.legend(fontsize=7)
    save_figure(figure, path)


def plot_ruler(report: dict, path: str | Path) -> bool:
    """RULER average score against context length per variant; False (nothing written) without RULER."""
    return _per_variant(report, "ruler@", "RULER (mean over tasks)", "context length (tokens)", "score (%)", path,
                        ylim=(-2, 102))


def plot_perplexity(report: dict, path: str | Path) -> bool:
    """Held-out perplexity against target position (bucket start) per variant."""
    return _per_variant(report, "ppl@", "Held-out perplexity by position", "target position (bucket start)",
                        "perplexity", path)


def _per_variant(report: dict, prefix: str, title: str, xlabel: str, ylabel: str, path: str | Path,
                 ylim: tuple[float, float] | None = None) -> bool:
    figure, axis = plt.subplots(figsize=(7, 4.4))
    plotted = False
    for name, measured in report["variants"].items():
        points = [(int(key[len(prefix):].split("-")[0]), metric) for key, metric in measured["metrics"].items()
                  if key.startswith(prefix)]
        if not points:
            continue
        points.sort(key=lambda point: point[0])
        xs = [x for x, _ in points]
        axis.errorbar(xs, [m["mean"] for _, m in points], yerr=[m["std"] or 0.0 for _, m in points],
                      marker="o", capsize=3, label=name)
        plotted = True
    if not plotted:
        plt.close(figure)
        return False
    axis.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ylim is not None:
        axis.set_ylim(*ylim)
    axis.legend(fontsize=7)
    save_figure(figure, path)
    return True
