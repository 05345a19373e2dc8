"""Saving and publishing training checkpoints (what one holds, and reading it back: :mod:`.checkpoint`).

A checkpoint is written into ``checkpoints/.tmp.iter_*`` and renamed into place when every rank has finished,
so a ``kill -9`` at any moment leaves the previous complete checkpoint (the next start removes the ``.tmp.*``
folder, naming it); a full disk is named and the partial checkpoint removed
(:func:`nemo_anchor.atomic.write_faults_named`).

Publishing, in this order (the one place it is written down; tests/test_checkpoint_durability.py traces it):

1. every rank's shards are written by Megatron's writer, which fsyncs each file it writes, their bytes digested
   as they are written (:func:`digested_writes`); rank 0 writes ``config.yaml``. The small files written in the
   main process (``.metadata``, ``common.pt``, ``metadata.json``, ``config.yaml``) are digested right after;
2. except on a stop, the files are read back in a thread and compared with those digests;
3. rank 0 fsyncs every file of the staging folder, Megatron's own included, then the folder
   (:func:`_flush_tree`), and writes ``checksums.json`` (:func:`nemo_anchor.checksums.write_manifest`: staged,
   fsynced, renamed, the folder fsynced again);
4. ``fence("publish iter_N")``; an earlier checkpoint of the same step renamed away; the folder renamed into
   place and ``checkpoints/`` fsynced (:func:`nemo_anchor.atomic.durable_replace`);
5. ``fence("name iter_N latest")``; ``latest`` written (staged, fsynced, renamed, ``checkpoints/`` fsynced);
6. except on a stop, for each checkpoint retention lets go (:func:`checkpoints_to_evict`):
   ``fence("evict iter_M")``, renamed away (``.deleting.*``);
7. the ranks' barrier; what was renamed away is deleted in the background.

A ``fence`` that returns False skips its act and what depends on it (nothing is published); the ranks still
meet at the barrier. It is how a run that lost its lease on the run folder is kept from changing it.

Saving stays off the training loop's critical path (:class:`CheckpointSaver`): on GPUs the shards are written by
Megatron's asynchronous ``dist_checkpointing`` save, scheduled on its ``AsyncCallsQueue`` as NeMo's
``ckpt_async_save`` and Megatron-LM's training loop do; the read-back runs in a thread. The checkpoint is
published when both are done, checked between steps, before the next save and before the run ends.

A stop (SIGTERM...) must fit the scheduler's grace period (torchrun and Kubernetes send SIGKILL 30 s after
SIGTERM): its checkpoint is written once and nothing of its shards is read back; ``checksums.json`` records the
digests made as it was written, so damage before the next start is caught there like any other. Only where
the writer reported no digest (a Megatron that writes its files another way) are the sizes recorded in
``checksums.pending.json`` instead, and the next start digests the files as it finds them
(:func:`nemo_anchor.training.checkpoint.complete_pending`, marked ``read back at the next start``).
"""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from nemo_anchor.atomic import atomic_file, durable_replace, fsync_file, write_faults_named
from nemo_anchor.checksums import (AS_WRITTEN, READ_BACK, CheckpointError, ContentDigest, broadcast_from_first,
                                   file_digests, gather_from_all, process_count, process_rank, say_once,
                                   write_manifest)
from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import optimizer_state
from nemo_anchor.training.checkpoint import MODEL_PREFIX, PENDING, SCHEDULED, layout, rng_object, rng_state

STAGING_PREFIX = ".tmp."  # checkpoints/.tmp.iter_*: a save being written
DELETING_PREFIX = ".deleting."  # checkpoints/.deleting.*: an old checkpoint renamed away, being deleted
SHARD_SUFFIX = ".distcp"  # the files Megatron's writer writes (digested as written); the others are small
WAIT_S = 600.0  # a read-back that finishes no file, or deletions that do not end, for this long are named


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(run: RunDir, step: int, engine, train_state: dict, run_config_yaml: str,
                    keep_last: int, save_every: int = 0) -> Path:
    """Save this rank's shards of the model, optimizer, ``train_state`` and RNG, and wait until the checkpoint
    is published (digested, renamed, named latest); returns its directory. Collective.

    The training loop saves through a :class:`CheckpointSaver` instead, which returns at once."""
    saver = CheckpointSaver(run, keep_last, save_every, asynchronous=False)
    final = saver.save(step, engine, train_state, run_config_yaml)
    saver.finish()
    return final


