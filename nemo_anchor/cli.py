"""`nemo-anchor` command line: one subcommand per capability.

Each capability module exposes ``register(subparsers)``, which adds its subcommand and sets
``func`` on the parsed namespace; this file only wires them together, so a subcommand's
imports (Megatron, NeMo, transformers) are paid only when it runs.

The exit status and error line, the same for every subcommand: :mod:`nemo_anchor.command`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from nemo_anchor.command import IntermixedParser, run_command

# module path -> the subcommands it registers (imported lazily, on demand)
SUBCOMMANDS = {
    "nemo_anchor.data.cli": ("pack",),
    "nemo_anchor.training.cli": ("train", "plan"),
    "nemo_anchor.export.cli": ("export-hf", "import-hf", "prepare-smollm2"),
    "nemo_anchor.analysis.cli": ("probe",),
    "nemo_anchor.evaluation.cli": ("eval",),
    "nemo_anchor.ablation.cli": ("ablate",),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-anchor", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=IntermixedParser)
    for module_name, commands in SUBCOMMANDS.items():
        if only is not None and only not in commands:
            for name in commands:  # listed in --help without importing the module
                subparsers.add_parser(name, help=f"(see: nemo-anchor {name} --help)")
            continue
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(only=command).parse_args(argv)
    return run_command(args.command, args.func, args)


if __name__ == "__main__":
    sys.exit(main())
