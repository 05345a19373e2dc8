"""``nemo-anchor ablate``: the paper's controlled comparison of attention paradigms, as one command."""
from __future__ import annotations

import argparse
from pathlib import Path

from nemo_anchor.ablation.variants import MAIN_VARIANTS


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "ablate", help="train and evaluate attention paradigms side by side (the paper's ablation)",
        description=(
            "Packs the config's documents (plus the tag / interleave packings the variants need), trains every "
            "variant from the same weights on the same documents with the same seed and steps, evaluates each "
            "over its last K checkpoints, and writes OUTPUT/ablation.json, OUTPUT/ablation.md and plots. Run it "
            "again to resume: finished variants are skipped, an interrupted one resumes. With --print-launches "
            "it only prepares the data and prints one torchrun command per variant; run them (in parallel on "
            "separate machines if you like), then this command again to evaluate."))
    parser.add_argument("--config", type=Path, required=True,
                        help="ablation YAML: model/trainer/optim/checkpoint sections plus pack and eval")
    parser.add_argument("--variants", default=",".join(MAIN_VARIANTS),
                        help="comma-separated ATTENTION_TYPE[+tag|+interleave]; the first is the reference "
                             f"(default: {','.join(MAIN_VARIANTS)})")
    parser.add_argument("--output", type=Path, required=True, help="the ablation directory")
    parser.add_argument("--eval-lengths", nargs="+", action=_LengthsThenOverrides, metavar="L",
                        help="RULER lengths (overrides eval.lengths)")
    parser.add_argument("--last-k", type=int, help="checkpoints averaged over (overrides eval.last_k)")
    parser.add_argument("--print-launches", action="store_true",
                        help="prepare data and configs, print one torchrun command per variant, train nothing")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="for --print-launches (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="for --print-launches (default 1)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="OmegaConf dotlist overrides, e.g. trainer.max_steps=100 pack.inputs=[a.jsonl]")
    parser.set_defaults(func=run, overrides_after_lengths=[])


class _LengthsThenOverrides(argparse.Action):
    """``--eval-lengths L ...`` as integers; argparse's ``nargs="+"`` also takes the ``key=value``
    overrides that follow them (the usage line's order), which go back to the overrides."""

    def __call__(self, parser, namespace, values, option_string=None):
        first = next((i for i, value in enumerate(values) if "=" in value), len(values))
        lengths, overrides = values[:first], values[first:]
        for value in lengths:
            if not value.lstrip("-").isdigit():
                parser.error(f"argument {option_string}: invalid int value: {value!r}")
        setattr(namespace, self.dest, [int(value) for value in lengths])
        namespace.overrides_after_lengths = overrides


def run(args: argparse.Namespace) -> int:
    import shlex

    import torch.distributed as dist

    from nemo_anchor.ablation.config import load_ablation_config
    from nemo_anchor.ablation.plan import AblationPlan
    from nemo_anchor.ablation.runner import launch_commands, prepare, run_ablation
    from nemo_anchor.ablation.variants import parse_variants

    args.overrides = [*args.overrides, *args.overrides_after_lengths]
    variants = parse_variants(args.variants)
    if args.nproc_per_node < 1 or args.nnodes < 1:
        raise ValueError(f"--nproc-per-node={args.nproc_per_node} and --nnodes={args.nnodes} must be >= 1")
    config = load_ablation_config(args.config, args.overrides, eval_lengths=args.eval_lengths, last_k=args.last_k)
    plan = AblationPlan(config, tuple(variants), args.output)
    if not args.print_launches:
        try:
            return run_ablation(plan)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    prepare(plan)
    commands = launch_commands(plan, args.nproc_per_node, args.nnodes)
    print("# one launch per variant (each resumes from its checkpoints if run again):")
    print("\n".join(commands) if commands else "# every variant is trained")
    print("# then evaluate and write the report:")
    print(shlex.join(_evaluate_command(args)))
    return 0


def _evaluate_command(args: argparse.Namespace) -> list[str]:
    """This command without --print-launches: it skips the trained variants and evaluates them."""
    command = ["nemo-anchor", "ablate", "--config", str(args.config), "--variants", args.variants,
               "--output", str(args.output)]
    if args.eval_lengths:
        command += ["--eval-lengths", *map(str, args.eval_lengths)]
    if args.last_k is not None:
        command += ["--last-k", str(args.last_k)]
    return command + list(args.overrides)
