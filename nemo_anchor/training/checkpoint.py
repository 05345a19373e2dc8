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
so a ``kill -9`` at any moment leaves the previous complete checkpoint (the next start removes the
``.tmp.*`` folder, naming it); a full disk is named and the partial checkpoint removed
(:func:`nemo_anchor.atomic.write_faults_named`). Its ``CHECKSUMS`` manifest records every file's size
and CRC-32; the manifest, the rename and ``latest`` are flushed to the disk (fsync) where the file
system supports it.

Saving stays off the training loop's critical path (:class:`CheckpointSaver`): on GPUs the shards are
written by Megatron's asynchronous ``dist_checkpointing`` save, scheduled on its ``AsyncCallsQueue``
as NeMo's ``ckpt_async_save`` and Megatron-LM's training loop do; the CRC-32s are computed by a
thread once the files are written. The checkpoint is renamed into place and named in ``latest`` only
when both are done, checked between steps, before the next save and before the run ends. Old
checkpoints are renamed away (``.deleting.*``) and deleted in the background after the ranks' barrier.

A stop (SIGTERM...) must fit the scheduler's grace period (torchrun and Kubernetes send SIGKILL 30 s
after SIGTERM): its checkpoint is written once and nothing of it is read back; its files' sizes are
recorded in ``checksums.pending.json`` (:data:`PENDING`), and the next start of the run computes and
records the CRC-32s (:func:`complete_pending`) before it trusts the checkpoint.

Every read of a checkpoint verifies it first (:func:`verified_checkpoint`, :func:`pick_resumable`):
a missing, truncated or corrupt file is named; given a run folder, the newest intact checkpoint is
used and the damaged ones named; a checkpoint without ``CHECKSUMS`` is said to be not verified. Only
an explicit ``--no-verify`` / ``checkpoint.verify=false`` skips this (:func:`verification`).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
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

from nemo_anchor.atomic import atomic_file, durable_replace, fsync_file, write_faults_named
from nemo_anchor.checksums import (CHECKSUMS, CheckpointError, broadcast_from_first, file_checksums, gather_from_all,
                                   newest_intact, say_once, verifying)
from nemo_anchor.convert.megatron_state import MASTER_PREFIX
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import optimizer_state

MODEL_PREFIX = "model."
PENDING = "checksums.pending.json"  # {file: bytes} of a checkpoint saved on a stop; the next start records its CRC-32s
STAGING_PREFIX = ".tmp."  # checkpoints/.tmp.iter_*: a save being written
DELETING_PREFIX = ".deleting."  # checkpoints/.deleting.*: an old checkpoint renamed away, being deleted
WAIT_S = 600.0  # a checksum pass that finishes no file, or deletions that do not end, for this long are named


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


def rng_state() -> dict:
    """This rank's RNG states (torch, Megatron's tracker, CUDA): what a checkpoint saves."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
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
    ``written`` from its start until every rank's files were on disk; ``published`` until it was checksummed
    (or recorded as pending, on a stop), renamed and named latest."""

    step: int
    blocked: float
    written: float | None = None
    published: float | None = None


class _Checksums(threading.Thread):
    """This rank's share of a written checkpoint's CRC-32s, computed off the training loop (file reads and
    zlib release the GIL); :meth:`cancel` abandons it between files (a stop does not wait for it)."""

    def __init__(self, ckpt_dir: Path, names: list[str]):
        super().__init__(name=f"checksums {ckpt_dir.name}", daemon=True)
        self.ckpt_dir, self.names = ckpt_dir, names
        self.sums: dict[str, list[int]] = {}
        self.error: BaseException | None = None
        self.reading: str | None = None
        self.progressed = time.monotonic()  # when the last file was finished
        self._cancelled = threading.Event()

    def run(self) -> None:
        try:
            for name in self.names:
                if self._cancelled.is_set():
                    return
                self.reading = name
                self.sums.update(file_checksums(self.ckpt_dir, [name]))
                self.progressed = time.monotonic()
            self.reading = None
        except BaseException as err:  # noqa: BLE001 - reported by CheckpointSaver on the loop's thread
            self.error = err

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def complete(self) -> bool:
        return not self.is_alive() and self.error is None and len(self.sums) == len(self.names)

    def wait(self) -> str | None:
        """Wait until done; what is stuck when no file was finished for :data:`WAIT_S` (None: done)."""
        while self.is_alive():
            self.join(timeout=max(0.0, self.progressed + WAIT_S - time.monotonic()) + 0.01)
            if self.is_alive() and time.monotonic() - self.progressed >= WAIT_S:
                return (f"the CRC-32 pass over {self.ckpt_dir} has been reading {self.ckpt_dir / str(self.reading)} "
                        f"for more than {WAIT_S:g} s (a hung file system?); the checkpoint stays unpublished")
        return None


