"""``nemo-anchor train --config FILE [key=value ...]`` (also ``torchrun ... scripts/pretrain.py``) and
``nemo-anchor plan --config FILE --gpus N --gpu-memory GB|CARD``: the per-GPU memory of that run.

A user error (a bad key or value, data that does not fit, a refused resume, an output_dir in use)
is one line from rank 0, ``nemo-anchor train: error: ...``, and exit status 2 on every rank
(:func:`nemo_anchor.command.run_command`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

# a rank waited longer than trainer.distributed_timeout_minutes for the others: a fault, not bad input
EXIT_HUNG = 1


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="pretrain / continue-pretrain a Megatron GPT with the configured attention_type",
        description="Train from a YAML config. Run it again with the same output_dir to resume. "
                    "Under torchrun every process runs this same command.")
    add_arguments(parser)
    add_train_arguments(parser)
    parser.set_defaults(func=run)

    plan = subparsers.add_parser(
        "plan", help="per-GPU memory of a training config before launch; exit 1 when it does not fit",
        description="Weights, gradients, optimizer state, activations, logits and communication buffers per GPU "
                    "for the config's parallel layout, against the GPU's memory. Exit 0 when it fits, 1 (naming "
                    "the smallest change that fits) when it does not, 2 for a config or option it cannot plan.")
    add_arguments(plan)
    plan.add_argument("--gpus", type=_positive_int, required=True, help="processes (GPUs) the run is launched on")
    plan.add_argument("--gpu-memory", type=_gpu_memory, required=True, metavar="GB|CARD",
                      help="the GPU: its nominal memory in GB (80: an H100 or A100 80GB, 79.11 GiB usable) or a "
                           "card name (h100-80gb, a100-80gb, h200, b200); 5%% of it is left to the allocator")
    plan.add_argument("--fusions", action="store_true",
                      help="plan Megatron's fused cross entropy and bias-SwiGLU (a GPU with Transformer Engine)")
    plan.add_argument("--json", action="store_true", help="print the numbers as JSON")
    plan.set_defaults(func=run_plan)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number of GPUs")
    return value


def _gpu_memory(text: str) -> tuple[int, str]:
    from nemo_anchor.training.memory import gpu_memory

    try:
        return gpu_memory(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML file with model/data/trainer/optim/checkpoint sections")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="OmegaConf dotlist overrides, e.g. model.attention_type=anchor trainer.max_steps=10")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-change", metavar="KEY[,KEY...]", default=None,
                        help="config keys a resume may change on purpose (LR schedule, trainer.global_batch_size, "
                             "optim.clip_grad), e.g. optim.lr,trainer.global_batch_size; any other change of the run "
                             "is refused (sets checkpoint.allow_change)")


def run(args: argparse.Namespace) -> int:
    """0 when training reached trainer.max_steps; trainer.preempt_exit_code (75) after SIGTERM, SIGINT or SIGUSR1
    (checkpoint saved); :data:`EXIT_HUNG` (one line) when a collective waited longer than
    trainer.distributed_timeout_minutes for another rank."""
    import torch.distributed as dist

    from nemo_anchor.parallel.distributed import collective_timed_out
    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.loop import train

    overrides = list(args.overrides)
    if args.allow_change:
        keys = [key.strip() for key in args.allow_change.split(",") if key.strip()]
        overrides.append(f"checkpoint.allow_change=[{','.join(keys)}]")
    config = load_config(args.config, overrides)
    try:
        summary = train(config)
    except RuntimeError as error:
        if not collective_timed_out(error):
            raise
        # a rank hung: this one says so and ends, so that the launcher ends the run and the scheduler can restart it
        minutes = config.trainer.distributed_timeout_minutes
        reason = " ".join(str(error).split())[:300]
        print(f"nemo-anchor train: error: rank {os.environ.get('RANK', '0')} waited longer than "
              f"trainer.distributed_timeout_minutes={minutes:g} ({minutes * 60:g} s) for the other ranks ({reason}): "
              f"a rank is hung or gone; this run ends here and resumes from its newest checkpoint when started "
              f"again", file=sys.stderr, flush=True)
        return EXIT_HUNG
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({"summary": asdict(summary)}, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return config.trainer.preempt_exit_code if summary.stopped_by_signal else 0


def _vocab_size(config) -> int:
    """The vocabulary rows of the planned layout: model.vocab_size (default the tokenizer's), padded
    for its tensor parallelism."""
    from nemo_anchor.model.vocab import padded_vocab_size

    vocab = config.model.vocab_size
    if not vocab:
        from nemo_anchor.data import PackedDataset

        try:
            vocab = PackedDataset(config.data.path).tokenizer.vocab_size
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"set model.vocab_size, or data.path to a packed dataset to read it from ({err})") \
                from None
    return padded_vocab_size(vocab, config.model.tensor_model_parallel_size)


def run_plan(args: argparse.Namespace) -> int:
    """0 when the plan fits, 1 when it does not (a config or layout that cannot run raises ValueError)."""
    plan, fix, host = _plan(args)
    if args.json:
        print(json.dumps({**plan.as_dict(), "config": str(args.config), "suggestion": fix,
                          "checkpoint_host_bytes": asdict(host)}, indent=2))
    else:
        from nemo_anchor.training.memory import GIB

        print(format_plan(plan, str(args.config)))
        print(f"  host memory per process on top of training: checkpoint save {host.save / GIB:.2f} GiB, "
              f"load {host.load / GIB:.2f} GiB, model.init_from_hf {host.init_from_hf / GIB:.2f} GiB")
        if not plan.fits:
            print(f"does not fit: {plan.total / GIB:.1f} GiB + {plan.headroom / GIB:.1f} GiB headroom > "
                  f"{plan.gpu_bytes / GIB:.2f} GiB; "
                  + (f"smallest change that fits: {fix}" if fix else "no layout of tensor x context parallelism "
                     "with full recompute up to 64x the GPUs fits"))
    return 0 if plan.fits else 1


def _plan(args: argparse.Namespace) -> tuple:
    """(the plan, the smallest change that fits or None, the checkpoint and init_from_hf host peaks)."""
    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.memory import Layout, checkpoint_peak, plan_memory, suggest

    config = load_config(args.config, args.overrides)
    m, t = config.model, config.trainer
    layout = Layout(args.gpus, m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size)
    if args.gpus % (layout.tensor * layout.pipeline * layout.context):
        raise ValueError(f"--gpus {args.gpus} is not a multiple of tensor x pipeline x context parallel size = "
                         f"{layout.tensor} x {layout.pipeline} x {layout.context}")
    options = dict(gpu_bytes=args.gpu_memory[0], micro_batch_size=t.micro_batch_size,
                   bf16=t.precision == "bf16", distributed_optimizer=t.distributed_optimizer, fusions=args.fusions)
    vocab = _vocab_size(config)
    plan = plan_memory(m, vocab, layout, **options)
    fix = None if plan.fits else suggest(m, vocab, layout, **options)
    host = checkpoint_peak(m, vocab, layout, bf16=options["bf16"], distributed_optimizer=t.distributed_optimizer)
    return plan, fix, host


def format_plan(plan, name: str) -> str:
    from nemo_anchor.training.memory import GIB

    lay = plan.layout
    rows = [("weights", plan.weights), ("gradients (fp32)", plan.gradients), ("optimizer (fp32)", plan.optimizer),
            ("activations", plan.activations), ("  of which extra K/V", plan.kv_extra),
            ("recompute workspace", plan.recompute_workspace),
            ("logits and loss", plan.logits), ("communication buffers", plan.communication),
            ("CUDA context and reserve", plan.reserved), ("total", plan.total)]
    head = (f"{name}: {lay.gpus} GPUs = tensor {lay.tensor} x pipeline {lay.pipeline} x context {lay.context} "
            f"x data {lay.data}; per GPU:")
    lines = [head] + [f"  {label:<26}{value / GIB:>9.2f} GiB" for label, value in rows]
    lines.append(f"  {'allocator headroom (5%)':<26}{plan.headroom / GIB:>9.2f} GiB")
    lines.append(f"  {'GPU memory (usable)':<26}{plan.gpu_bytes / GIB:>9.2f} GiB -> {'fits' if plan.fits else 'DOES NOT FIT'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from nemo_anchor.command import IntermixedParser, run_command

    parser = IntermixedParser(prog="pretrain.py", description=__doc__)
    add_arguments(parser)
    add_train_arguments(parser)

    return run_command("train", run, parser.parse_args(argv))
