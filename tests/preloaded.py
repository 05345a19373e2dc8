"""Runs of one command line, each a new process forked from a server that imported the command once.

    with Preloaded("nemo_anchor.bridge.pretrain:main", env, preload=["nemo_anchor.bridge.pretrain"]) as bridge:
        done = bridge.run(["--config", "run.yaml", ...])          # a subprocess.CompletedProcess
        done = bridge.run([...], processes=2)                     # its ranks forked (tests/forked_ranks.py)
        run = bridge.start([...])                                 # pid, poll(), wait(), communicate() of a Popen

``bridge.run(ARGS)`` is ``python -m nemo_anchor.bridge.pretrain ARGS`` (``processes=N``: ``torchrun --standalone
--nproc-per-node N -m ...``) without importing Megatron-Bridge again: 13 CPU s a process here, 20 for NeMo. The
server (``python tests/preloaded.py FD MODULE:FUNCTION PRELOAD...``) imports the PRELOAD modules and nothing else,
then forks one child per run; the child starts a session of its own (as ``start_new_session=True``: a signal to
its process group reaches it and its ranks), takes its output files and ``sys.argv``, imports MODULE (NeMo-Run's
CLI reads ``sys.argv`` while it is imported) and calls FUNCTION() as a console script does, and exits as the
interpreter does (atexit handlers, a traceback and status 1 on an exception). Every run has the environment the
server started with, so nothing read at import time differs from a fresh process. One run at a time. The tests of
a launcher's own behaviour (torchrun's signals, two nodes, a process that sees CUDA) keep launching processes.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


class Preloaded:
    """A server for the console-script entry ``module:function``, started with ``env`` in ``cwd`` after importing
    ``preload``."""

    def __init__(self, entry: str, env: dict, cwd: Path | None = None, preload: list[str] = ()):
        self.entry = entry
        self.replies, reply_fd = os.pipe()  # not the server's stdout, which imports may print to
        self.server = subprocess.Popen([sys.executable, __file__, str(reply_fd), entry, *preload], env=env, cwd=cwd,
                                       text=True, stdin=subprocess.PIPE, pass_fds=(reply_fd,))
        os.close(reply_fd)
        self.running: Started | None = None

    def start(self, args: list[str], processes: int = 1, merge_output: bool = False) -> Started:
        """The command with ``args``, started; ``merge_output``: stderr into stdout (``stderr=subprocess.STDOUT``)."""
        if self.running is not None and self.running.poll() is None:
            raise RuntimeError(f"a run of {self.entry} is still going: one at a time")
        outputs = tempfile.mkdtemp(prefix="preloaded-")
        stdout = os.path.join(outputs, "stdout")
        stderr = stdout if merge_output else os.path.join(outputs, "stderr")
        self.server.stdin.write(json.dumps({"args": args, "processes": processes, "stdout": stdout,
                                            "stderr": stderr}) + "\n")
        self.server.stdin.flush()
        self.running = Started(self, [self.entry, *args], self._reply()["pid"], outputs, merge_output)
        return self.running

    def run(self, args: list[str], processes: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
        """The command with ``args``, to its end: its exit status and output (TimeoutExpired after ``timeout`` s,
        the run killed)."""
        started = self.start(args, processes)
        out, err = started.communicate(timeout=timeout)
        return subprocess.CompletedProcess(started.args, started.returncode, out, err)

    def _reply(self, timeout: float | None = None) -> dict | None:
        """The server's next line, or None when none came within ``timeout`` s. Read a byte at a time, so that
        nothing waits in a buffer that select() does not see."""
        if not select.select([self.replies], [], [], timeout)[0]:
            return None
        line = b""
        while not line.endswith(b"\n"):
            byte = os.read(self.replies, 1)
            if not byte:
                raise RuntimeError(f"the preloaded server of {self.entry} exited with status {self.server.wait()}")
            line += byte
        return json.loads(line)

    def close(self) -> None:
        # asked in words, not by the end of its input: a process forked from this one since the server started (the
        # checkpoint writer's Manager of a run trained in the test process) holds the pipe's write end as well
        self.server.stdin.write(json.dumps({"exit": True}) + "\n")
        self.server.stdin.close()
        self.server.wait(timeout=120)
        os.close(self.replies)

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Started:
    """A run in progress, as the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, server: Preloaded, args: list[str], pid: int, outputs: str, merged: bool):
        self.server, self.args, self.pid, self.outputs, self.merged = server, args, pid, outputs, merged
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        if self._ended(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """(stdout, stderr; None when merged) once the run ended; after ``timeout`` s it is killed and
        TimeoutExpired raised, with what it wrote."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise subprocess.TimeoutExpired(self.args, timeout, *self._outputs()) from None
        return self._outputs()

    def kill(self) -> None:
        os.killpg(self.pid, signal.SIGKILL)  # the run leads its session: it and its ranks

    def _ended(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            reply = self.server._reply(timeout)
            if reply is not None:
                self.returncode = reply["returncode"]
        return self.returncode

    def _outputs(self) -> tuple[str, str | None]:
        read = [Path(self.outputs, name).read_text(errors="replace") for name in ("stdout", "stderr")
                if not (self.merged and name == "stderr")]
        shutil.rmtree(self.outputs, ignore_errors=True)
        return read[0], (None if self.merged else read[1])


def serve(replies) -> dict:
    """Forks a child for each request read from stdin and answers its pid and exit status on ``replies``;
    returns only in a child, with its request. A SIGTERM to the server (scripts/test.sh stopping a lane) ends
    the run in progress too, which has a session of its own."""
    running = []

    def stop(signum, frame) -> None:
        for pid in running:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet the leader of its session
                os.kill(pid, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("exit"):
            break
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            replies.close()
            return request
        running.append(pid)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        running.remove(pid)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
    sys.exit(0)


def become(request: dict, program: str) -> None:
    """This child as the command's new process: its own session, its output files, its ``sys.argv``."""
    os.setsid()
    files = {0: (os.devnull, os.O_RDONLY), 1: (request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
             2: (request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)}
    for fd, (path, flags) in files.items():
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
