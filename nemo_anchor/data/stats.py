"""Packing statistics: counts, per-domain mixture and token ratios (the paper's Table 9), length histogram."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from nemo_anchor.data.packing import PackSummary


def split_statistics(lengths: np.ndarray, domains: np.ndarray, domain_names: list[str], summary: PackSummary,
                     seq_length: int) -> dict:
    """Statistics of one packed split from its documents' token lengths and domain codes.

    Mixture ratio = a domain's share of documents; token ratio = its share of document tokens.
    """
    total_documents, total_tokens = len(lengths), int(lengths.sum())
    per_domain = {}
    for code, name in enumerate(domain_names):
        mine = lengths[domains == code]
        if mine.size:
            per_domain[name] = {"documents": int(mine.size), "tokens": int(mine.sum()),
                                "mixture_ratio": mine.size / total_documents,
                                "token_ratio": int(mine.sum()) / total_tokens}
    return {
        "seq_length": seq_length,
        "windows": summary.num_windows,
        "tokens": summary.num_windows * seq_length,
        "documents": total_documents,
        **{key: value for key, value in asdict(summary).items() if key != "num_windows"},
        "anchor_tokens": summary.num_windows,
        "segments_per_window_mean": summary.num_segments / summary.num_windows,
        "document_length": {"mean": float(lengths.mean()), "median": float(np.median(lengths)),
                            "p90": float(np.percentile(lengths, 90)), "p99": float(np.percentile(lengths, 99)),
                            "max": int(lengths.max())},
        "domains": per_domain,
    }


def format_statistics(stats: dict) -> str:
    """A human-readable summary of :func:`pack` statistics (one block per split)."""
    skipped = ", ".join(f"{reason} {count}" for reason, count in stats["skipped"].items()) or "none"
    lines = [f"input documents {stats['input_documents']}, held out {stats['held_out']}, skipped: {skipped}"]
    for split, numbers in stats["splits"].items():
        length = numbers["document_length"]
        lines += [
            f"[{split}] {numbers['windows']} windows x {numbers['seq_length']} = {numbers['tokens']} tokens; "
            f"{numbers['documents']} documents, {numbers['document_tokens']} document tokens, "
            f"{numbers['tag_tokens']} tag, {numbers['eos_tokens']} EOS, {numbers['anchor_tokens']} anchor, "
            f"{numbers['padding_tokens']} padding, {numbers['dropped_tokens']} dropped",
            f"  segments per window: mean {numbers['segments_per_window_mean']:.2f}, "
            f"max {numbers['segments_per_window_max']}; document length: mean {length['mean']:.0f}, "
            f"median {length['median']:.0f}, p99 {length['p99']:.0f}, max {length['max']}",
            f"  {'domain':<20} {'documents':>10} {'mixture':>8} {'tokens':>12} {'token ratio':>11}",
        ]
        for name, domain in numbers["domains"].items():
            lines.append(f"  {name:<20} {domain['documents']:>10} {domain['mixture_ratio']:>8.2%} "
                         f"{domain['tokens']:>12} {domain['token_ratio']:>11.2%}")
    return "\n".join(lines)


def plot_document_lengths(lengths: np.ndarray, domains: np.ndarray, domain_names: list[str], seq_length: int,
                          path: Path) -> None:
    """Save a PNG histogram of document lengths (tokens, log-spaced bins), one curve per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = np.unique(np.geomspace(1, max(int(lengths.max()), seq_length) + 1, 60).astype(np.int64))
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for code, name in enumerate(domain_names):
        mine = lengths[domains == code]
        if mine.size:
            axes.hist(mine, bins=bins, histtype="step", linewidth=1.5, label=f"{name} ({mine.size})")
    axes.axvline(seq_length, color="black", linestyle="--", linewidth=1, label=f"window {seq_length}")
    axes.set(xscale="log", xlabel="document length (tokens)", ylabel="documents",
             title=f"Document lengths ({len(lengths)} documents)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
