"""Training checkpoints with Megatron ``dist_checkpointing``: every rank writes and reads its own shards.

One checkpoint directory (layout: :mod:`nemo_anchor.run_dir`) holds

- ``model.*``: the model's own ``sharded_state_dict()`` (its parameters in their dtype, sharded
  as the model is, one replica written);
- ``optimizer.*``: the optimizer state in model space (:mod:`nemo_anchor.training.optimizer_state`):
  Adam's moments and, for bf16 parameters, their fp32 masters (``optimizer.state.fp32_param.*``),
  each rank writing the slice it owns. Any tensor x pipeline x context x data layout can resume
  it, and exports and new runs (``model.init_from_hf``) read full-precision weights from it;
- ``train``: step, scheduler and sampler state (small, replicated); ``rng``: each rank's RNG state.

A checkpoint is written into ``checkpoints/.tmp.iter_*`` and renamed when every rank has finished,
so a ``kill -9`` at any moment leaves the previous complete checkpoint; a full disk is named and
the partial checkpoint removed (:func:`nemo_anchor.atomic.write_faults_named`). Its ``CHECKSUMS``
manifest records every file's size and CRC-32.

Saving stays off the training loop's critical path (:class:`CheckpointSaver`): on GPUs the shards are
written by Megatron's asynchronous ``dist_checkpointing`` save, scheduled on its ``AsyncCallsQueue``
as NeMo's ``ckpt_async_save`` and Megatron-LM's training loop do; the CRC-32s are computed by a
thread once the files are written. The checkpoint is renamed into place and named in ``latest`` only
when both are done, checked between steps, before the next save and before the run ends.

Every read of a checkpoint verifies it first (:func:`verified_checkpoint`, :func:`pick_resumable`):
a missing, truncated or corrupt file is named; given a run folder, the newest intact checkpoint is
used and the damaged ones named; a checkpoint without ``CHECKSUMS`` is said to be not verified. Only
an explicit ``--no-verify`` / ``checkpoint.verify=false`` skips this (:func:`verification`).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from nemo_anchor.atomic import atomic_file, write_faults_named
from nemo_anchor.checksums import (CHECKSUMS, CheckpointError, broadcast_from_first, file_checksums, gather_from_all,
                                   newest_intact, say_once, verifying)
from nemo_anchor.convert.megatron_state import MASTER_PREFIX
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import optimizer_state

MODEL_PREFIX = "model."
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def layout() -> dict:
    """The parallel layout a checkpoint is saved with (recorded, and compared on resume)."""
    return {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
            "context": parallel_state.get_context_parallel_world_size(),
            "data": parallel_state.get_data_parallel_world_size(),
            "world": _world()}


def _rng_object(state) -> ShardedObject:
    return ShardedObject("rng_state", state, (_world(),), (_rank(),), replica_id=0)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run: RunDir, step: int, engine, train_state: dict, run_config_yaml: str,
                    keep_last: int, save_every: int = 0) -> Path:
    """Save this rank's shards of the model, optimizer, ``train_state`` and RNG, and wait until the checkpoint
    is published (checksummed, renamed, named latest); returns its directory. Collective.

    The training loop saves through a :class:`CheckpointSaver` instead, which returns at once."""
    saver = CheckpointSaver(run, keep_last, save_every, asynchronous=False)
    final = saver.save(step, engine, train_state, run_config_yaml)
    saver.finish()
    return final


def async_save_available(device: torch.device) -> bool:
    """Whether Megatron's asynchronous save can run for a trainer on ``device``: it synchronizes the CUDA device
    and all-reduces on it (async_utils.py: TemporalAsyncCaller.schedule_async_call, maybe_finalize_async_calls)."""
    return device.type == "cuda"


@dataclass
class SaveTimes:
    """Seconds of one save: ``blocked`` the training loop waited for it (in :meth:`CheckpointSaver.save`, and in
    the :meth:`~CheckpointSaver.poll` / :meth:`~CheckpointSaver.finish` calls until it was published);
    ``written`` from its start until every rank's files were on disk; ``published`` until it was checksummed,
    renamed and named latest."""

    step: int
    blocked: float
    written: float | None = None
    published: float | None = None


class _Checksums(threading.Thread):
    """This rank's share of a written checkpoint's CRC-32s, computed off the training loop (file reads and
    zlib release the GIL)."""

    def __init__(self, ckpt_dir: Path, names: list[str]):
        super().__init__(name=f"checksums {ckpt_dir.name}", daemon=True)
        self.ckpt_dir, self.names = ckpt_dir, names
        self.sums: dict[str, list[int]] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.sums = file_checksums(self.ckpt_dir, self.names)
        except BaseException as err:  # noqa: BLE001 - re-raised by CheckpointSaver.finish on the loop's thread
            self.error = err


@dataclass
class _Pending:
    step: int
    final: Path
    tmp: Path
    started: float
    times: SaveTimes
    checksums: _Checksums | None = None  # set once every rank's files are written


class CheckpointSaver:
    """Saves a run's checkpoints without holding the training loop for the write or the checksums.

    :meth:`save` hands the shards to Megatron's ``dist_checkpointing`` (``asynchronous``: its async save,
    scheduled on an ``AsyncCallsQueue`` that a forked writer process drains, as NeMo's ``ckpt_async_save``
    does; otherwise written before it returns) and returns the directory the checkpoint will have. The
    CRC-32s are then computed by a thread, the ranks sharing the files. :meth:`poll` (between steps,
    never waiting) and :meth:`finish` (before the next save, before the run ends) publish a finished
    checkpoint: ``CHECKSUMS`` written, the directory renamed into place, ``latest`` updated, old ones
    evicted. Until then a resume sees the previous checkpoint. Every method is collective.
    """

    def __init__(self, run: RunDir, keep_last: int, save_every: int = 0, *, asynchronous: bool = False):
        self.run, self.keep_last, self.save_every = run, keep_last, save_every
        self.times: list[SaveTimes] = []
        self._queue = None
        if asynchronous:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()
        self._pending: _Pending | None = None

    @property
    def asynchronous(self) -> bool:
        return self._queue is not None

    def save(self, step: int, engine, train_state: dict, run_config_yaml: str) -> Path:
        """Start saving this rank's shards of the model, optimizer, ``train_state`` and RNG; returns the
        directory the checkpoint will be published as.

        Every tensor handed to ``dist_checkpointing`` is a view of the training state: nothing is gathered,
        and the only copy is the writer's host staging of what this rank writes
        (:func:`nemo_anchor.training.memory.checkpoint_peak`)."""
        self.finish()  # one save in flight: the previous one is published first
        started = time.perf_counter()
        final = self.run.checkpoint(step)
        tmp = self.run.checkpoints / f".tmp.{final.name}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
        state = {
            "model": model_state,
            "optimizer": optimizer_state.sharded_state(engine.optimizer, model_state, is_loading=False),
            "train": {**train_state, "layout": layout(), "scheduler": engine.scheduler.state_dict(),
                      "distributed_optimizer": optimizer_state.is_distributed(engine.optimizer)},
            "rng": _rng_object(_rng_state()),
        }
        pending = self._pending = _Pending(step, final, tmp, started, SaveTimes(step, 0.0))
        self.times.append(pending.times)
        with self._faults_named(pending):
            if self._queue is None:
                dist_checkpointing.save(state, str(tmp))
                self._written(pending, run_config_yaml)
            else:
                request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True)
                request.add_finalize_fn(lambda: self._written(pending, run_config_yaml))
                self._queue.schedule_async_request(request)
        pending.times.blocked += time.perf_counter() - pending.started
        return final

    def poll(self) -> None:
        """Publish the checkpoint in flight if it is written and checksummed on every rank; never waits."""
        pending, started = self._pending, time.perf_counter()
        if pending is None:
            return
        with self._faults_named(pending):
            if self._queue is not None:
                self._queue.maybe_finalize_async_calls(blocking=False)
            done = pending.checksums is not None and not pending.checksums.is_alive()
        if _all_ranks(done):
            self._publish()
        pending.times.blocked += time.perf_counter() - started

    def finish(self) -> Path | None:
        """Wait for the checkpoint in flight and publish it; returns its directory (None: none in flight)."""
        pending, started = self._pending, time.perf_counter()
        if pending is None:
            return None
        with self._faults_named(pending):
            if self._queue is not None:
                self._queue.maybe_finalize_async_calls(blocking=True)
            pending.checksums.join()
        self._publish()
        pending.times.blocked += time.perf_counter() - started
        return pending.final

    def close(self) -> None:
        """:meth:`finish`, then stop the asynchronous writer."""
        try:
            self.finish()
        finally:
            if self._queue is not None:
                self._queue.close(abort=True)  # nothing is left to finalize

    @contextlib.contextmanager
    def _faults_named(self, pending: _Pending):
        """A full disk is named and the partial checkpoint removed; a failed save is no longer in flight."""
        try:
            with write_faults_named(pending.final, pending.tmp):
                yield
        except BaseException:
            self._pending = None
            raise

    def _written(self, pending: _Pending, run_config_yaml: str) -> None:
        """Every rank's files are written (Megatron calls this on every rank): start the checksums."""
        _barrier()
        if _rank() == 0:
            (pending.tmp / "config.yaml").write_text(run_config_yaml)
        pending.times.written = time.perf_counter() - pending.started
        names = broadcast_from_first(_files(pending.tmp) if _rank() == 0 else None)
        pending.checksums = _Checksums(pending.tmp, names[_rank()::_world()])
        pending.checksums.start()

    def _publish(self) -> None:
        pending, self._pending = self._pending, None
        with self._faults_named(pending):
            pending.checksums.join()
            failed = gather_from_all(None if pending.checksums.error is None else repr(pending.checksums.error))
            if any(failed):
                raise CheckpointError(f"cannot checksum {pending.tmp}: {next(f for f in failed if f)}")
            every = gather_from_all(pending.checksums.sums)
            if _rank() == 0:
                sums = {name: value for part in every for name, value in part.items()}
                with atomic_file(pending.tmp / CHECKSUMS) as staging:
                    staging.write_text(json.dumps(dict(sorted(sums.items())), indent=1))
                shutil.rmtree(pending.final, ignore_errors=True)
                os.replace(pending.tmp, pending.final)
                with atomic_file(self.run.latest_file) as latest:
                    latest.write_text(str(pending.step))
                evict_old_checkpoints(self.run, self.keep_last, self.save_every)
            _barrier()
        pending.times.published = time.perf_counter() - pending.started