def async_save_available(device: torch.device) -> bool:
    """Whether Megatron's asynchronous save can run for a trainer on ``device``: it synchronizes the CUDA device
    and all-reduces on it (async_utils.py: TemporalAsyncCaller.schedule_async_call, maybe_finalize_async_calls)."""
    return device.type == "cuda"


class _DigestedFile:
    """A file Megatron's writer writes, its bytes digested as they go by; on a clean close (after the writer's
    fsync) ``(path, bytes, digest)`` is put on ``reports`` (the writers are forked processes)."""

    def __init__(self, handle, path: str, reports):
        self._handle, self._path, self._reports = handle, path, reports
        self._digest, self._in_order = ContentDigest(), True

    def write(self, data):
        self._digest.update(data)
        return self._handle.write(data)

    def seek(self, *args):  # bytes rewritten out of order would not be what was digested: report none
        self._in_order = False
        return self._handle.seek(*args)

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        self._handle.__exit__(kind, error, trace)
        if kind is None and self._in_order:
            self._reports.put((self._path, *self._digest.value()))
        return False


@contextlib.contextmanager
def digested_writes(reports):
    """While the block runs (and in the writer processes forked in it), every file Megatron's
    ``FileSystemWriterAsync`` opens for writing is a :class:`_DigestedFile` reporting on ``reports``.

    Its writer looks ``open`` up in its module's globals at each file (filesystem_async.py:
    ``write_preloaded_data``); a Megatron that writes another way reports nothing, and the checkpoint is then
    read back (or, on a stop, left pending), as before. Megatron's multi-storage-client path (on by default where
    the package is installed, as NeMo installs it) is turned off for the block with Megatron's own flag (what
    ``--disable-msc`` does): it writes each file through a temporary one renamed into place, fsyncing none (a
    strace of a save shows it), and a run folder is a POSIX path, which Megatron's plain path writes and fsyncs."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.msc_utils import MultiStorageClientFeature

    def digesting_open(file, mode="r", *args, **kwargs):
        handle = open(file, mode, *args, **kwargs)
        return _DigestedFile(handle, os.fspath(file), reports) if "w" in mode else handle

    msc = MultiStorageClientFeature.is_enabled()
    MultiStorageClientFeature.disable()
    filesystem_async.open = digesting_open
    try:
        yield
    finally:
        del filesystem_async.open
        if msc:
            MultiStorageClientFeature.enable()


@dataclass
class SaveTimes:
    """Seconds of one save: ``blocked`` the training loop waited for it (in :meth:`CheckpointSaver.save`, and in
    the :meth:`~CheckpointSaver.poll` / :meth:`~CheckpointSaver.finish` calls until it was published);
    ``written`` from its start until every rank's files were on disk; ``published`` until it was read back
    (not on a stop), renamed and named latest."""

    step: int
    blocked: float
    written: float | None = None
    published: float | None = None


class _ReadBack(threading.Thread):
    """This rank's share of a written checkpoint's files read back and digested, off the training loop (file reads
    and xxhash release the GIL); :meth:`cancel` abandons it between files (a stop does not wait for it)."""

    def __init__(self, ckpt_dir: Path, names: list[str]):
        super().__init__(name=f"read back {ckpt_dir.name}", daemon=True)
        self.ckpt_dir, self.names = ckpt_dir, names
        self.sums: dict[str, list] = {}
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
                self.sums.update(file_digests(self.ckpt_dir, [name]))
                self.progressed = time.monotonic()
            self.reading = None
        except BaseException as err:  # noqa: BLE001 - reported by CheckpointSaver on the loop's thread
            self.error = err

    def cancel(self) -> None:
        self._cancelled.set()

    def wait(self) -> str | None:
        """Wait until done; what is stuck when no file was finished for :data:`WAIT_S` (None: done)."""
        while self.is_alive():
            self.join(timeout=max(0.0, self.progressed + WAIT_S - time.monotonic()) + 0.01)
            if self.is_alive() and time.monotonic() - self.progressed >= WAIT_S:
                return (f"the read-back of {self.ckpt_dir} has been reading {self.ckpt_dir / str(self.reading)} "
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
    written: dict[str, list] | None = None  # {file: [bytes, digest]} as written; None: a shard's is missing
    read_back: _ReadBack | None = None  # this rank's read-back, unless the save is a stop's


class CheckpointSaver:
    """Saves a run's checkpoints without holding the training loop for the write, the read-back or the eviction.

    :meth:`save` hands the shards to Megatron's ``dist_checkpointing`` (``asynchronous``: its async save,
    scheduled on an ``AsyncCallsQueue`` that a forked writer process drains, as NeMo's ``ckpt_async_save``
    does; otherwise written before it returns) and returns the directory the checkpoint will have. The files
    are then read back by a thread, the ranks sharing them. :meth:`poll` (between steps, never waiting) and
    :meth:`finish` (before the next save, before the run ends) publish a finished checkpoint as the module
    docstring says. Until then a resume sees the previous checkpoint. Every method is collective.

    A stop (``save(..., read_back=False)``, SIGTERM's save) writes the checkpoint once, reads nothing of its shards
    back and publishes it with the digests made as it was written; the read-back of an earlier save still running
    is abandoned, and that checkpoint published the same way.

    ``fence(act)``, on rank 0, is asked before each act that changes ``checkpoints/`` (``"publish iter_N"``,
    ``"name iter_N latest"``, ``"evict iter_N"``, ``"remove leftovers"``); when it returns False the act is
    skipped (the callable says why).
    """

    def __init__(self, run: RunDir, keep_last: int, save_every: int = 0, *, asynchronous: bool = False,
                 fence: Callable[[str], bool] | None = None):
        self.run, self.keep_last, self.save_every = run, keep_last, save_every
        self.fence = fence or (lambda act: True)
        self.times: list[SaveTimes] = []
        self._queue = None
        if asynchronous:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue()
        self._reports = multiprocessing.get_context("fork").SimpleQueue()  # the forked writers' digests
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
        if found and not self.fence("remove leftovers"):
            return []
        self._deletions.start([_rename_away(path) for path in found])
        return found

    def save(self, step: int, engine, train_state: dict, run_config_yaml: str, *, read_back: bool = True) -> Path:
        """Start saving this rank's shards of the model, optimizer, ``train_state`` and RNG; returns the
        directory the checkpoint will be published as.

        Every tensor handed to ``dist_checkpointing`` is a view of the training state: nothing is gathered,
        and the only copy is the writer's host staging of what this rank writes
        (:func:`nemo_anchor.training.memory.checkpoint_peak`). The train state records whether the save is on
        the ``save_every`` schedule (:data:`~nemo_anchor.training.checkpoint.SCHEDULED`, for retention).
        ``read_back=False`` (a stop): the checkpoint is written and published before this returns, nothing of its
        shards read back."""
        self.finish(read_back=read_back)  # one save in flight: the previous one is published first
        started = time.perf_counter()
        final = self.run.checkpoint(step)
        tmp = self.run.checkpoints / f"{STAGING_PREFIX}{final.name}"
        if process_rank() == 0:
            if tmp.exists():
                self._deletions.start([_rename_away(tmp)])
            tmp.mkdir(parents=True)
        _barrier()
        model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
        scheduled = not self.save_every or step % self.save_every == 0
        state = {
            "model": model_state,
            "optimizer": optimizer_state.sharded_state(engine.optimizer, model_state, is_loading=False),
            "train": {**train_state, "layout": layout(), "scheduler": engine.scheduler.state_dict(),
                      "distributed_optimizer": optimizer_state.is_distributed(engine.optimizer),
                      SCHEDULED: scheduled},
            "rng": rng_object(rng_state()),
        }
        pending = self._pending = _Pending(step, final, tmp, started, SaveTimes(step, 0.0))
        self.times.append(pending.times)
        with self._faults_named(pending), digested_writes(self._reports):
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
        """Publish the checkpoint in flight if it is written and read back on every rank; never waits."""
        pending, started = self._pending, time.perf_counter()
        if pending is None:
            return
        with self._faults_named(pending):
            if self._queue is not None:
                self._read_back = True
                self._queue.maybe_finalize_async_calls(blocking=False)
            done = pending.read_back is not None and not pending.read_back.is_alive()
        if _all_ranks(done):
            self._publish(read_back=True)
        pending.times.blocked += time.perf_counter() - started

    def finish(self, *, read_back: bool = True) -> Path | None:
        """Wait for the checkpoint in flight and publish it; returns its directory (None: none in flight, or a
        ``fence`` kept it from being published).

        ``read_back=False`` (a stop): wait for its write only; a read-back not finished is abandoned."""
        pending, started = self._pending, time.perf_counter()
        if pending is None:
            return None
        with self._faults_named(pending):
            if self._queue is not None:
                self._read_back = read_back
                self._queue.maybe_finalize_async_calls(blocking=True)
        published = self._publish(read_back=read_back)
        pending.times.blocked += time.perf_counter() - started
        return pending.final if published else None

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

    _read_back = True  # what the asynchronous writer's finalize (``_written``) does: start the read-back or not

    @contextlib.contextmanager
    def _faults_named(self, pending: _Pending):
        """A full disk is named and the partial checkpoint removed; a failed save is no longer in flight."""
        try:
            with write_faults_named(pending.final, pending.tmp):
                yield
        except BaseException:
            self._pending = None
            raise

    def _reported(self, tmp: Path) -> dict[str, list]:
        """``{file: [bytes, digest]}`` the writer processes reported for files of ``tmp`` (others: a failed save's)."""
        found = {}
        while not self._reports.empty():
            path, size, digest = self._reports.get()
            if Path(path).parent == tmp:
                found[Path(path).name] = [size, digest]
        return found

    def _written(self, pending: _Pending, run_config_yaml: str, read_back: bool) -> None:
        """Every rank's files are written (Megatron calls this on every rank): their digests are gathered, those of
        the small files made now, and the read-back started unless the save is a stop's."""
        _barrier()
        reported = {name: entry for part in gather_from_all(self._reported(pending.tmp)) for name, entry in
                    part.items()}
        if process_rank() == 0:
            (pending.tmp / "config.yaml").write_text(run_config_yaml)
        pending.times.written = time.perf_counter() - pending.started
        if process_rank() == 0:
            sizes = _file_sizes(pending.tmp)
            small = [name for name in sizes if not name.endswith(SHARD_SUFFIX)]
            written = {**{name: reported[name] for name in sizes if name in reported},
                       **_just_written(pending.tmp, small)}
            complete = sorted(written) == sorted(sizes) and all(written[name][0] == sizes[name] for name in sizes)
            shared = sizes, written if complete else None
        pending.sizes, pending.written = broadcast_from_first(shared if process_rank() == 0 else None)
        if read_back:
            pending.read_back = _ReadBack(pending.tmp, sorted(pending.sizes)[process_rank()::process_count()])
            pending.read_back.start()

    def _publish(self, *, read_back: bool) -> bool:
        """Record the digests (``read_back``: compared with the files read back by every rank, waited for), then
        publish as the module docstring says; whether the checkpoint was published."""
        pending, self._pending = self._pending, None
        with self._faults_named(pending):
            sums, recorded = pending.written, AS_WRITTEN
            if read_back:
                sums, recorded = self._compared(pending)
            elif pending.read_back is not None:
                pending.read_back.cancel()  # a stop does not wait for it
            removed, published = [], False
            if process_rank() == 0:
                _flush_tree(pending.tmp)
                if sums is not None:
                    write_manifest(pending.tmp, sums, recorded)
                else:  # a stop whose writer reported no digests: the next start digests the files it finds
                    with atomic_file(pending.tmp / PENDING, durable=True) as staging:
                        staging.write_text(json.dumps(pending.sizes, indent=1))
                published = self.fence(f"publish {pending.final.name}")
                if published:
                    if pending.final.exists():  # a checkpoint of the same step (a run resumed from a damaged one)
                        removed.append(_rename_away(pending.final))
                    durable_replace(pending.tmp, pending.final)
                    if self.fence(f"name {pending.final.name} latest"):
                        with atomic_file(self.run.latest_file, durable=True) as latest:
                            latest.write_text(str(pending.step))
                    if read_back:  # a stop evicts nothing: the process exits next
                        removed += [_rename_away(path) for path in checkpoints_to_evict(self.run, self.keep_last)
                                    if self.fence(f"evict {path.name}")]
            published = broadcast_from_first(published)  # the ranks' barrier
            self._deletions.start(removed)
        pending.times.published = time.perf_counter() - pending.started
        return published

    def _compared(self, pending: _Pending) -> tuple[dict[str, list], str]:
        """The digests to record, after every rank's read-back: those made as written, each equal to the file's
        read back (CheckpointError naming the first that differs); the read-back's where a writer reported none."""
        stuck = pending.read_back.wait()
        error = pending.read_back.error
        failed = gather_from_all(stuck or (None if error is None else f"cannot read back {pending.tmp}: {error!r}"))
        if any(failed):
            raise CheckpointError(next(f for f in failed if f))
        read = {name: value for part in gather_from_all(pending.read_back.sums) for name, value in part.items()}
        if pending.written is None:
            return read, READ_BACK
        differs = next((name for name in sorted(read) if read[name] != pending.written[name]), None)
        if differs is not None:
            raise CheckpointError(f"{pending.tmp / differs} read back differs from what was written "
                                  f"({read[differs]} != {pending.written[differs]}): a faulty disk or file system? "
                                  f"The checkpoint is not published")
        return pending.written, AS_WRITTEN


def _just_written(folder: Path, names: list[str]) -> dict[str, list]:
    """``{file: [bytes, digest]}`` of the small files the main process has just written (kilobytes, in the page
    cache): not a read-back of the checkpoint, which is its shards."""
    digests = {}
    for name in names:
        digest = ContentDigest()
        digest.update((folder / name).read_bytes())
        digests[name] = digest.value()
    return digests


def _flush_tree(folder: Path) -> None:
    """Every file under ``folder`` fsynced, then every folder, deepest first (each rank's writer fsynced its
    shards already; on one host this covers all of them, on several each host's are its writers')."""
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        (folders.append if path.is_dir() else fsync_file)(path)
    for path in reversed(folders):
        fsync_file(path)


def _rename_away(path: Path) -> Path:
    """``path`` renamed to a hidden ``.deleting.*`` sibling (atomic: it is no checkpoint from now on), to delete."""
    away = path.with_name(f"{DELETING_PREFIX}{path.name.removeprefix(STAGING_PREFIX)}.{secrets.token_hex(4)}")
    os.replace(path, away)
    return away


def _all_ranks(flag: bool) -> bool:
    if not dist.is_initialized():
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _on_schedule(ckpt_dir: Path) -> bool:
    """Whether ``ckpt_dir`` was saved on its run's ``save_every`` schedule, as its train state recorded at the save;
    True for checkpoints saved before the record existed, and for one whose state cannot be read (kept: when in
    doubt, nothing is deleted)."""
    try:
        return dist_checkpointing.load_common_state_dict(str(ckpt_dir))["train"].get(SCHEDULED, True) is not False
    except Exception:  # noqa: BLE001 - a damaged checkpoint is judged by its reader, not deleted here
        return True


def checkpoints_to_evict(run: RunDir, keep_last: int) -> list[Path]:
    """All but the newest ``keep_last`` checkpoints and the newest ``keep_last`` scheduled ones.

    Scheduled is what each checkpoint's train state recorded when it was saved (:func:`_on_schedule`), not what the
    current ``save_every`` would say: a resume that changes ``save_every`` keeps the earlier saves. So the newest
    ``keep_last`` checkpoints always survive, whatever they are, and an off-schedule one (a signal's, the last
    step's) never pushes out a scheduled one that checkpoint averaging over the last ``keep_last`` saves needs."""
    saved = run.list_checkpoints()
    kept = set(saved[-keep_last:])
    scheduled = 0
    for path in reversed(saved):
        if scheduled == keep_last:
            break
        if _on_schedule(path):
            kept.add(path)
            scheduled += 1
    return [path for path in saved if path not in kept]


def _file_sizes(ckpt_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(ckpt_dir)): p.stat().st_size for p in sorted(ckpt_dir.rglob("*")) if p.is_file()}
