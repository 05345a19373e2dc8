"""The layout of a training ``output_dir``: the one place that knows where things live in it.

::

    config.yaml                      effective run config
    tokenizer/                       HF tokenizer files (AutoTokenizer loads them offline)
    metrics.jsonl, tensorboard/      what the trainer logged
    checkpoints/iter_0000100/        one dist_checkpointing directory per saved step
        config.yaml                  the run config again, so the directory stands alone
    checkpoints/latest_checkpointed_iteration.txt
    .nemo-anchor-train.lock          while a run writes into it: its lease (host, pid, job, last renewal)

The trainer writes it, ``import-hf`` writes a weights-only one (step 0), export and evaluation
read it. A checkpoint is written under a hidden staging name and renamed into ``iter_NNNNNNN``
when complete, so every ``iter_*`` directory is a finished one.

One run writes into an ``output_dir`` at a time (:class:`RunClaim`, :class:`RunLease`): a second run
is refused while the first holds its lease; a requeued job, or a run after a dead one, takes it
over; and a fresh run that fails before its first checkpoint removes the folder it made, so
nothing half-made is left behind.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_anchor.atomic import process_alive, process_start_time

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
    call :func:`nemo_anchor.checksums.verified_checkpoint`)."""
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
    """The output_dir cannot be taken: another run holds its lease (the message names its host, pid and job and
    what to do), or it cannot be written."""


LEASE_RENEW_ENV = "NEMO_ANCHOR_LEASE_RENEW_S"
LEASE_TIMEOUT_ENV = "NEMO_ANCHOR_LEASE_TIMEOUT_S"
DEFAULT_LEASE_RENEW_S = 30.0
DEFAULT_LEASE_TIMEOUT_S = 300.0


def lease_timing() -> tuple[float, float]:
    """(renew every, taken over after) in seconds: ``NEMO_ANCHOR_LEASE_RENEW_S`` (30) and
    ``NEMO_ANCHOR_LEASE_TIMEOUT_S`` (300); ValueError naming a variable that is not a number or where the
    lease would expire between two renewals."""
    values = []
    for name, default in ((LEASE_RENEW_ENV, DEFAULT_LEASE_RENEW_S), (LEASE_TIMEOUT_ENV, DEFAULT_LEASE_TIMEOUT_S)):
        text = os.environ.get(name, "").strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}={text!r} is not a positive number of seconds")
        values.append(value)
    renew, timeout = values
    if timeout < 2 * renew:
        raise ValueError(f"{LEASE_TIMEOUT_ENV}={timeout:g} must be at least twice {LEASE_RENEW_ENV}={renew:g}: "
                         f"a live run would lose its lease between two renewals")
    return renew, timeout


def scheduler_job() -> tuple[str | None, int | None]:
    """(the scheduler job this process runs in, how often it was restarted), or (None, None).

    Slurm's ``SLURM_JOB_ID`` is kept when a job is requeued (``SLURM_RESTART_COUNT`` counts the
    restarts); otherwise torchrun's ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; "none", torchrun's default,
    names no job) and ``TORCHELASTIC_RESTART_COUNT``.
    """
    for job_var, restart_var, scheduler in (("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "slurm"),
                                            ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "torchelastic")):
        job = os.environ.get(job_var, "").strip()
        if job and job != "none":
            restart = os.environ.get(restart_var, "").strip()
            return f"{scheduler} {job}", int(restart) if restart.isdigit() else None
    return None, None


