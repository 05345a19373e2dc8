"""Human-readable views of an evaluation report: a plain-text table and a PNG."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from nemo_anchor.evaluation.outputs import save_figure  # noqa: E402


def format_tables(report: dict) -> str:
    """RULER scores (task x length, averaged over runs), the per-run average, and perplexity by position."""
    runs, mean = report["runs"], report["mean"]
    sections = []
    if mean["ruler"]:
        lengths = list(mean["ruler_average"])
        title = "RULER score (%)" + (f", mean of {len(runs)} checkpoints" if len(runs) > 1 else "")
        rows = [[task, *(scores[length] for length in lengths)] for task, scores in mean["ruler"].items()]
        rows.append(["average", *(mean["ruler_average"][length] for length in lengths)])
        sections.append(_table(title, ["task", *lengths], rows))
        if len(runs) > 1:
            rows = [[_run_label(run), *(run["ruler_average"][length] for length in lengths)] for run in runs]
            sections.append(_table("RULER average per checkpoint (%)", ["checkpoint", *lengths], rows))
    if mean["perplexity"] is not None:
        ppl = mean["perplexity"]
        buckets = zip(ppl["starts"], ppl["ends"], ppl["nll"], ppl["perplexity"])
        rows = [[f"{start}-{end - 1}", nll, value] for start, end, nll, value in buckets]
        sections.append(_table("Perplexity by target position", ["positions", "nll", "ppl"], rows))
    return "\n\n".join(sections)


def plot_report(report: dict, path: str | Path) -> None:
    """RULER score against length per task, perplexity against position and, for several
    checkpoints, the average RULER score against the checkpoint (as in the paper's Figure 4)."""
    runs, mean = report["runs"], report["mean"]
    panels = [bool(mean["ruler"]), mean["perplexity"] is not None, len(runs) > 1 and bool(mean["ruler"])]
    figure, axes = plt.subplots(1, sum(panels), figsize=(6 * sum(panels), 4.4), squeeze=False)
    axes = iter(axes[0])
    if panels[0]:
        axis = next(axes)
        lengths = list(mean["ruler_average"])
        for task, scores in mean["ruler"].items():
            axis.plot(lengths, [scores[length] for length in lengths], marker="o", linewidth=1, label=task)
        axis.plot(lengths, [mean["ruler_average"][length] for length in lengths], "k-", linewidth=2.5, label="average")
        axis.set(title="RULER", xlabel="context length (tokens)", ylabel="score (%)", ylim=(-2, 102))
        axis.legend(fontsize=7)
    if panels[1]:
        axis = next(axes)
        for run in runs if len(runs) > 1 else []:
            ppl = run["perplexity"]
            axis.plot(_centres(ppl), ppl["perplexity"], alpha=0.4, label=_run_label(run))
        ppl = mean["perplexity"]
        axis.plot(_centres(ppl), ppl["perplexity"], "k-o", linewidth=2, label="mean" if len(runs) > 1 else None)
        axis.set(title="Perplexity by position", xlabel="target position (bucket centre)", ylabel="perplexity")
        if len(runs) > 1:
            axis.legend(fontsize=7)
    if panels[2]:
        axis = next(axes)
        labels = [_run_label(run) for run in runs]
        for length in mean["ruler_average"]:
            scores = [run["ruler_average"][length] for run in runs]
            (line,) = axis.plot(labels, scores, marker="o", label=f"{length} tokens")
            axis.axhline(mean["ruler_average"][length], color=line.get_color(), linestyle="--", linewidth=1)
        axis.set(
            title="RULER average per checkpoint (dashed: mean)", xlabel="checkpoint", ylabel="score (%)", ylim=(-2, 102)
        )
        axis.legend(fontsize=7)
    for axis in figure.axes:
        axis.grid(alpha=0.3)
    save_figure(figure, path)


def _table(title: str, header: list, rows: list[list]) -> str:
    cells = [[str(cell) for cell in header]] + [[_cell(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in cells) for column in range(len(header))]
    # First column (names) left-aligned, numbers right-aligned.
    lines = [title] + [
        "  ".join([row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])])
        for row in cells
    ]
    lines.insert(2, "-" * len(lines[1]))
    return "\n".join(lines)


def _cell(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _run_label(run: dict) -> str:
    return f"iter {run['iteration']}" if run["iteration"] is not None else Path(run["model"]).name


def _centres(perplexity: dict) -> list[float]:
    return [(start + end - 1) / 2 for start, end in zip(perplexity["starts"], perplexity["ends"])]
