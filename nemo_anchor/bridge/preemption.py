"""Megatron-Bridge's ``pretrain()`` stopping and resuming as the other front doors do, on any device.

- Every stop signal (:data:`~nemo_anchor.training.preemption.STOP_SIGNALS`: SIGTERM, SIGINT, SIGUSR1)
  asks Bridge's exit-signal save, not only ``train.exit_signal``: :class:`StopSignalHandler` takes the
  place of Bridge's ``DistributedSignalHandler`` (``training/state.py:468`` in Megatron-Bridge 0.6.2)
  and records the signals with :class:`~nemo_anchor.training.preemption.StopRequest`.
- The processes Bridge starts before training (the asynchronous checkpoint worker,
  ``training/setup.py:239``; the checkpoint writer's result queue; data loader workers) and during each
  save (the writer's processes) start with the stop signals blocked, so that a signal to the whole
  process group (Slurm, Kubernetes, torchrun) leaves them alive for the exit-signal save:
  :func:`stopping_as_every_door` holds the signals (held already from before the lock was taken,
  :func:`nemo_anchor.bridge.run_guard.claimed`) until training starts (:class:`StopsAsEveryDoor`),
  and :class:`AnchorCheckpointManager` (Bridge's ``checkpoint.custom_manager_class``) saves with them deferred.
- A resume of the distributed optimizer over torch's Adam (no Apex or TE Adam) is exact:
  :class:`AnchorCheckpointManager` loads through :mod:`nemo_anchor.training.optimizer_state`, as the other doors.
- The log says what happened, as in the other doors: Bridge's "exiting program after receiving SIGTERM." names the
  signal that came (``training/train.py:1414`` names SIGTERM whatever it was); Bridge ends the stopped run with
  ``sys.exit(0)``, which its ``pretrain()`` logs as "Pretrain failed ... SystemExit: 0" with a traceback
  (``training/pretrain.py:202``, for any exception): not logged for an exit with status 0; and the run ends with
  :func:`~nemo_anchor.training.preemption.stop_line`'s line (signal, checkpoint, run again) and status 75.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch
from megatron.bridge.training import pretrain as bridge_pretrain
from megatron.bridge.training import state as bridge_state
from megatron.bridge.training import train as bridge_train
from megatron.bridge.training.callbacks import Callback, CallbackContext
from megatron.bridge.training.checkpointing import DefaultCheckpointManager, cleanup_old_non_persistent_checkpoint
from megatron.bridge.training.utils.checkpoint_utils import get_checkpoint_name
from megatron.bridge.training.utils.sig_utils import DistributedSignalHandler, all_gather_item

from nemo_anchor.bridge.run_guard import guard_of
from nemo_anchor.launch import global_rank
from nemo_anchor.training import optimizer_state
from nemo_anchor.training.preemption import (EXIT_INTERRUPTED, StopRequest, hold_stop_signals, release_stop_signals,
                                             signals_deferred, stop_line)

# what Bridge says when its exit-signal handler stops the run (training/train.py:1414), whatever the signal, through
# its barrier_and_log (a barrier, then rank 0 prints)
_BRIDGE_STOP_MESSAGE = "exiting program after receiving SIGTERM."
_bridge_barrier_and_log = bridge_train.barrier_and_log


class StopSignalHandler(DistributedSignalHandler):
    """Bridge's ``DistributedSignalHandler`` on every stop signal: ``signals_received()`` gathers, from every
    rank, whether one of :data:`~nemo_anchor.training.preemption.STOP_SIGNALS` arrived."""

    def __enter__(self) -> "StopSignalHandler":
        self.released = False
        self.stopping = False  # whether a rank received one, as the ranks last agreed
        self._stop = StopRequest().__enter__()
        return self

    def signals_received(self) -> list[bool]:
        received = all_gather_item(self._stop.requested, dtype=torch.int32)
        self.stopping = self.stopping or any(received)
        return received

    @property
    def signal_name(self) -> str | None:
        """The stop signal this process received (SIGUSR1, ...); None when the stop is another rank's."""
        return self._stop.signal_name

    def release(self) -> bool:
        if self.released:
            return False
        self._stop.__exit__(None, None, None)
        self.released = True
        return True


class AnchorCheckpointManager(DefaultCheckpointManager):
    """Bridge's checkpoint manager, saving with the stop signals deferred and loading torch's Adam exactly, fenced
    by the run's guard (:func:`nemo_anchor.bridge.run_guard.guard_of`) as ``nemo-anchor train``'s saves are.

    Bridge's ``save_checkpoint`` writes ``iter_N``, the tracker ``latest_checkpointed_iteration.txt`` and evicts
    beyond ``most_recent_k`` in one call (``training/checkpointing.py:1059``): the lease holder reads the lease
    before it starts (all ranks skip a refused save together), and the eviction of a synchronous persistent save
    runs after it, fenced again, through Bridge's own ``cleanup_old_non_persistent_checkpoint``. A refused save
    changes nothing; when the lease was lost the run stops (RunDirInUse), at the final save too.
    """

    def save(self, ctx, callback_manager) -> None:
        guard = guard_of(self.checkpoint_config.save)
        if guard is None:
            with signals_deferred():  # the writer's processes, started here, survive a group signal
                super().save(ctx, callback_manager)
            return
        step = ctx.state.train_state.step
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        if not guard.fence_everywhere(f"save iter_{step:07d}", device):
            guard.stop_if_lost(device, step)
            return  # the lease could not be read: this save is skipped, the next one asks again
        config, keep = self.checkpoint_config, self.checkpoint_config.most_recent_k
        evict_after = keep > -1 and not config.async_save and not ctx.non_persistent_ckpt
        if evict_after:
            config.most_recent_k = -1  # Bridge's eviction, inside its save, would not read the lease
        try:
            with signals_deferred():
                super().save(ctx, callback_manager)
        finally:
            config.most_recent_k = keep
        if evict_after and guard.fence(f"remove checkpoints older than the newest {keep}"):
            cleanup_old_non_persistent_checkpoint(config.save, leave_ckpt_num=keep, do_async=False)  # rank 0 only

    def load(self, ctx) -> tuple[int, int]:
        if ctx.optimizer is None or not optimizer_state.torch_adam():
            return super().load(ctx)
        with _state_created_for_a_load(ctx.optimizer):
            loaded = super().load(ctx)
        optimizer_state.give_each_parameter_its_adam_step(ctx.optimizer)
        return loaded


