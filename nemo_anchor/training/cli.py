"""``nemo-anchor train --config FILE [key=value ...]`` (also ``torchrun ... scripts/pretrain.py``)."""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train", help="pretrain / continue-pretrain a Megatron GPT with the configured attention_type",
        description="Train from a YAML config. Run it again with the same output_dir to resume. "
                    "Under torchrun every process runs this same command.")
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="YAML file with model/data/trainer/optim/checkpoint sections")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="OmegaConf dotlist overrides, e.g. model.attention_type=anchor trainer.max_steps=10")


def run(args: argparse.Namespace) -> int:
    """0 when training reached trainer.max_steps; EXIT_INTERRUPTED after a SIGTERM/SIGINT (checkpoint saved)."""
    import torch.distributed as dist

    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.loop import EXIT_INTERRUPTED, train

    summary = train(load_config(args.config, args.overrides))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps({"summary": asdict(summary)}, indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return EXIT_INTERRUPTED if summary.stopped_by_signal else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain.py", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
