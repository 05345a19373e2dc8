"""``nemo-anchor eval``: RULER-style tasks and perplexity by position, for one model or the last K checkpoints."""
from __future__ import annotations

import argparse
from pathlib import Path

from nemo_anchor.evaluation.models import DTYPES
from nemo_anchor.export.cli import add_verify_argument
from nemo_anchor.evaluation.ruler import TASKS
from nemo_anchor.evaluation.runner import EvalSettings

DEFAULTS = EvalSettings()


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="RULER-style long-context tasks and perplexity by position",
        description=(
            "Writes OUTPUT/eval.json (per run and mean), OUTPUT/predictions.jsonl and OUTPUT/eval.png, "
            "and prints the tables. With --last-k K, --checkpoint is a training output_dir whose last K "
            "checkpoints (OUTPUT_DIR/checkpoints/iter_<N>) are evaluated and averaged."
        ),
    )
    add_model_arguments(parser)
    parser.add_argument("--output", type=Path, required=True, help="directory for eval.json, predictions and the plot")
    add_overwrite_argument(parser)
    parser.add_argument("--last-k", type=int, help="average over the last K checkpoints of --checkpoint OUTPUT_DIR")
    parser.add_argument(
        "--tasks", nargs="*", choices=[*sorted(TASKS), "none"], default=list(DEFAULTS.tasks), metavar="TASK",
        help=f"RULER-style tasks (default: all of {', '.join(TASKS)}); none to skip them",
    )
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths (default: 4K..128K, up to the model's)")
    parser.add_argument("--num-samples", type=int, default=DEFAULTS.num_samples, help="samples per task and length")
    parser.add_argument("--max-new-tokens", type=int, help="override every task's generation budget")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed of the generated tasks")
    parser.add_argument("--perplexity-data", nargs="+", default=[], help="packed dataset directory or text/JSONL files")
    parser.add_argument("--perplexity-length", type=int, default=DEFAULTS.perplexity_length, help="tokens per window")
    parser.add_argument("--perplexity-windows", type=int, default=DEFAULTS.perplexity_windows, help="windows averaged")
    parser.add_argument("--perplexity-buckets", type=int, default=DEFAULTS.perplexity_buckets, help="position buckets")
    parser.add_argument("--text-key", default=DEFAULTS.text_key, help="JSONL field holding the text")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    parser.set_defaults(func=run)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint DIR | --hf DIR``, shared by ``nemo-anchor eval`` and ``nemo-anchor probe``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a training output_dir or one of its checkpoint directories")
    source.add_argument("--hf", type=hf_model_dir, help="a local Hugging Face model directory")
    add_verify_argument(parser)


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --output written by this command (nothing else is replaced)")


def hf_model_dir(value: str) -> Path:
    """``--hf``: a directory holding ``config.json`` (argparse names the argument when it is not)."""
    from nemo_anchor.hf_dir import require_hf_dir

    try:
        return require_hf_dir(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{error}; use --checkpoint for a training output_dir") from None


def run(args: argparse.Namespace) -> int:
    from nemo_anchor import launch
    from nemo_anchor.checksums import verification

    # every checkpoint's files against its checksums, unless --no-verify; on the CPU where an expected GPU is missing
    with verification(args.verify), launch.cpu_capable("nemo-anchor eval"):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from nemo_anchor.atomic import atomic_directory, check_output
    from nemo_anchor.evaluation.checkpoints import last_checkpoints
    from nemo_anchor.evaluation.models import parse_dtype
    from nemo_anchor.evaluation.outputs import write_json, write_jsonl
    from nemo_anchor.evaluation.report import format_tables, plot_report
    from nemo_anchor.evaluation.runner import evaluate_paths

    inputs = [args.checkpoint or args.hf, *args.perplexity_data]
    check_output(args.output, inputs, overwrite=args.overwrite, command="eval")  # before any model is loaded
    if args.last_k is not None:
        if args.checkpoint is None:
            raise ValueError("--last-k needs --checkpoint OUTPUT_DIR (a training output_dir)")
        models = [(path, iteration) for iteration, path in last_checkpoints(args.checkpoint, args.last_k)]
        print(f"averaging over {len(models)} checkpoints: {', '.join(path.name for path, _ in models)}")
    else:
        models = [(args.checkpoint or args.hf, None)]
    if "none" in args.tasks and len(args.tasks) > 1:
        raise ValueError(f"--tasks none cannot be combined with tasks, got {args.tasks}")
    settings = EvalSettings(
        tasks=() if args.tasks == ["none"] else tuple(args.tasks),
        lengths=tuple(args.lengths) if args.lengths else None,
        num_samples=args.num_samples,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        perplexity_data=tuple(args.perplexity_data),
        perplexity_length=args.perplexity_length,
        perplexity_windows=args.perplexity_windows,
        perplexity_buckets=args.perplexity_buckets,
        text_key=args.text_key,
    )
    report, predictions = evaluate_paths(models, settings, dtype=parse_dtype(args.dtype), device=args.device)
    with atomic_directory(args.output, inputs=inputs, overwrite=args.overwrite, command="eval") as staging:
        write_json(staging / "eval.json", report)
        write_jsonl(staging / "predictions.jsonl", predictions)
        plot_report(report, staging / "eval.png")
    print(format_tables(report))
    print(f"wrote {args.output / 'eval.json'} and {args.output / 'eval.png'}")
    return 0