@contextlib.contextmanager
def _state_created_for_a_load(optimizer) -> Iterator[None]:
    """While Bridge loads: torch Adam's state created when Bridge asks for the optimizer's state to load into
    (``checkpointing.py:2038``, only when the checkpoint's optimizer state is loaded)."""
    sharded_state_dict = optimizer.sharded_state_dict

    def creating_the_state_first(*args, is_loading: bool = False, **kwargs):
        if is_loading:
            optimizer_state.create_state_for_load(optimizer)
        return sharded_state_dict(*args, is_loading=is_loading, **kwargs)

    optimizer.sharded_state_dict = creating_the_state_first  # this instance, for this load
    try:
        yield
    finally:
        del optimizer.sharded_state_dict


MANAGER = f"{AnchorCheckpointManager.__module__}.{AnchorCheckpointManager.__qualname__}"


class StopsAsEveryDoor(Callback):
    """Ends the block of the stop signals (:func:`~nemo_anchor.training.preemption.hold_stop_signals`) when training
    starts, Bridge's handler installed (a signal held meanwhile then arrives: the run stops at its first step
    boundary, after a save), and keeps that handler, which says what stopped the run."""

    handler: StopSignalHandler | None = None

    def on_train_start(self, context: CallbackContext) -> None:
        self.handler = context.state.signal_handler if context.state.cfg.train.exit_signal_handler else None
        self.state = context.state
        release_stop_signals()

    def stopped(self) -> bool:
        return isinstance(self.handler, StopSignalHandler) and self.handler.stopping

    def signal_name(self) -> str | None:
        return self.handler.signal_name if self.handler is not None else None

    def naming_the_signal(self, message: str) -> None:
        """Bridge's ``barrier_and_log``, with Bridge's stop message naming the signal that came."""
        if message == _BRIDGE_STOP_MESSAGE and self.stopped():
            message = f"exiting program after receiving {self.signal_name() or 'a stop signal on another rank'}."
        _bridge_barrier_and_log(message)


class _ExitWithStatusZeroIsNoFailure(logging.Filter):
    """Bridge's ``pretrain()`` logs every exception that ends training as "Pretrain failed ... with SystemExit: 0"
    and its traceback, its own ``sys.exit(0)`` after a planned stop included: that record is dropped (a failure's,
    any other exception or status, is kept)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, SystemExit) and error.code in (0, None))


@contextlib.contextmanager
def stopping_as_every_door(config) -> Iterator[Callback]:
    """``with stopping_as_every_door(config) as callback: pretrain(config, step, callbacks=[..., callback])``.

    Sets Bridge's exit-signal handling on with :class:`StopSignalHandler` and, unless the config names its
    own, :class:`AnchorCheckpointManager`; blocks the stop signals until training starts. A run stopped by a signal
    ends with one line (the signal, the checkpoint saved, run again; printed by the global rank 0) and status 75.
    """
    config.train.exit_signal_handler = True
    if config.checkpoint.custom_manager_class is None:
        config.checkpoint.custom_manager_class = MANAGER
    stops = StopsAsEveryDoor()
    bridge_handler = bridge_state.DistributedSignalHandler
    bridge_state.DistributedSignalHandler = StopSignalHandler
    bridge_train.barrier_and_log = stops.naming_the_signal
    exit_is_no_failure = _ExitWithStatusZeroIsNoFailure()
    bridge_pretrain.logger.addFilter(exit_is_no_failure)
    hold_stop_signals()
    try:
        yield stops
    except SystemExit as exit:  # Bridge ends a run stopped by its exit signal with sys.exit(0), after the save
        if exit.code not in (0, None) or not stops.stopped():
            raise
        if global_rank() == 0:
            step = stops.state.train_state.step
            saved = Path(get_checkpoint_name(config.checkpoint.save, step))
            print(stop_line(stops.signal_name(), saved, step) if saved.is_dir() else  # a save refused
                  f"stop requested ({stops.signal_name() or 'by another rank'}) at step {step}: not saved (see "
                  f"above); run the same command again to resume from {config.checkpoint.save}", flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        release_stop_signals()
        bridge_pretrain.logger.removeFilter(exit_is_no_failure)
        bridge_train.barrier_and_log = _bridge_barrier_and_log
        bridge_state.DistributedSignalHandler = bridge_handler