class RunLease:
    """One writer per run directory: a lease file naming the holder, renewed while the holder runs.

    The holder is named by its host, pid and the pid's start time (:func:`~nemo_anchor.atomic.process_start_time`),
    and by its scheduler job (:func:`scheduler_job`). Rank 0 renews the lease every ``renew_s``
    (``NEMO_ANCHOR_LEASE_RENEW_S``, 30 s), in a daemon thread (:meth:`start_renewing`). Another run takes it over

    - at once when the holder was a process of this host that is gone: no process with its pid, or
      one that started at another time (the pid was reused, or a container restarted under the
      same hostname gave this run the holder's pid);
    - at once when the holder ran in this run's scheduler job, on another host: the job was requeued
      (the scheduler ended the old one first). Two restarts of the same number of one job are two
      live steps of it, not a requeue;
    - from any host, when the lease was not renewed for ``timeout_s`` (``NEMO_ANCHOR_LEASE_TIMEOUT_S``,
      300 s; the holder's own setting counts). The hosts' clocks must agree to well within that.

    Otherwise the run is refused naming the holder's host, pid and job. A live process of this host
    is never taken over, whatever its lease says.

    The lease is taken with an exclusive create (``O_CREAT | O_EXCL``), so of two runs starting at
    once exactly one gets it. Only the holder of the companion ``.break`` file (also an exclusive
    create) removes or rewrites a lease, after checking it is still the one it judged: of several
    runs finding a stale lease at once one removes it and one takes it, and a renewal never
    overwrites a lease taken over meanwhile.

    As a context manager (for a Lightning callback or a Bridge hook, rank 0 only)::

        with RunLease(Path(log_dir) / LOCK_FILE):   # acquire, renew in the background
            train()                                  # RunDirInUse raised on entry when held
    """

    BREAK_STALE_S = 5.0  # a .break lock older than this was left by a run that died while breaking

    def __init__(self, path: str | os.PathLike, renew_s: float | None = None, timeout_s: float | None = None):
        self.path = Path(path)
        self.break_path = self.path.with_name(self.path.name + ".break")
        if renew_s is None or timeout_s is None:
            from_env = lease_timing()
            renew_s, timeout_s = renew_s or from_env[0], timeout_s or from_env[1]
        self.renew_s, self.timeout_s = renew_s, timeout_s
        self.record: dict | None = None
        self.took_over: str | None = None  # why the previous holder's lease was taken over, if it was
        self.lost = threading.Event()  # set when another run took the lease over (this one stopped renewing)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> "RunLease":
        self.acquire()
        self.start_renewing()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self, wait_s: float = 10.0) -> None:
        """Take the lease or raise :class:`RunDirInUse`."""
        job, restart = scheduler_job()
        record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": process_start_time(os.getpid()),
                  "job": job, "restart": restart, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "renewed": time.time(), "timeout_s": self.timeout_s, "token": secrets.token_hex(8)}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            record["renewed"] = time.time()
            if self._create(self.path, record):
                self.record = record
                return
            holder = self._read(self.path)
            if holder is not None:
                why = self._takeover_reason(holder, job, restart)
                if why is None:
                    raise RunDirInUse(self._held_message(holder))
                if self._break(holder):
                    self.took_over = f"{self._describe(holder)}: {why}"
            time.sleep(0.02)  # being written, or being broken by another run
        raise RunDirInUse(f"output_dir {self.path.parent}: could not take {self.path} within {wait_s:g} s; if no "
                          f"training run writes into this folder, remove {self.path}")

    def start_renewing(self) -> None:
        """Renew the lease every ``renew_s`` in a daemon thread until :meth:`release`."""
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="nemo-anchor-lease", daemon=True)
        self._renewer.start()

    def renew(self) -> bool:
        """Write the lease again with the time now; False when it is no longer this one's (taken over).

        A file system that does not answer (OSError) leaves the lease as it was: renewed next time.
        """
        if self.record is None:
            return False
        if not self._hold_break():
            return True  # another run judges the lease right now: it finds it fresh, or it was not ours
        try:
            record = {**self.record, "renewed": time.time()}
            current = self._read(self.path)
            if current is None:  # removed by hand (the run is alive), or being created by a run that found it gone
                if self._create(self.path, record):
                    self.record = record
                return True  # not created: whoever did is known at the next renewal
            if current.get("token") != self.record["token"]:
                return False
            staging = self.path.with_name(f"{self.path.name}.{self.record['token']}.tmp")
            staging.write_text(json.dumps(record))
            os.replace(staging, self.path)
            self.record = record
            return True
        finally:
            self.break_path.unlink(missing_ok=True)

    def release(self) -> None:
        """Stop renewing; remove the lease if it is still this one's."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self.record is not None:
            current = self._read(self.path)
            if current is not None and current.get("token") == self.record["token"]:
                self.path.unlink(missing_ok=True)
        self.record = None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                still_mine = self.renew()
            except OSError as err:
                print(f"warning: could not renew {self.path}: {err}; trying again in {self.renew_s:g} s",
                      file=sys.stderr, flush=True)
                continue
            if not still_mine:
                self.lost.set()
                print(f"warning: {self.path} was taken over by another run ({self._describe(self._read(self.path))}"
                      f"); this run no longer holds its output_dir", file=sys.stderr, flush=True)
                return

    def _takeover_reason(self, holder: dict, job: str | None, restart: int | None) -> str | None:
        """Why ``holder``'s lease may be taken over now; None when it may not."""
        pid, pid_started = int(holder["pid"]), holder.get("pid_started")
        expired = self._age(holder) > float(holder.get("timeout_s") or self.timeout_s)
        if holder["host"] == socket.gethostname():
            if pid == os.getpid() and pid_started is None:
                return "its pid is this run's own (it is gone)"  # a lease naming this very process carries its start
            if not process_alive(pid, pid_started):
                return "its process is gone" if pid_started is None or not process_alive(pid) else \
                    f"pid {pid} is another process now"
            if pid_started is None and expired:  # a lock from before start times were recorded
                return f"not renewed for {self._age(holder):.0f} s, pid {pid} may be another process now"
            return None
        if job is not None and holder.get("job") == job and \
                (restart is None or holder.get("restart") is None or restart != holder.get("restart")):
            return f"its job {job} was requeued"
        if expired:
            return f"not renewed for {self._age(holder):.0f} s"
        return None

    def _age(self, holder: dict) -> float:
        """Seconds since ``holder`` last renewed its lease (a lock that records no renewal: its file's age)."""
        renewed = holder.get("renewed")
        if not isinstance(renewed, (int, float)):
            try:
                renewed = self.path.stat().st_mtime
            except OSError:
                return 0.0
        return time.time() - renewed

    def _hold_break(self, wait_s: float = 1.0) -> bool:
        """Take ``.break`` (waiting up to ``wait_s``); a ``.break`` left by a run that died while holding it goes."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._create(self.break_path, {"pid": os.getpid()}):
                return True
            with contextlib.suppress(FileNotFoundError):
                if time.time() - self.break_path.stat().st_mtime > self.BREAK_STALE_S:
                    self.break_path.unlink()
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _break(self, stale: dict) -> bool:
        """Remove the lease if it still is ``stale``, holding ``.break`` meanwhile; True when this run removed it."""
        if not self._hold_break(wait_s=0.0):
            return False
        try:
            if self._read(self.path) == stale:  # nobody else removes or renews a lease meanwhile
                self.path.unlink()
                return True
            return False
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

    def _describe(self, holder: dict | None) -> str:
        if holder is None:
            return "unknown holder"
        parts = [f"host {holder['host']}", f"pid {holder['pid']}"]
        if holder.get("job"):
            parts.append(f"job {holder['job']}" + (f" restart {holder['restart']}" if holder.get("restart") else ""))
        if holder.get("started"):
            parts.append(f"started {holder['started']}")
        return ", ".join(parts)

    def _held_message(self, holder: dict) -> str:
        pid = int(holder["pid"])
        timeout = float(holder.get("timeout_s") or self.timeout_s)
        where = self._describe(holder) + f", lease renewed {self._age(holder):.0f} s ago"
        if holder["host"] != socket.gethostname():
            how = (f"its lease is taken over when not renewed for {timeout:g} s, or at once by a requeue of its job "
                   f"(the same SLURM_JOB_ID or TORCHELASTIC_RUN_ID); to start another run, choose another output_dir")
        elif pid == os.getpid():
            how = "an earlier run in this same process has not finished; to start another run, choose another output_dir"
        else:
            how = (f"wait for it to finish, or stop it with `kill -TERM {pid}` (it saves a checkpoint) and "
                   f"run again to resume; to start another run, choose another output_dir")
        return f"output_dir {self.path.parent} is in use by another training run ({where}): {how}"


class RunClaim:
    """This run's hold on its output_dir: the lease (renewed until released), and what to remove if a fresh run
    fails.

    ``release(failed=True)`` of a run that found no folder (or an empty one) and saved no
    checkpoint removes what it wrote, leaving the folder as it was found; otherwise only the lock goes.
    """

    def __init__(self, run: RunDir):
        self.run = run
        self.existed = run.root.exists()
        self.fresh = not self.existed or (run.root.is_dir() and not any(run.root.iterdir()))
        run.root.mkdir(parents=True, exist_ok=True)
        self.lease = RunLease(run.lock)
        self.lease.acquire()  # when refused, the folder and everything in it belong to the holder
        self.lease.start_renewing()

    def release(self, *, failed: bool) -> None:
        # a lease taken over by another run: the folder is that run's now
        if failed and self.fresh and not self.lease.lost.is_set() and not self.run.list_checkpoints():
            if not self.existed:
                shutil.rmtree(self.run.root, ignore_errors=True)
                return
            for path in self.run.root.iterdir():
                if path != self.run.lock:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self.lease.release()