class _Deletions:
    """Rank 0 deletes old checkpoints, first renamed away (``.deleting.*``), in background threads: a publish
    never waits for ~100 GB of files to go. What is left at an exit is removed by the next start."""

    def __init__(self):
        self._threads: list[tuple[threading.Thread, list[Path]]] = []

    def start(self, paths: list[Path]) -> None:
        if paths:
            thread = threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in paths],
                                      name=f"delete {paths[0].name}", daemon=True)
            thread.start()
            self._threads.append((thread, paths))

    def wait(self, report: Callable[[str], None]) -> None:
        """Wait up to :data:`WAIT_S` for the deletions; name those still running (left to the next start)."""
        deadline = time.monotonic() + WAIT_S
        for thread, paths in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                report(f"warning: still deleting {', '.join(map(str, paths))} after {WAIT_S:g} s (a slow or hung "
                       f"file system?); the next start of this run removes what is left")
        self._threads.clear()


@dataclass
class _Pending:
    step: int
    final: Path
    tmp: Path
    started: float
    times: SaveTimes
    sizes: dict[str, int] | None = None  # every file's size, set once every rank's files are written
    checksums: _Checksums | None = None  # this rank's CRC-32 pass, unless the save is a stop's


class CheckpointSaver:
    """Saves a run's checkpoints without holding the training loop for the write, the checksums or the eviction.

    :meth:`save` hands the shards to Megatron's ``dist_checkpointing`` (``asynchronous``: its async save,
    scheduled on an ``AsyncCallsQueue`` that a forked writer process drains, as NeMo's ``ckpt_async_save``
    does; otherwise written before it returns) and returns the directory the checkpoint will have. The
    CRC-32s are then computed by a thread, the ranks sharing the files. :meth:`poll` (between steps,
    never waiting) and :meth:`finish` (before the next save, before the run ends) publish a finished
    checkpoint: ``CHECKSUMS`` written, the directory renamed into place, ``latest`` updated (each flushed
    to the disk), old checkpoints renamed away and deleted in the background after the ranks' barrier.
    Until then a resume sees the previous checkpoint. Every method is collective.

    A stop (``save(..., read_back=False)``, SIGTERM's save) writes the checkpoint once and reads nothing of it
    back: its files' sizes are recorded in :data:`PENDING` and it is published; the checksum pass of an
    earlier save still running is abandoned, and that checkpoint published the same way. The next start
    computes and records those checksums before it trusts either (:func:`complete_pending`).
    """

    def __init__(self, run: RunDir, keep_last: int, save_every: int = 0, *, asynchronous: bool = False):
        self.run, self.keep_last, self.save_every = run, keep_last, save_every
        self.times: list[SaveTimes] = []
        self._queue = None
        if asynchronous:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()
        self._pending: _Pending | None = None
        self._deletions = _Deletions()

    @property
    def asynchronous(self) -> bool:
        return self._queue is not None

    def remove_leftovers(self) -> list[Path]:
        """Remove what saves and deletions that did not finish (a crash, SIGKILL, a stop) left in ``checkpoints/``:
        ``.tmp.*`` and ``.deleting.*`` folders, renamed away at once and deleted in the background; returns their
        names. Only the run's lease holder calls it (rank 0, before anything of this run is saved)."""
        found = sorted(path for path in self.run.checkpoints.glob(".*")
                       if path.name.startswith((STAGING_PREFIX, DELETING_PREFIX)) and path.is_dir())
        self._deletions.start([_rename_away(path) for path in found])
        return found

    def save(self, step: int, engine, train_state: dict, run_config_yaml: str, *, read_back: bool = True) -> Path:
        """Start saving this rank's shards of the model, optimizer, ``train_state`` and RNG; returns the
        directory the checkpoint will be published as.

        Every tensor handed to ``dist_checkpointing`` is a view of the training state: nothing is gathered,
        and the only copy is the writer's host staging of what this rank writes
        (:func:`nemo_anchor.training.memory.checkpoint_peak`). ``read_back=False`` (a stop): the checkpoint
        is written and published before this returns, its checksums left pending, nothing read back."""
        self.finish(read_back=read_back)  # one save in flight: the previous one is published first
        started = time.perf_counter()
        final = self.run.checkpoint(step)
        tmp = self.run.checkpoints / f"{STAGING_PREFIX}{final.name}"
        if _rank() == 0:
            if tmp.exists():
                self._deletions.start([_rename_away(tmp)])
            tmp.mkdir(parents=True)
        _barrier()
        model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
        state = {
            "model": model_state,
            "optimizer": optimizer_state.sharded_state(engine.optimizer, model_state, is_loading=False),
            "train": {**train_state, "layout": layout(), "scheduler": engine.scheduler.state_dict(),
                      "distributed_optimizer": optimizer_state.is_distributed(engine.optimizer)},
            "rng": _rng_object(rng_state()),
        }
        pending = self._pending = _Pending(step, final, tmp, started, SaveTimes(step, 0.0))
        self.times.append(pending.times)
        with self._faults_named(pending):
            if self._queue is None:
                dist_checkpointing.save(state, str(tmp))
                self._written(pending, run_config_yaml, read_back)
            else:
                request = dist_checkpointing.save(state, str(tmp), async_sharded_save=True)
                request.add_finalize_fn(lambda: self._written(pending, run_config_yaml, self._read_back))
                self._queue.schedule_async_request(request)
        pending.times.blocked += time.perf_counter() - pending.started
        if not read_back:
            self.finish(read_back=False)
        return final

    def poll(self) -> None:
        """Publish the checkpoint in flight if it is written and checksummed on every rank; never waits."""
        pending, started = self._pending, time.perf_counter()
        if pending is None:
            return
        with self._faults_named(pending):
            if self._queue is not None:
                self._read_back = True
                self._queue.maybe_finalize_async_calls(blocking=False)
            done = pending.checksums is not None and not pending.checksums.is_alive()
        if _all_ranks(done):
            self._publish(verified=True)
        pending.times.blocked += time.perf_counter() - started

    def finish(self, *, read_back: bool = True) -> Path | None:
        """Wait for the checkpoint in flight and publish it; returns its directory (None: none in flight).

        ``read_back=False`` (a stop): wait for its write only; a checksum pass not finished on every rank is
        abandoned and the checkpoint published with its checksums pending."""
        pending, started = self._pending, time.perf_counter()
        if pending is None:
            return None
        with self._faults_named(pending):
            if self._queue is not None:
                self._read_back = read_back
                self._queue.maybe_finalize_async_calls(blocking=True)
        verified = read_back or _all_ranks(pending.checksums is not None and pending.checksums.complete)
        self._publish(verified=verified)
        pending.times.blocked += time.perf_counter() - started
        return pending.final

    def close(self, *, wait_for_deletions: bool = True, report: Callable[[str], None] = say_once) -> None:
        """:meth:`finish`, then stop the asynchronous writer, and wait (a while) for old checkpoints to be deleted
        (``wait_for_deletions=False``, a stop: the next start removes what is left)."""
        try:
            self.finish(read_back=wait_for_deletions)
        finally:
            if self._queue is not None:
                self._queue.close(abort=True)  # nothing is left to finalize
            if wait_for_deletions:
                self._deletions.wait(report)

    _read_back = True  # what the asynchronous writer's finalize (``_written``) does: start the checksum pass or not

    @contextlib.contextmanager
    def _faults_named(self, pending: _Pending):
        """A full disk is named and the partial checkpoint removed; a failed save is no longer in flight."""
        try:
            with write_faults_named(pending.final, pending.tmp):
                yield
        except BaseException:
            self._pending = None
            raise

    def _written(self, pending: _Pending, run_config_yaml: str, read_back: bool) -> None:
        """Every rank's files are written (Megatron calls this on every rank): start the checksums, unless the
        save is a stop's."""
        _barrier()
        if _rank() == 0:
            (pending.tmp / "config.yaml").write_text(run_config_yaml)
        pending.times.written = time.perf_counter() - pending.started
        pending.sizes = broadcast_from_first(_file_sizes(pending.tmp) if _rank() == 0 else None)
        if read_back:
            pending.checksums = _Checksums(pending.tmp, sorted(pending.sizes)[_rank()::_world()])
            pending.checksums.start()

    def _publish(self, *, verified: bool) -> None:
        """``CHECKSUMS`` (``verified``: every rank's CRC-32s, waited for) or :data:`PENDING` (the sizes only),
        the rename into place and ``latest``, each flushed to the disk; then the eviction: renamed away before
        the barrier, deleted in the background after it."""
        pending, self._pending = self._pending, None
        with self._faults_named(pending):
            if verified:
                stuck = pending.checksums.wait()
                error = pending.checksums.error
                failed = gather_from_all(stuck or (None if error is None else f"cannot checksum {pending.tmp}: "
                                                                            f"{error!r}"))
                if any(failed):
                    raise CheckpointError(next(f for f in failed if f))
                every = gather_from_all(pending.checksums.sums)
            elif pending.checksums is not None:
                pending.checksums.cancel()  # a stop does not wait for it: the next start reads the files
            removed = []
            if _rank() == 0:
                if verified:
                    sums = {name: value for part in every for name, value in part.items()}
                    _write_json(pending.tmp / CHECKSUMS, dict(sorted(sums.items())))
                else:
                    _write_json(pending.tmp / PENDING, pending.sizes)
                if pending.final.exists():  # a checkpoint of the same step (a run resumed from a damaged one)
                    removed.append(_rename_away(pending.final))
                durable_replace(pending.tmp, pending.final)
                with atomic_file(self.run.latest_file, durable=True) as latest:
                    latest.write_text(str(pending.step))
                if verified:  # a stop evicts nothing: its save is pending, and the process exits next
                    removed += [_rename_away(path) for path in
                                checkpoints_to_evict(self.run, self.keep_last, self.save_every)]
            _barrier()
            self._deletions.start(removed)
        pending.times.published = time.perf_counter() - pending.started


