"""``ablation.json`` and ``ablation.md``: every metric of every variant, with its spread, and which
differences from the reference variant (the first one listed) are within the noise.

A difference counts as within the noise when ``|mean_a - mean_b| <= sqrt(std_a^2 + std_b^2)``,
the combined spread over the last K checkpoints (over training steps for tokens/s). With a single
checkpoint there is no spread and no difference is called significant.
"""
from __future__ import annotations

import math

NOISE_RULE = "|difference| <= sqrt(std_variant^2 + std_reference^2)"


def compare(variants: dict[str, dict], reference: str) -> list[dict]:
    """One record per (variant other than ``reference``, metric): difference, noise, within_noise."""
    out = []
    base = variants[reference]["metrics"]
    for name, measured in variants.items():
        if name == reference:
            continue
        for key, ours in measured["metrics"].items():
            theirs = base.get(key)
            if theirs is None:
                continue
            difference = ours["mean"] - theirs["mean"]
            noise = None if ours["std"] is None or theirs["std"] is None else math.hypot(ours["std"], theirs["std"])
            out.append({"variant": name, "reference": reference, "metric": key, "label": ours["label"],
                        "better": ours["better"], "difference": difference, "noise": noise,
                        "within_noise": None if noise is None else abs(difference) <= noise})
    return out


def metric_columns(variants: dict[str, dict]) -> list[tuple[str, str]]:
    """``(key, label)`` of every metric any variant has, in first-seen order."""
    columns: dict[str, str] = {}
    for measured in variants.values():
        for key, metric in measured["metrics"].items():
            columns.setdefault(key, metric["label"])
    return list(columns.items())


def markdown(report: dict) -> str:
    variants, reference = report["variants"], report["reference"]
    columns = metric_columns(variants)
    start = {True: "verified identical starting weights", False: "DIFFERENT starting weights (see start digests)",
             None: "starting weights not verified (a variant was trained by a torchrun launch)"}[report["same_start"]]
    lines = [f"# Ablation: {', '.join(variants)}", "",
             f"{report['steps']} steps per variant from {report['start']} ({start}), on the same documents with "
             f"the same seed. Values: mean ± sample std over the last {report['last_k']} checkpoints (steps "
             f"{report['checkpoint_steps']}); tokens/s: over training steps.", "",
             "| variant | " + " | ".join(label for _, label in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for name, measured in variants.items():
        cells = [_cell(measured["metrics"].get(key)) for key, _ in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("valid_loss" in measured["metrics"] for measured in variants.values()):
        lines += ["", "The held-out loss is the trainer's, under each variant's own attention mask: `full` also "
                  "sees the earlier documents of a window, so it differs from the document-masked variants by "
                  "construction. Held-out ppl and ppl by position evaluate every exported model the same way "
                  "(a plain causal LM on the same held-out windows)."]
    lines += ["", f"## Differences from `{reference}`", "", f"Within the noise means {NOISE_RULE}: such a "
              "difference does not show that either variant is better.", ""]
    lines += noise_statements(report["comparisons"])
    return "\n".join(lines) + "\n"


def noise_statements(comparisons: list[dict]) -> list[str]:
    """One plain sentence per variant: which differences are within the noise and which are not."""
    lines = []
    for name in dict.fromkeys(c["variant"] for c in comparisons):
        mine = [c for c in comparisons if c["variant"] == name]
        unknown = [c for c in mine if c["within_noise"] is None]
        if len(unknown) == len(mine):
            lines.append(f"- **{name}**: no spread was measured (a single checkpoint), so none of its differences "
                         f"from {mine[0]['reference']} can be told from noise.")
            continue
        beyond = [c for c in mine if c["within_noise"] is False]
        within = [c for c in mine if c["within_noise"]]
        no_spread = f" No spread measured for: {', '.join(c['label'] for c in unknown)}." if unknown else ""
        if not beyond:
            lines.append(f"- **{name}**: every difference from {mine[0]['reference']} is within the noise "
                         f"({len(within)} metrics): no evidence here that it is better or worse.{no_spread}")
            continue
        described = "; ".join(f"{c['label']} {_signed(c['difference'])} (noise ±{c['noise']:.3g}, "
                              f"{_verdict(c)})" for c in beyond)
        lines.append(f"- **{name}**: beyond the noise: {described}. Within the noise: "
                     f"{', '.join(c['label'] for c in within) or 'none'}.{no_spread}")
    return lines


def _verdict(comparison: dict) -> str:
    better = (comparison["difference"] > 0) == (comparison["better"] == "higher")
    return "better" if better else "worse"


def _signed(value: float) -> str:
    return f"{value:+.3g}"


def _cell(metric: dict | None) -> str:
    if metric is None:
        return "-"
    if metric["std"] is None:
        return f"{metric['mean']:.4g}"
    return f"{metric['mean']:.4g} ± {metric['std']:.2g}"
