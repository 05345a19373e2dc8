"""`nemo-anchor` command line: one subcommand per capability.

Each capability module exposes ``register(subparsers)``, which adds its subcommand and sets
``func`` on the parsed namespace; this file only wires them together, so a subcommand's
imports (Megatron, NeMo, transformers) are paid only when it runs.

Exit status, the same for every subcommand: 0 done; 2 for bad input, as argparse exits on a bad
command line: a bad option, or a file, key or value the command refuses (missing, corrupt,
inconsistent, an output it must not replace), printed as one line ``nemo-anchor COMMAND: error: ...``
(by rank 0 under torchrun); 1 for an answer of "no" the command was asked for (``plan``: the run
does not fit) and for a fault of nemo-anchor or a library (Python's traceback); 75 (EX_TEMPFAIL)
for a run stopped by a signal after saving its checkpoint: run it again to resume; 128 + the
signal (130, 143) for a command interrupted while writing its output, which it removes.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# module path -> the subcommands it registers (imported lazily, on demand)
SUBCOMMANDS = {
    "nemo_anchor.data.cli": ("pack",),
    "nemo_anchor.training.cli": ("train", "plan"),
    "nemo_anchor.export.cli": ("export-hf", "import-hf", "prepare-smollm2"),
    "nemo_anchor.analysis.cli": ("probe",),
    "nemo_anchor.evaluation.cli": ("eval",),
    "nemo_anchor.ablation.cli": ("ablate",),
}


class IntermixedParser(argparse.ArgumentParser):
    """A subcommand's parser taking its positionals (``key=value`` overrides, paths) before, between and
    after options: ``train --config C a=1 --allow-change optim.lr optim.lr=0.5`` keeps both overrides,
    where plain parsing stops filling a ``nargs="*"`` positional at the first option
    (``parse_known_intermixed_args``, which calls ``parse_known_args`` in its two passes)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


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


EXIT_USER_ERROR = 2  # argparse's status for a bad command line
# what bad input raises: our checks raise ValueError (or a subclass) naming the file, key and value
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, PermissionError)


def run_command(command: str, func, args: argparse.Namespace) -> int:
    """``func(args)``'s exit status; bad input (:data:`USER_ERRORS`) is one line on stderr and
    :data:`EXIT_USER_ERROR` on every rank (rank 0 says it; a process group is closed)."""
    try:
        return int(func(args) or 0)
    except USER_ERRORS as error:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank meets the same error; one says it
            message = " ".join(str(error).split())  # one line, whatever the library's message looked like
            print(f"nemo-anchor {command}: error: {message}", file=sys.stderr, flush=True)
        dist = sys.modules.get("torch.distributed")  # imported only by the commands that use it
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return EXIT_USER_ERROR


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(only=command).parse_args(argv)
    return run_command(args.command, args.func, args)


if __name__ == "__main__":
    sys.exit(main())