def _write_json(path: Path, value) -> None:
    with atomic_file(path, durable=True) as staging:
        staging.write_text(json.dumps(value, indent=1))


def _rename_away(path: Path) -> Path:
    """``path`` renamed to a hidden ``.deleting.*`` sibling (atomic: it is no checkpoint from now on), to delete."""
    away = path.with_name(f"{DELETING_PREFIX}{path.name.removeprefix(STAGING_PREFIX)}.{secrets.token_hex(4)}")
    os.replace(path, away)
    return away


def _all_ranks(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=_reduction_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _reduction_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def checkpoints_to_evict(run: RunDir, keep_last: int, save_every: int = 0) -> list[Path]:
    """All but the newest checkpoint and the newest ``keep_last`` scheduled ones (every ``save_every`` steps; all
    of them when 0).

    An off-schedule checkpoint (a signal's, the last step's) is kept only while it is the newest: it
    exists to resume from, and must never push out a scheduled checkpoint that checkpoint averaging
    over the last ``keep_last`` saves needs."""
    saved = run.list_checkpoints()
    scheduled = [path for path in saved if not save_every or checkpoint_step(path) % save_every == 0]
    kept = set(scheduled[-keep_last:] + saved[-1:])
    return [path for path in saved if path not in kept]


def _file_sizes(ckpt_dir: Path) -> dict[str, int]:
    return {name: (ckpt_dir / name).stat().st_size for name in _files(ckpt_dir)}


def complete_pending(ckpt_dir: Path, report: Callable[[str], None] = say_once) -> str | None:
    """Compute and record the checksums of a checkpoint a stop saved (:data:`PENDING`), before it is trusted;
    returns what is wrong with it (None: recorded, it is verified now). Collective; called with the run's lease
    held.

    It is verified only when every file the save wrote is there with the size recorded at the save and every
    rank could read its share; then ``CHECKSUMS`` replaces :data:`PENDING`. Otherwise it stays pending, and is
    not used."""
    problem, sizes = None, None
    if _rank() == 0:
        try:
            sizes = json.loads((ckpt_dir / PENDING).read_text())
            if not isinstance(sizes, dict) or not sizes or \
                    not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes.values()):
                raise ValueError("not a {file: bytes} object")
            problem = next((f"{ckpt_dir / name} is missing" if not (ckpt_dir / name).is_file() else
                            f"{ckpt_dir / name} has {(ckpt_dir / name).stat().st_size} bytes, {PENDING} recorded "
                            f"{size} at the save" for name, size in sorted(sizes.items())
                            if not (ckpt_dir / name).is_file() or (ckpt_dir / name).stat().st_size != size), None)
        except (OSError, ValueError) as err:
            problem = f"{ckpt_dir / PENDING} is unreadable ({err})"
    problem, sizes = broadcast_from_first((problem, sizes))
    if problem is None:
        started = time.perf_counter()
        try:
            mine, failed = file_checksums(ckpt_dir, sorted(sizes)[_rank()::_world()]), None
        except OSError as err:
            mine, failed = {}, f"cannot read {err.filename or ckpt_dir}: {err.strerror or err}"
        every, failures = zip(*gather_from_all((mine, failed)))
        problem = next((f for f in failures if f), None)
        sums = {name: value for part in every for name, value in part.items()}
        if problem is None:
            problem = next((f"{ckpt_dir / name} has {value[0]} bytes now, {PENDING} recorded {sizes[name]}"
                            for name, value in sorted(sums.items()) if value[0] != sizes[name]), None)
        if problem is None and _rank() == 0:
            _write_json(ckpt_dir / CHECKSUMS, dict(sorted(sums.items())))
            (ckpt_dir / PENDING).unlink()
            fsync_file(ckpt_dir)
            report(f"recorded the checksums of {ckpt_dir.name}, pending since its save on a stop "
                   f"({time.perf_counter() - started:.1f} s)")
        _barrier()
    return problem


