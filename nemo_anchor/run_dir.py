"""The layout of a training ``output_dir``: the one place that knows where things live in it.

::

    config.yaml                      effective run config
    tokenizer/                       HF tokenizer files (AutoTokenizer loads them offline)
    metrics.jsonl, tensorboard/      what the trainer logged
    checkpoints/iter_0000100/        one dist_checkpointing directory per saved step
        config.yaml                  the run config again, so the directory stands alone
    checkpoints/latest_checkpointed_iteration.txt
    .nemo-anchor-train.lock          while a run writes into it: host, pid and start time of that run

The trainer writes it, ``import-hf`` writes a weights-only one (step 0), export and evaluation
read it. A checkpoint is written under a hidden staging name and renamed into ``iter_NNNNNNN``
when complete, so every ``iter_*`` directory is a finished one.

One run writes into an ``output_dir`` at a time (:class:`RunClaim`): a second run is refused while
the first holds its lock, and a fresh run that fails before its first checkpoint removes the
folder it made, so nothing half-made is left behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_anchor.atomic import process_alive

ITER_PATTERN = re.compile(r"^iter_(\d{7})$")
LATEST_FILE = "latest_checkpointed_iteration.txt"
LOCK_FILE = ".nemo-anchor-train.lock"


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def checkpoint_step(ckpt_dir: str | os.PathLike) -> int:
    match = ITER_PATTERN.match(Path(ckpt_dir).name)
    if not match:
        raise ValueError(f"not a checkpoint directory name (iter_NNNNNNN): {ckpt_dir}")
    return int(match.group(1))


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return bool(ITER_PATTERN.match(path.name)) and (path / "metadata.json").is_file()


@dataclass(frozen=True)
class RunDir:
    """Paths inside one training ``output_dir``."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_file(self) -> Path:
        return self.checkpoints / LATEST_FILE

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / iter_dir_name(step)

    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first."""
        return list_checkpoints(self.checkpoints)


def list_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories under ``checkpoints_dir``, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and ITER_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_step)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A training output_dir -> its latest checkpoint; a checkpoint directory -> itself (unverified: readers
    call :func:`nemo_anchor.training.checkpoint.verified_checkpoint`)."""
    return checkpoints_of(path)[-1]


def checkpoints_of(path: str | os.PathLike) -> list[Path]:
    """A checkpoint directory -> ``[itself]``; a training output_dir (or its ``checkpoints/``) -> its
    checkpoints, oldest first. FileNotFoundError when there are none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if is_checkpoint_dir(path):
        return [path]
    for root in (RunDir(path).checkpoints, path):
        found = list_checkpoints(root)
        if found:
            return found
    raise FileNotFoundError(
        f"no checkpoint under {path}: expected an output_dir with checkpoints/iter_NNNNNNN/ or a "
        f"checkpoint directory iter_NNNNNNN containing metadata.json")


def read_run_config(ckpt_dir: str | os.PathLike):
    """The run config saved with a checkpoint (OmegaConf DictConfig)."""
    from omegaconf import OmegaConf

    path = Path(ckpt_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_dir} has no config.yaml")
    return OmegaConf.load(path)


def run_dir_of(ckpt_dir: str | os.PathLike) -> RunDir:
    """The output_dir a checkpoint directory ``OUTPUT_DIR/checkpoints/iter_N`` belongs to."""
    return RunDir(Path(ckpt_dir).parent.parent)


class RunDirInUse(ValueError):
    """The output_dir cannot be taken: another run holds its lock (the message names its host and pid and what
    to do), or it cannot be written."""


class RunLock:
    """One writer per run directory: a lock file naming the holder's host, pid and start time.

    Taken with an exclusive create (``O_CREAT | O_EXCL``), so of two runs starting at once exactly
    one gets it. A lock left by a process of this host that no longer exists (``kill -9``, a
    crash) is stale and is taken over: the run that gets the companion ``.break`` lock (also an
    exclusive create) checks that the lock still is the stale one and removes it, so of several
    runs finding it at once one removes it and one takes the lock. A lock of another host cannot be
    checked from here and is never broken.
    """

    BREAK_STALE_S = 5.0  # a .break lock older than this was left by a run that died while breaking

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.break_path = self.path.with_name(self.path.name + ".break")
        self.record: dict | None = None

    def acquire(self, timeout_s: float = 10.0) -> None:
        """Take the lock or raise :class:`RunDirInUse`."""
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": secrets.token_hex(8)}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._create(self.path, record):
                self.record = record
                return
            holder = self._read(self.path)
            if holder is not None and not self._stale(holder):
                raise RunDirInUse(self._held_message(holder))
            if holder is not None:
                self._break(holder, record)
            time.sleep(0.02)  # being written, or being broken by another run
        raise RunDirInUse(f"output_dir {self.path.parent}: could not take {self.path} within {timeout_s:g} s; if no "
                          f"training run writes into this folder, remove {self.path}")

    def release(self) -> None:
        """Remove the lock if it is still this one's."""
        if self.record is not None and self._read(self.path) == self.record:
            self.path.unlink(missing_ok=True)
        self.record = None

    def _break(self, stale: dict, record: dict) -> None:
        """Remove the lock if it still is ``stale``, holding ``.break`` meanwhile (only its holder removes locks)."""
        if not self._create(self.break_path, record):
            with contextlib.suppress(FileNotFoundError):
                if time.time() - self.break_path.stat().st_mtime > self.BREAK_STALE_S:
                    self.break_path.unlink()
            return
        try:
            if self._read(self.path) == stale:  # nobody else removes a lock meanwhile: still the stale one
                self.path.unlink()
        finally:
            self.break_path.unlink(missing_ok=True)

    @staticmethod
    def _create(path: Path, record: dict) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        return True

    @staticmethod
    def _read(path: Path) -> dict | None:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and {"host", "pid"} <= record.keys() else None

    @staticmethod
    def _stale(holder: dict) -> bool:
        return holder["host"] == socket.gethostname() and not process_alive(int(holder["pid"]))

    def _held_message(self, holder: dict) -> str:
        where = f"host {holder['host']}, pid {holder['pid']}" + (f", started {holder['started']}"
                                                                 if holder.get("started") else "")
        if holder["host"] == socket.gethostname():
            how = (f"wait for it to finish, or stop it with `kill -TERM {holder['pid']}` (it saves a checkpoint) and "
                   f"run again to resume; to start another run, choose another output_dir")
        else:
            how = (f"that host's processes cannot be checked from here: if that run is gone, remove {self.path}; "
                   f"to start another run, choose another output_dir")
        return f"output_dir {self.path.parent} is in use by another training run ({where}): {how}"


class RunClaim:
    """This run's hold on its output_dir: the lock, and what to remove if a fresh run fails.

    ``release(failed=True)`` of a run that found no folder (or an empty one) and saved no
    checkpoint removes what it wrote, leaving the folder as it was found; otherwise only the lock goes.
    """

    def __init__(self, run: RunDir):
        self.run = run
        self.existed = run.root.exists()
        self.fresh = not self.existed or (run.root.is_dir() and not any(run.root.iterdir()))
        run.root.mkdir(parents=True, exist_ok=True)
        self._lock = RunLock(run.lock)
        self._lock.acquire()  # when refused, the folder and everything in it belong to the holder

    def release(self, *, failed: bool) -> None:
        if failed and self.fresh and not self.run.list_checkpoints():
            if not self.existed:
                shutil.rmtree(self.run.root, ignore_errors=True)
                return
            for path in self.run.root.iterdir():
                if path != self.run.lock:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self._lock.release()
