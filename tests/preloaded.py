"""Runs of one command line, each a new process forked from a server that imported the command once.

    with Preloaded("nemo_anchor.bridge.pretrain:main", env, preload=["nemo_anchor.bridge.pretrain"]) as bridge:
        done = bridge.run(["--config", "run.yaml", ...])          # a subprocess.CompletedProcess
        done = bridge.run([...], processes=2)                     # its ranks forked (tests/forked_ranks.py)

``bridge.run(ARGS)`` is ``python -m nemo_anchor.bridge.pretrain ARGS`` (``processes=N``: ``torchrun --standalone
--nproc-per-node N -m ...``) without importing Megatron-Bridge again: 13 CPU s a process here, 20 for NeMo. The
server (``python tests/preloaded.py FD MODULE:FUNCTION PRELOAD...``) imports the PRELOAD modules and nothing else,
then forks one child per run; the child starts a session of its own, takes its output files and ``sys.argv``,
imports MODULE (NeMo-Run's CLI reads ``sys.argv`` while it is imported) and calls FUNCTION() as a console script
does, and exits as the interpreter does (atexit handlers, a traceback and status 1 on an exception). Every run has
the environment the server started with, so nothing read at import time differs from a fresh process.
Tests of signals to a launcher or of a process's own start keep launching real processes.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


class Preloaded:
    """A server for the console-script entry ``module:function``, started with ``env`` in ``cwd`` after importing
    ``preload``; one run at a time."""

    def __init__(self, entry: str, env: dict, cwd: Path | None = None, preload: list[str] = ()):
        self.entry = entry
        replies, reply_fd = os.pipe()  # not the server's stdout, which imports may print to
        self.server = subprocess.Popen([sys.executable, __file__, str(reply_fd), entry, *preload], env=env, cwd=cwd,
                                       text=True, stdin=subprocess.PIPE, pass_fds=(reply_fd,))
        os.close(reply_fd)
        self.replies = os.fdopen(replies)

    def run(self, args: list[str], processes: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
        """The command with ``args``, to its end: its exit status and output (TimeoutExpired after ``timeout`` s,
        the run killed)."""
        with tempfile.TemporaryDirectory() as outputs:
            paths = {name: os.path.join(outputs, name) for name in ("stdout", "stderr")}
            self.server.stdin.write(json.dumps({"args": args, "processes": processes, **paths}) + "\n")
            self.server.stdin.flush()
            pid = self._reply()["pid"]
            timed_out = threading.Event()

            def kill() -> None:
                timed_out.set()
                os.killpg(pid, signal.SIGKILL)  # the child leads its session: the run and its ranks

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                returncode = self._reply()["returncode"]
            finally:
                timer.cancel()
            out, err = (Path(paths[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
        if timed_out.is_set():
            raise subprocess.TimeoutExpired([self.entry, *args], timeout, out, err)
        return subprocess.CompletedProcess([self.entry, *args], returncode, out, err)

    def _reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise RuntimeError(f"the preloaded server of {self.entry} exited with status {self.server.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)
        self.replies.close()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(replies) -> dict:
    """Forks a child for each request read from stdin and answers its pid and exit status on ``replies``;
    returns only in a child, with its request."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            return request
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
    sys.exit(0)


def become(request: dict, program: str) -> None:
    """This child as the command's new process: its own session, its output files, its ``sys.argv``."""
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [program, *request["args"]]


if __name__ == "__main__":
    reply_fd, entry, *preload = sys.argv[1:]
    for name in preload:
        importlib.import_module(name)
    request = serve(os.fdopen(int(reply_fd), "w"))
    module, function = entry.split(":")
    become(request, module)
    entry = getattr(importlib.import_module(module), function)
    if request["processes"] > 1:
        from forked_ranks import run_ranks  # tests/forked_ranks.py, beside this file

        def command() -> None:  # the elastic agent names its entrypoint by __name__, which a Typer app lacks
            entry()

        run_ranks(request["processes"], command)
    else:
        sys.exit(entry())