def _all_ranks(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=_reduction_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _reduction_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def evict_old_checkpoints(run: RunDir, keep_last: int, save_every: int = 0) -> list[Path]:
    """Remove all but the newest checkpoint and the newest ``keep_last`` scheduled ones (every
    ``save_every`` steps; all of them when 0); returns the removed.

    An off-schedule checkpoint (a signal's, the last step's) is kept only while it is the newest: it
    exists to resume from, and must never push out a scheduled checkpoint that checkpoint averaging
    over the last ``keep_last`` saves needs."""
    saved = run.list_checkpoints()
    scheduled = [path for path in saved if not save_every or checkpoint_step(path) % save_every == 0]
    kept = set(scheduled[-keep_last:] + saved[-1:])
    removed = [path for path in saved if path not in kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def record_checksums(ckpt_dir: str | os.PathLike) -> None:
    """Write ``CHECKSUMS`` for a checkpoint written outside :class:`CheckpointSaver` (``import-hf``'s weights).

    Collective: each rank reads its share of the files, rank 0 writes the manifest."""
    ckpt_dir = Path(ckpt_dir)
    names = broadcast_from_first(_files(ckpt_dir) if _rank() == 0 else None)
    every = gather_from_all(file_checksums(ckpt_dir, names[_rank()::_world()]))
    if _rank() == 0:
        sums = {name: value for part in every for name, value in part.items()}
        with atomic_file(ckpt_dir / CHECKSUMS) as staging:
            staging.write_text(json.dumps(dict(sorted(sums.items())), indent=1))


def has_training_state(ckpt_dir: str | os.PathLike) -> bool:
    """False for a weights-only checkpoint (``import-hf`` output): start from it, do not resume it."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir)) or {}
    return "train" in common


def pick_resumable(run: RunDir, report: Callable[[str], None] = say_once) -> Path | None:
    """The newest intact checkpoint of ``run`` with training state; None when it has none (a fresh run) or the
    newest intact one holds weights only (``import-hf`` output: started from, not resumed).

    A damaged checkpoint is reported (``report(message)``, naming the bad file) and the next older one
    tried (:func:`verified_checkpoint`'s verification). Collective.

    Raises:
        CheckpointError: the run has checkpoints and none is intact; nothing has been changed.
    """
    candidates = broadcast_from_first(run.list_checkpoints() if _rank() == 0 else None)
    if not candidates:
        return None
    found, damaged = (None, []) if verifying() else (candidates[-1], [])
    for candidate in reversed(candidates) if found is None else ():
        found, problems = newest_intact([candidate], report)
        if found is not None:
            break
        damaged += problems
        report(f"warning: cannot resume from {candidate.name}: {problems[0]}; trying the previous checkpoint")
    if found is None:
        raise CheckpointError(
            f"cannot resume {run.root}: none of its checkpoints is intact ({'; '.join(damaged)}); nothing was changed. "
            f"Restore a checkpoint from a copy, train into a new output_dir, or resume unverified with "
            f"checkpoint.verify=false")
    return found if broadcast_from_first(has_training_state(found) if _rank() == 0 else None) else None


def load_checkpoint(ckpt_dir: str | os.PathLike, engine) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``ckpt_dir``, saved in any parallel layout;
    returns its ``train`` state. The RNG state is restored only when the layout is the same."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    saved, now = common["train"]["layout"], layout()
    distributed = optimizer_state.is_distributed(engine.optimizer)
    if common["train"].get("distributed_optimizer") != distributed:
        raise CheckpointError(f"{ckpt_dir} was not saved with trainer.distributed_optimizer={distributed} (or by "
                              f"an older nemo-anchor): resume it with the setting and version that wrote it, or start "
                              f"a new run from its weights with model.init_from_hf={ckpt_dir}")
    optimizer_state.prepare_load(engine.optimizer, common["optimizer"])
    model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    state = {"model": model_state,
             "optimizer": optimizer_state.sharded_state(engine.optimizer, model_state, is_loading=True)}
    targets = optimizer_state.load_targets(engine.optimizer, state["optimizer"])
    if saved == now:  # per-rank RNG state means something only in the same layout
        state["rng"] = _rng_object(None)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    _load_model_weights(engine.gpt, loaded["model"], ckpt_dir)
    optimizer_state.finish_load(engine.optimizer, loaded["optimizer"], targets)
    engine.scheduler.load_state_dict(loaded["train"]["scheduler"])
    if "rng" in loaded:
        _set_rng_state(loaded["rng"])
    return loaded["train"]


def _check_global_shapes(value, stored: dict, ckpt_dir) -> None:
    """CheckpointError unless the checkpoint holds every tensor of ``value`` with the model's shape
    (dist_checkpointing would otherwise fill a larger vocabulary's extra rows without a word)."""
    for part in optimizer_state.parts(value):
        saved = stored.get(part.key)
        if saved is None:
            raise CheckpointError(f"{ckpt_dir} has no weights for {part.key}")
        if tuple(saved.global_shape) != tuple(part.global_shape):
            raise CheckpointError(f"{ckpt_dir}: {part.key} has shape {tuple(saved.global_shape)}, the model being "
                                  f"trained has {tuple(part.global_shape)}")


def _load_model_weights(gpt: torch.nn.Module, loaded: dict, ckpt_dir) -> None:
    weights = {k[len(MODEL_PREFIX):]: v for k, v in loaded.items() if k.startswith(MODEL_PREFIX)}
    missing, _ = gpt.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir} lacks model weights: {missing[:5]}")


def load_weights(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Load a checkpoint's full-precision weights (training or weights-only, any parallel layout) into
    ``gpt``, this rank's shards only.

    A bf16 run's parameters are saved in bf16; their fp32 masters are the optimizer's
    ``optimizer.state.fp32_param.*`` entries, which are read instead where the checkpoint has them.
    """
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    sharded = gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    for name, value in sharded.items():
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            continue
        master = f"{MASTER_PREFIX}{value.key}"
        if master in stored:
            sharded[name] = value = replace(value, key=master)
        _check_global_shapes(value, stored, ckpt_dir)
    _load_model_weights(gpt, dist_checkpointing.load({"model": sharded}, str(ckpt_dir))["model"], ckpt_dir)
