"""Preemption: SIGTERM, SIGINT and SIGUSR1 finish the step, save a checkpoint, and exit with status 75.

Slurm, Kubernetes and torchrun deliver SIGTERM to a whole process group (torchrun forwards it to
each worker's group and kills the workers 30 s later); Slurm's ``--signal=USR1@120`` sends SIGUSR1
two minutes before the time limit. The trainer stops at the step every rank has reached (the
ranks agree on the flag at step boundaries), saves, and exits with :data:`EXIT_INTERRUPTED`
(EX_TEMPFAIL: run the same command again to resume; ``trainer.preempt_exit_code`` changes it).

The public API, for any front door::

    with StopRequest() as stop:             # the handlers are installed for the block, then restored
        for step in ...:
            ...
            if agreed(stop.requested):     # e.g. an all_reduce(MAX) of the flag
                with signals_deferred():    # the save's helper processes survive a group signal
                    checkpoint = save()
                print(stop_line(stop.signal_name, checkpoint, step))  # one line: what, where, what next
                sys.exit(EXIT_INTERRUPTED)

:func:`hold_stop_signals` closes the window between a run's first change of its folder (its lease) and its stop
handler: every door blocks the signals before it takes the lease, and :func:`release_stop_signals` ends the block
once the handler is in, which then acts on what arrived (a run that fails before releases it after its clean-up).

:func:`signals_deferred` is what makes a save after the signal work: wrap every checkpoint save in
it (the scheduled ones too), because Megatron starts the processes a save needs during the first
save and keeps some of them. :func:`start_checkpoint_writer_queue`, called at setup, starts the one that
costs most before any signal can come, so that a stop's save is never the first to pay for it.

The three front doors stop on the same :data:`STOP_SIGNALS`: ``nemo-anchor train``
(``training/loop.py``), NeMo (``nemo/run_guard.py``'s ``AnchorPreemption``, saves through
``nemo/strategy.py``) and Megatron-Bridge (``bridge/preemption.py``, whose exit-signal handler is a
:class:`StopRequest`).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
from typing import Iterator

# exit status of a run stopped by a signal after saving its checkpoint (EX_TEMPFAIL: run it again to resume)
EXIT_INTERRUPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
RUN_AGAIN = "run the same command again to resume"


def stop_line(signal_name: str | None, saved, step: int, detail: str = "", then: str = RUN_AGAIN) -> str:
    """The one line every front door ends a planned stop with: the signal (None: another rank's), the checkpoint
    saved and the step it holds (``detail`` after it: the door's own, e.g. how long the save took), and what comes
    next (``then``)."""
    return f"stop requested ({signal_name or 'by another rank'}): saved {saved} at step {step}{detail}; {then}"


class StopRequest:
    """While entered: :data:`STOP_SIGNALS` set ``requested`` (and ``signal_name``) instead of ending the process.

    Installed from the main thread only (Python runs signal handlers there); elsewhere it does nothing.
    """

    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                previous = signal.signal(sig, self._handle)  # while held: the handler from before the hold
                self._previous[sig] = _held[0].handlers[sig] if previous is _record and _held else previous
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class _Held:
    """The stop signals held back: the mask and handlers before, and the signals another thread took meanwhile."""

    def __init__(self):
        self.handlers = {sig: signal.signal(sig, _record) for sig in STOP_SIGNALS}
        self.mask = _block()
        self.received: list[int] = []


_held: list[_Held] = []  # while hold_stop_signals() holds the signals


def _record(signum, frame) -> None:
    """The handler while held: a process-directed signal goes to any thread that does not block it (torch's, gloo's),
    where the default action would end the process; it is recorded and raised again at the release."""
    if _held:
        _held[0].received.append(signum)


def hold_stop_signals() -> None:
    """Hold :data:`STOP_SIGNALS` back from now until :func:`release_stop_signals` (main thread; once: a second call
    while held does nothing): blocked in this thread, and recorded when another thread takes one. A door calls it
    before it takes its folder's lease, so that a signal arriving before its stop handler is installed waits for
    the handler instead of ending the process with the folder half-made."""
    if not _held and threading.current_thread() is threading.main_thread():
        _held.append(_Held())


def release_stop_signals() -> None:
    """End :func:`hold_stop_signals`: a signal held meanwhile arrives now, at the stop handler when one was installed
    meanwhile (:class:`StopRequest`), otherwise with the handler from before (the default: the process ends).
    Does nothing when nothing is held."""
    if not _held:
        return
    held = _held.pop()
    for sig, handler in held.handlers.items():
        if signal.getsignal(sig) is _record:
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, held.mask)
    for sig in held.received:
        signal.raise_signal(sig)


def _block():
    """Block :data:`STOP_SIGNALS` in this thread; returns the mask before. Python's resource tracker, which
    ``spawn`` starts on first use, unblocks SIGINT and SIGTERM in the calling thread after starting itself
    (``multiprocessing.resource_tracker.ensure_running``): it is started first (resource_tracker.py:147-151 in
    Python 3.11), so that it leaves the block alone."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    return signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Block :data:`STOP_SIGNALS` in this thread for the block; the processes started in it inherit the block.

    Why: Megatron's ``dist_checkpointing`` writer keeps a multiprocessing Manager, spawned during
    the first save (megatron/core/dist_checkpointing/strategies/filesystem_async.py:51-56 in
    megatron-core 0.16.1) unless :func:`start_checkpoint_writer_queue` started it, and forks one
    writer per bucket on every save (:266); the asynchronous save's persistent worker is spawned too
    (async_utils.py:298, :327). A signal to the whole
    process group kills the Manager, and the save after the signal fails with ``BrokenPipeError``.
    A blocked signal stays pending in a child (the Manager ignores it for good; it ends when this
    process shuts it down or with SIGKILL), and in this process is handled when the block ends
    (another thread may take it earlier: the handler only sets a flag).

    Python's resource tracker, which ``spawn`` starts on first use, unblocks SIGINT and SIGTERM in
    the calling thread after starting itself (``multiprocessing.resource_tracker.ensure_running``):
    it is started here first (resource_tracker.py:147-151 in Python 3.11), so that it leaves this block alone.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    outer, _deferring.pid = getattr(_deferring, "pid", None), os.getpid()
    try:
        yield
    finally:
        _deferring.pid = outer
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# While a thread is in signals_deferred(): this process's pid (a child forked by that thread keeps the value)
_deferring = threading.local()
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_the_parent_that_deferred() -> None:
    """In a child forked inside :func:`signals_deferred`: SIGKILL when the thread that forked it ends.

    Such a child ignores the stop signals for good (the block is inherited), so a parent SIGKILLed by a launcher
    (torchrun's shutdown, ``ft_launcher``'s rank monitor before an in-job restart) would leave it behind, with a
    copy of the worker's memory, at every restart: the writer Manager, a save's writer processes."""
    parent = getattr(_deferring, "pid", None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    _deferring.pid = os.getpid()  # its own children, if any, end with it
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)


os.register_at_fork(after_in_child=_end_with_the_parent_that_deferred)


def start_checkpoint_writer_queue(mp_mode: str = "fork") -> None:
    """Start the results queue of Megatron's checkpoint writer now (``mp_mode``: forked unless told otherwise), with
    the stop signals held back.

    Why: ``dist_checkpointing``'s writer sends its results through a multiprocessing Manager's queue that it
    starts on the first save. megatron-core 0.16.1 starts it with "spawn" (``_get_write_results_queue``,
    dist_checkpointing/strategies/filesystem_async.py:51-56), and a spawned child first runs its parent's main
    module again: the ``nemo`` console script imports all of NeMo there (13 s of the 21 s a NeMo stop took on
    2 CPU cores), ``nemo-anchor``'s and ``python -m nemo_anchor.bridge.pretrain``'s import their own stack. A stop
    whose save is the run's first paid for that inside the scheduler's grace period. A forked Manager imports
    nothing and starts in milliseconds; its server only passes pickled results between processes (it touches
    no CUDA or process group state of the parent).

    megatron-core 0.17 and later (Megatron-Bridge's .venv) have the public ``get_write_results_queue(mp_mode)``,
    and Megatron-Bridge calls it with "fork" (its ``checkpoint.async_write_results_mp_mode`` default): the same
    here. 0.16.1 has only the private spawn one, which returns the module's ``_results_queue`` once that is set:
    setting it is the least private way to choose the start method there. A queue already started is kept.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with signals_deferred(), _gc_disabled():  # no collection (of CUDA tensors, say) half done across the fork
        if hasattr(filesystem_async, "get_write_results_queue"):
            filesystem_async.get_write_results_queue(mp_mode)
        elif filesystem_async._results_queue is None:
            filesystem_async._results_queue = multiprocessing.get_context(mp_mode).Manager().Queue()


@contextlib.contextmanager
def _gc_disabled() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