def has_pending_checksums(ckpt_dir: Path) -> bool:
    return (ckpt_dir / PENDING).is_file()


def _files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def record_checksums(ckpt_dir: str | os.PathLike) -> None:
    """Write ``CHECKSUMS`` for a checkpoint written outside :class:`CheckpointSaver` (``import-hf``'s weights).

    Collective: each rank reads its share of the files, rank 0 writes the manifest."""
    ckpt_dir = Path(ckpt_dir)
    names = broadcast_from_first(_files(ckpt_dir) if _rank() == 0 else None)
    every = gather_from_all(file_checksums(ckpt_dir, names[_rank()::_world()]))
    if _rank() == 0:
        _write_json(ckpt_dir / CHECKSUMS, dict(sorted({name: value for part in every for name, value in part.items()}.items())))


def has_training_state(ckpt_dir: str | os.PathLike) -> bool:
    """False for a weights-only checkpoint (``import-hf`` output): start from it, do not resume it."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir)) or {}
    return "train" in common


def pick_resumable(run: RunDir, report: Callable[[str], None] = say_once) -> Path | None:
    """The newest intact checkpoint of ``run`` with training state; None when it has none (a fresh run) or the
    newest intact one holds weights only (``import-hf`` output: started from, not resumed).

    A damaged checkpoint is reported (``report(message)``, naming the bad file) and the next older one
    tried (:func:`verified_checkpoint`'s verification). The checksums a stop left pending are computed and
    recorded first (:func:`complete_pending`); one that cannot be is damaged. Collective; called with the
    run's lease held.

    Raises:
        CheckpointError: the run has checkpoints and none is intact; nothing has been changed.
    """
    candidates = broadcast_from_first(run.list_checkpoints() if _rank() == 0 else None)
    if not candidates:
        return None
    if not verifying():
        found = candidates[-1]
    else:
        pending = broadcast_from_first([c for c in candidates if has_pending_checksums(c)] if _rank() == 0 else None)
        unusable = {candidate: complete_pending(candidate, report) for candidate in reversed(pending)}
        found, damaged = None, []
        for candidate in reversed(candidates):
            if candidate in unusable:  # its checksums were just computed from its files: read once, not twice
                found, problems = (candidate, []) if unusable[candidate] is None else (None, [unusable[candidate]])
            else:
                found, problems = newest_intact([candidate], report)
            if found is not None:
                break
            damaged += problems
            report(f"warning: cannot resume from {candidate.name}: {problems[0]}; trying the previous checkpoint")
        if found is None:
            raise CheckpointError(
                f"cannot resume {run.root}: none of its checkpoints is intact ({'; '.join(damaged)}); nothing was "
                f"changed. Restore a checkpoint from a copy, train into a new output_dir, or resume unverified with "
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
        set_rng_state(loaded["rng"])
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
