"""How every command line of nemo-anchor parses its arguments and ends: one convention, one place.

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
import os
import sys


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
