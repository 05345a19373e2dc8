"""``nemo-anchor probe``: the BF16 RoPE probe (Figure 1 of the paper) for one model."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nemo_anchor.analysis.probe import PAPER_LENGTHS, PAPER_SHIFTS, VARIANTS, ProbeSettings
from nemo_anchor.evaluation.cli import add_model_arguments, add_overwrite_argument

DEFAULTS = ProbeSettings()


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="measure how bf16 breaks RoPE's relative positions (Figure 1 of the paper)",
        description=(
            "Writes OUTPUT/probe.json ({variant: {D, per_token, D_logit}}), OUTPUT/probe_settings.json "
            "and OUTPUT/figure1.png."
        ),
    )
    add_model_arguments(parser)
    parser.add_argument("--output", type=Path, required=True, help="directory for probe.json and the plot")
    add_overwrite_argument(parser)
    parser.add_argument(
        "--data", type=Path, nargs="+", required=True,
        help="a packed dataset directory, or text / JSONL files (one document per file / line)",
    )
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text (default: text)")
    parser.add_argument("--num-sequences", type=int, default=DEFAULTS.num_sequences, help="sequences averaged over")
    parser.add_argument("--sequence-length", type=int, default=DEFAULTS.sequence_length, help="tokens per sequence (D)")
    parser.add_argument("--shifts", type=int, nargs="+", default=list(PAPER_SHIFTS), help="the Δ1 values (paper's)")
    parser.add_argument("--reference-shift", type=int, default=DEFAULTS.reference_shift, help="Δ2 (default 16)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(PAPER_LENGTHS), help="lengths for D_logit")
    parser.add_argument("--max-length", type=int, default=DEFAULTS.max_length, help="cap on the D_logit lengths")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the random_bf16 initialisation")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nemo_anchor import launch
    from nemo_anchor.checksums import verification

    # a --checkpoint's files against its checksums, unless --no-verify; on the CPU where an expected GPU is missing
    with verification(args.verify), launch.cpu_capable("nemo-anchor probe"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from nemo_anchor.analysis.plots import plot_figure1
    from nemo_anchor.analysis.probe import run_probe
    from nemo_anchor.atomic import atomic_directory, check_output
    from nemo_anchor.evaluation.outputs import write_json

    settings = ProbeSettings(
        num_sequences=args.num_sequences,
        sequence_length=args.sequence_length,
        shifts=tuple(args.shifts),
        reference_shift=args.reference_shift,
        lengths=tuple(args.lengths),
        max_length=args.max_length,
        variants=tuple(args.variants),
        seed=args.seed,
    )
    model_path = args.checkpoint or args.hf
    inputs = [model_path, *args.data]
    check_output(args.output, inputs, overwrite=args.overwrite, command="probe")  # before the model is loaded
    results, metadata = run_probe(model_path, args.data, settings, device=args.device, text_key=args.text_key)
    left_out = sorted(set(settings.lengths) - set(metadata["logit_lengths"]))
    if left_out:
        print(f"D_logit lengths {left_out} left out: above --max-length or the model's max_position_embeddings")
    with atomic_directory(args.output, inputs=inputs, overwrite=args.overwrite, command="probe") as staging:
        write_json(staging / "probe.json", results)
        write_json(staging / "probe_settings.json", metadata)
        plot_figure1(results, settings.reference_shift, staging / "figure1.png")
    print(summary(results, settings.reference_shift))
    print(f"wrote {args.output / 'probe.json'} and {args.output / 'figure1.png'}")
    return 0


def summary(results: dict, reference_shift: int) -> str:
    """What a person reads first: D at Δ1 = 0, how the first token's per-token difference compares
    with the others' (the paper finds it the largest), and D_logit at the longest length."""
    header = f"D(0,{reference_shift})"
    lines = [f"{'variant':<12} {header:>12} {'first/median':>13} {'first rank':>11} {'D_logit':>12} (length)"]
    for variant, measured in results.items():
        per_token = torch.tensor(measured["per_token"])
        ratio = (per_token[0] / per_token[1:].median()).item() if len(per_token) > 1 else float("nan")
        rank = int((per_token > per_token[0]).sum()) + 1
        longest = max(measured["D_logit"], key=int, default=None)
        logit = f"{measured['D_logit'][longest]:12.4g} ({longest})" if longest else f"{'-':>12}"
        total = per_token.sum().item()
        lines.append(f"{variant:<12} {total:12.4g} {ratio:13.3g} {rank:>6}/{len(per_token):<4} {logit}")
    return "\n".join(lines)
