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
    restarts; Slurm sets it from the first requeue on); otherwise torchrun's ``TORCHELASTIC_RUN_ID``
    (``--rdzv-id``; "none", torchrun's default, names no job) and ``TORCHELASTIC_RESTART_COUNT``.
    """
    for job_var, restart_var, scheduler in (("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "slurm"),
                                            ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "torchelastic")):
        job = os.environ.get(job_var, "").strip()
        if job and job != "none":
            restart = os.environ.get(restart_var, "").strip()
            return f"{scheduler} {job}", int(restart) if restart.isdigit() else None
    return None, None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _number(value) -> float | None:
    """``value`` as a finite number, or None (JSON's true/false are no numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        return None
    return float(value)


class RunLease:
    """One writer per run directory: a lease file naming the holder, renewed while the holder runs.

    The holder is named by its host, pid and the pid's start time (:func:`~nemo_anchor.atomic.process_start_time`),
    and by its scheduler job (:func:`scheduler_job`). Rank 0 renews the lease every ``renew_s``
    (``NEMO_ANCHOR_LEASE_RENEW_S``, 30 s) in a daemon thread (:meth:`start_renewing`); each renewal
    counts up ``renewals``. Another run takes it over

    - at once when the holder was a process of this host that is gone: no process with its pid, or
      one that started at another time (the pid was reused, or a container restarted under the
      same hostname gave this run the holder's pid);
    - at once when the holder ran in this run's scheduler job and the job was restarted since: both
      runs have a restart count and they differ (Slurm sets ``SLURM_RESTART_COUNT`` from the first
      requeue on, so a holder without one counts as restart 0 of a job this run has a count for);
      two steps of one job with the same count, or none, are two live runs, not a requeue;
    - from any host, when this run watched the lease for ``timeout_s`` (``NEMO_ANCHOR_LEASE_TIMEOUT_S``,
      300 s; the holder's own setting counts) by its own monotonic clock and it did not change. No
      decision compares two hosts' clocks: a live holder renews within ``renew_s`` and is refused
      then; the ``renewed`` time it records is for people.

    Otherwise the run is refused naming the holder's host, pid and job. A live process of this host
    is never taken over, whatever its lease says. A malformed field of a lease (a pid that is no
    number, a renewal ahead of this host's clock) is named in one line and the lease is judged by
    whether it changes.

    The lease is taken with an exclusive create (``O_CREAT | O_EXCL``), so of two runs starting at
    once exactly one gets it. Only the holder of the companion ``.break`` file (also an exclusive
    create) removes or rewrites a lease, after checking it is still the one it judged: of several
    runs finding a stale lease at once one removes it and one takes it. A renewal only rewrites the
    holder's own lease: one that is gone or another run's means the lease was lost (:attr:`lost`),
    and so does a renewal that fails for longer than the lease could be judged stale elsewhere.
    :meth:`held` reads the lease file now: a writer calls it before each write.

    As a context manager (for a Lightning callback or a Bridge hook, rank 0 only)::

        with RunLease(Path(log_dir) / LOCK_FILE) as lease:  # acquire, renew in the background
            train()                                          # RunDirInUse raised on entry when held
            if not lease.held(): stop()                      # before each save
    """

    BREAK_STALE_S = 5.0  # a .break unchanged this long (by this host's clock) was left by a run that died breaking

    def __init__(self, path: str | os.PathLike, renew_s: float | None = None, timeout_s: float | None = None):
        self.path = Path(path)
        self.break_path = self.path.with_name(self.path.name + ".break")
        if renew_s is None or timeout_s is None:
            from_env = lease_timing()
            renew_s, timeout_s = renew_s or from_env[0], timeout_s or from_env[1]
        self.renew_s, self.timeout_s = renew_s, timeout_s
        self.record: dict | None = None
        self.took_over: str | None = None  # why the previous holder's lease was taken over, if it was
        self.lost = threading.Event()  # set when this run no longer holds its lease (it stopped renewing)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._renewed_at = time.monotonic()  # this host's clock at the last renewal that was written
        self._break_seen: tuple[tuple, float] | None = None  # a .break another run holds, and since when

    def __enter__(self) -> "RunLease":
        self.acquire()
        self.start_renewing()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ---------------------------------------------------------------- taking the lease
    def acquire(self, wait_s: float = 10.0) -> None:
        """Take the lease or raise :class:`RunDirInUse`. A holder that can be judged only by its renewals is
        watched (one line says so) for up to its timeout: refused as soon as it renews, taken over if it does not."""
        job, restart = scheduler_job()
        record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": process_start_time(os.getpid()),
                  "job": job, "restart": restart, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "renewed": time.time(), "renewals": 0, "renew_s": self.renew_s, "timeout_s": self.timeout_s,
                  "token": secrets.token_hex(8)}
        deadline = time.monotonic() + wait_s
        watched = None  # (the lease's bytes and file identity, the holder's key, when first seen, its timeout)
        while True:
            record["renewed"] = time.time()
            if self._create(self.path, record):
                self.record, self._renewed_at = record, time.monotonic()
                return
            seen = self._snapshot()
            holder, problems = self._parse(seen[0]) if seen is not None else (None, [])
            verdict, why = self._judge(holder, job, restart) if seen is not None else ("gone", "")
            if verdict == "gone":  # removed meanwhile (or unreadable): try again
                watched = None
            elif verdict == "refuse":
                raise RunDirInUse(self._held_message(holder))
            elif verdict == "take":
                if self._break(seen[0]):
                    self.took_over = f"{self._describe(holder)}: {why}"
                    watched = None
            else:  # judged by its renewals, watched with this host's monotonic clock
                key = self._key(holder)
                if watched is None or watched[1] != key:
                    timeout = _number((holder or {}).get("timeout_s")) or self.timeout_s
                    watched = (seen, key, time.monotonic(), timeout, why)
                    for problem in problems:
                        _warn(problem)
                    _warn(f"{self.path} is held by {self._describe(holder)} ({why}): watching whether it is renewed "
                          f"within {timeout:g} s, its lease timeout, before taking it over")
                elif seen != watched[0]:
                    if key is not None:  # the same holder wrote it again: it is alive
                        raise RunDirInUse(self._held_message(holder, renewed_while_watched=True))
                    watched = None  # no holder to tell apart (an unreadable lease being written): judge it afresh
                elif time.monotonic() - watched[2] >= watched[3]:
                    waited = time.monotonic() - watched[2]
                    if self._break(seen[0]):
                        self.took_over = f"{self._describe(holder)}: {watched[4]}; not renewed while this run " \
                                         f"watched it for {waited:.3g} s"
                        watched = None
                deadline = time.monotonic() + wait_s
            if time.monotonic() >= deadline:
                raise RunDirInUse(f"output_dir {self.path.parent}: could not take {self.path} within {wait_s:g} s; "
                                  f"if no training run writes into this folder, remove {self.path}")
            time.sleep(min(1.0, max(0.02, (watched[3] if watched else 1.0) / 50)))

    def _judge(self, holder: dict | None, job: str | None, restart: int | None) -> tuple[str, str]:
        """("take", why) when ``holder``'s lease may be taken over now, ("refuse", "") when it may not, or
        ("watch", why) when only its renewals can tell."""
        if holder is None or holder["host"] is None or holder["pid"] is None:
            return "watch", "its record is malformed"
        pid, pid_started = holder["pid"], holder["pid_started"]
        if holder["host"] == socket.gethostname():
            if pid == os.getpid() and pid_started is None:
                return "take", "its pid is this run's own (it is gone)"  # a lease naming this very process has its start
            if not process_alive(pid, pid_started):
                gone = pid_started is None or not process_alive(pid)
                return "take", "its process is gone" if gone else f"pid {pid} is another process now"
            if pid_started is None:  # a lock from before start times were recorded: the pid may be anyone's now
                return "watch", f"it records no start time for pid {pid}, which may be another process now"
            return "refuse", ""
        if job is not None and holder["job"] == job and restart is not None and restart != (holder["restart"] or 0):
            return "take", f"its job {job} was requeued (restart {holder['restart'] or 0} -> {restart})"
        if job is not None and holder["job"] == job:
            return "watch", f"the same job {job} with the same restart count: another live step of it, or a dead one"
        return "watch", "a process of another host"

    # ---------------------------------------------------------------- keeping it
    def start_renewing(self) -> None:
        """Renew the lease every ``renew_s`` in a daemon thread until :meth:`release`."""
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_loop, name="nemo-anchor-lease", daemon=True)
        self._renewer.start()

    def held(self) -> bool:
        """Whether this run still holds its lease, read from the file now: a writer asks before each write, so a
        takeover is seen before the next one, not at the next renewal. A file system that does not answer leaves
        the answer to the renewals."""
        if self.lost.is_set() or self.record is None:
            return False
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._lose(f"{self.path} was removed")
            return False
        except OSError:
            return True
        return self._still_mine(raw)

    def renew(self) -> bool:
        """Write the lease again; False when it is no longer this one's (removed, or taken over: :attr:`lost` is set).
        A lease is never written again once gone. OSError when the file system does not answer."""
        if self.record is None or self.lost.is_set():
            return False
        if not self._hold_break():
            return True  # another run judges the lease right now: it finds it fresh, or it was not ours
        try:
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                self._lose(f"{self.path} was removed")
                return False
            if not self._still_mine(raw):
                return False
            record = {**self.record, "renewed": time.time(), "renewals": self.record.get("renewals", 0) + 1}
            staging = self.path.with_name(f"{self.path.name}.{self.record['token']}.tmp")
            staging.write_text(json.dumps(record))
            os.replace(staging, self.path)
            self.record, self._renewed_at = record, time.monotonic()
            return True
        finally:
            self.break_path.unlink(missing_ok=True)

    def stop_renewing(self) -> None:
        """Stop the renewal thread; the lease stays until :meth:`release`."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None

    def release(self) -> None:
        """Stop renewing; remove the lease if it is still this one's."""
        self.stop_renewing()
        if self.record is not None:
            with contextlib.suppress(OSError):
                current, _ = self._parse(self.path.read_bytes())
                if not self.lost.is_set() and current is not None and current["token"] == self.record["token"]:
                    self.path.unlink(missing_ok=True)
        self.record = None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                if not self.renew():
                    return
            except OSError as err:
                # another host may take the lease over once it saw it unchanged for timeout_s: give it up first
                unrenewed = time.monotonic() - self._renewed_at
                if unrenewed + self.renew_s >= self.timeout_s:
                    self._lose(f"it could not be renewed for {unrenewed:.0f} s ({err})")
                    return
                _warn(f"could not renew {self.path}: {err}; trying again in {self.renew_s:g} s")
            except Exception as err:  # noqa: BLE001 - whatever stops the renewals loses the lease, said once
                self._lose(f"renewing it failed: {type(err).__name__}: {err}")
                return

    def _still_mine(self, raw: bytes) -> bool:
        current, _ = self._parse(raw)
        if current is not None and current["token"] == self.record["token"]:
            return True
        self._lose(f"taken over by {self._describe(current)}")
        return False

    def _lose(self, why: str) -> None:
        if not self.lost.is_set():
            self.lost.set()
            _warn(f"this run no longer holds {self.path} ({why}); it writes nothing more into {self.path.parent}")

    # ---------------------------------------------------------------- the .break lock
    def _hold_break(self, wait_s: float = 1.0) -> bool:
        """Take ``.break`` (waiting up to ``wait_s``). A ``.break`` that stays unchanged for ``BREAK_STALE_S`` by this
        host's monotonic clock (over this and earlier calls) was left by a run that died holding it: it goes."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._create(self.break_path, {"host": socket.gethostname(), "pid": os.getpid()}):
                self._break_seen = None
                return True
            seen = self._identity(self.break_path)
            if seen is not None:
                if self._break_seen is None or self._break_seen[0] != seen:
                    self._break_seen = (seen, time.monotonic())
                elif time.monotonic() - self._break_seen[1] > self.BREAK_STALE_S:
                    if self._identity(self.break_path) == seen:
                        self.break_path.unlink(missing_ok=True)
                    self._break_seen = None
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _break(self, stale: bytes) -> bool:
        """Remove the lease if it still is ``stale``, holding ``.break`` meanwhile; True when this run removed it."""
        if not self._hold_break(wait_s=0.0):
            return False
        try:
            seen = self._snapshot()
            if seen is not None and seen[0] == stale:  # nobody else removes or renews a lease meanwhile
                self.path.unlink()
                return True
            return False
        finally:
            self.break_path.unlink(missing_ok=True)

    # ---------------------------------------------------------------- reading lease files (untrusted input)
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
    def _identity(path: Path) -> tuple | None:
        try:
            stat = path.stat()
            return stat.st_ino, stat.st_mtime_ns, stat.st_size, path.read_bytes()
        except OSError:
            return None

    def _snapshot(self) -> tuple[bytes, tuple] | None:
        """The lease file's bytes and identity (inode, modification time, size), or None when there is none."""
        identity = self._identity(self.path)
        return None if identity is None else (identity[3], identity[:3])

    def _parse(self, raw: bytes) -> tuple[dict | None, list[str]]:
        """(the lease's fields, each malformed one as None; None when it is no lease record at all), and one line for
        each problem, naming the file and the field."""
        try:
            record = json.loads(raw)
        except ValueError:
            return None, [f"{self.path} is not a lease record (not JSON{', empty' if not raw.strip() else ''})"]
        if not isinstance(record, dict):
            return None, [f"{self.path} is not a lease record (a JSON {type(record).__name__}, not an object)"]
        problems, fields = [], {}

        def field(name, valid, what):
            value = record.get(name)
            if value is None or valid(value):
                fields[name] = value
                return
            fields[name] = None
            problems.append(f"{self.path}: field {name} is {value!r}, not {what}")

        field("host", lambda v: isinstance(v, str) and v, "a host name")
        field("pid", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a process id")
        field("pid_started", lambda v: _number(v) is not None, "a start time")
        field("job", lambda v: isinstance(v, str), "a job name")
        field("restart", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a restart count")
        field("timeout_s", lambda v: (_number(v) or 0) > 0, "a positive number of seconds")
        field("renewed", lambda v: _number(v) is not None, "a time")
        field("token", lambda v: isinstance(v, str), "a token")
        field("started", lambda v: isinstance(v, str), "a time")
        for name in ("host", "pid"):
            if record.get(name) is None:
                problems.append(f"{self.path}: field {name} is missing")
        ahead = (fields["renewed"] or 0) - time.time()
        if ahead > self.renew_s:  # the holder's clock is ahead of this host's: nothing here relies on it
            problems.append(f"{self.path}: field renewed is {ahead:.0f} s ahead of this host's clock (clocks that "
                            f"disagree); the lease is judged by whether it changes, not by that time")
        return fields, problems

    @staticmethod
    def _key(holder: dict | None) -> tuple | None:
        """Who wrote a lease (host, pid, token): the same key written again is a renewal."""
        if holder is None:
            return None
        return holder["host"], holder["pid"], holder["token"]

    def _describe(self, holder: dict | None) -> str:
        if holder is None:
            return "an unreadable lease"
        parts = [f"host {holder['host'] or '?'}", f"pid {holder['pid'] or '?'}"]
        if holder["job"]:
            parts.append(f"job {holder['job']}" + (f" restart {holder['restart']}" if holder["restart"] else ""))
        if holder["started"]:
            parts.append(f"started {holder['started']}")
        return ", ".join(parts)

    def _held_message(self, holder: dict, renewed_while_watched: bool = False) -> str:
        pid = holder["pid"]
        timeout = _number(holder["timeout_s"]) or self.timeout_s
        where = self._describe(holder) + (", renewed while this run watched it" if renewed_while_watched else "")
        if holder["host"] != socket.gethostname():
            how = (f"its lease is taken over when not renewed for {timeout:g} s, or at once by a requeue of its job "
                   f"(the same SLURM_JOB_ID or TORCHELASTIC_RUN_ID with a new restart count); to start another run, "
                   f"choose another output_dir")
        elif pid == os.getpid():
            how = "an earlier run in this same process has not finished; to start another run, choose another output_dir"
        elif holder["pid_started"] is None:  # pid may be any process now (pid 1, say): never advise to signal it
            how = (f"its lock records no start time, so pid {pid} may be another process now; it is taken over when "
                   f"not renewed for {timeout:g} s; to start another run, choose another output_dir")
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
        self.lease = RunLease(run.lock)  # a bad NEMO_ANCHOR_LEASE_* setting is refused before anything is made
        self.existed = run.root.exists()
        self.fresh = not self.existed or (run.root.is_dir() and not any(run.root.iterdir()))
        run.root.mkdir(parents=True, exist_ok=True)
        self.lease.acquire()  # when refused, the folder and everything in it belong to the holder
        self.lease.start_renewing()

    def release(self, *, failed: bool) -> None:
        self.lease.stop_renewing()  # no renewal into a folder being removed
        # a lease taken over by another run: the folder is that run's now
        if failed and self.fresh and not self.lease.lost.is_set() and not self.run.list_checkpoints():
            if not self.existed:
                shutil.rmtree(self.run.root, ignore_errors=True)
                return
            for path in self.run.root.iterdir():
                if path != self.run.lock:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self.lease.release()


def lease_lost_on_any_rank(claim: RunClaim | None, device) -> bool:
    """Whether this run lost its lease, agreed by every rank (one all-reduce on ``device``): rank 0, which holds
    ``claim``, reads its lease file now; the other ranks pass None. A front door calls it before each save."""
    import torch
    import torch.distributed as dist

    lost = claim is not None and not claim.lease.held()
    if not dist.is_initialized():
        return lost
    flag = torch.tensor([int(lost)], device=device, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def lease_lost_message(root: str | os.PathLike, step: int) -> str:
    return (f"output_dir {root}: another run took this run's lease over; this run stops at step {step} "
            f"without saving")
