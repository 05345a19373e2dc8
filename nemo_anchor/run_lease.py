"""One run writes into an output_dir at a time: the lease (:class:`RunLease`), a run's hold on its folder
(:class:`RunClaim`), and the guard every front door asks before it changes the folder (:class:`RunGuard`).

A second run is refused while the first holds the lease; a requeued Slurm job, or a run after a dead one, takes
it over; a fresh run that fails before its first checkpoint removes the folder it made. Every act that changes
the folder (publishing a checkpoint, ``latest``, eviction, removing leftovers, a failed fresh run's clean-up) is
fenced: the holder reads the lease file first (:meth:`RunClaim.fence`) and a run that no longer holds it, or
cannot read it, changes nothing and says so.
"""
from __future__ import annotations

import contextlib
import enum
import json
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nemo_anchor.atomic import process_alive, process_start_time
from nemo_anchor.run_dir import RunDir


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


@dataclass(frozen=True)
class Job:
    """The scheduler job a process runs in (``name``: "slurm 41", "torchelastic r9", or None) and its restart count.

    Only Slurm's ``SLURM_JOB_ID`` names a job the scheduler gave: it is kept when a job is requeued, and
    ``SLURM_RESTART_COUNT`` (set from the first requeue on) counts up. torchrun's ``TORCHELASTIC_RUN_ID`` is the
    ``--rdzv-id`` a user chooses (two launches may reuse it): recorded for people, never a reason to take a lease.
    """

    name: str | None
    restart: int | None

    @classmethod
    def of_this_process(cls) -> "Job":
        for job_var, restart_var, scheduler in (("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "slurm"),
                                                ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "torchelastic")):
            job = os.environ.get(job_var, "").strip()
            if job and job != "none":  # "none": torchrun's default --rdzv-id names no job
                restart = os.environ.get(restart_var, "").strip()
                return cls(f"{scheduler} {job}", int(restart) if restart.isdigit() else None)
        return cls(None, None)

    def requeue_of(self, holder: dict) -> bool:
        """Whether this is a later incarnation of ``holder``'s Slurm job: the same job id and a strictly higher
        restart count (a holder without one counts as restart 0)."""
        return (self.name is not None and self.name.startswith("slurm ") and holder["job"] == self.name
                and self.restart is not None and self.restart > (holder["restart"] or 0))


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _number(value) -> float | None:
    """``value`` as a finite number, or None (JSON's true/false are no numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        return None
    return float(value)


class Verdict(enum.Enum):
    """What a run may do with a lease another run holds."""

    TAKE = "take"  # its holder is gone, or was requeued: take it over now
    REFUSE = "refuse"  # a live process of this host
    WATCH = "watch"  # only its renewals can tell: watched for its timeout


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    why: str = ""


@dataclass(frozen=True)
class Snapshot:
    """A lease file as read once: its bytes and identity (inode, modification time, size)."""

    raw: bytes
    identity: tuple


@dataclass(frozen=True)
class Watch:
    """A lease being watched for renewals: as first seen, its writer, since when (this host's monotonic clock)."""

    seen: Snapshot
    writer: tuple | None
    since: float
    timeout: float
    why: str


class RunLease:
    """One writer per run directory: a lease file naming the holder, renewed while the holder runs.

    The holder is named by its host, pid and the pid's start time (:func:`~nemo_anchor.atomic.process_start_time`),
    and by its scheduler job (:class:`Job`). Rank 0 renews the lease every ``renew_s``
    (``NEMO_ANCHOR_LEASE_RENEW_S``, 30 s) in a daemon thread (:meth:`start_renewing`); each renewal
    counts up ``renewals``. Another run takes it over

    - at once when the holder was a process of this host that is gone: no process with its pid, or
      one that started at another time (the pid was reused, or a container restarted under the
      same hostname gave this run the holder's pid);
    - at once when this run is a requeue of the holder's Slurm job (:meth:`Job.requeue_of`: the same
      ``SLURM_JOB_ID``, a strictly higher ``SLURM_RESTART_COUNT``); two steps of one job with the same
      count, a lower one, or torchrun's user-chosen ``TORCHELASTIC_RUN_ID`` are judged by their renewals;
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
    runs finding a stale lease at once one removes it and one takes it. A ``.break`` left by a run that
    died holding it is removed once unchanged for the lease's timeout, never sooner, so a renewer paused
    inside it cannot have it taken from under it before its lease could be. A renewal only rewrites the
    holder's own lease, and never one left unrenewed for as long as another host could judge it stale: one
    that is gone or another run's means the lease was lost (:attr:`lost`). :meth:`check` reads the lease
    file now: a writer asks before each write, and an unreadable lease is not held.

    As a context manager (rank 0 only)::

        with RunLease(Path(log_dir) / LOCK_FILE) as lease:  # acquire, renew in the background
            train()                                          # RunDirInUse raised on entry when held
            if not lease.held(): stop()                      # before each save
    """

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
        self._lost_why = ""
        self._token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._renewing = False  # renewals were started: a lease unrenewed for long is no longer trusted
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
        job = Job.of_this_process()
        record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": process_start_time(os.getpid()),
                  "job": job.name, "restart": job.restart, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "renewed": time.time(), "renewals": 0, "renew_s": self.renew_s, "timeout_s": self.timeout_s,
                  "token": self._token}
        deadline = time.monotonic() + wait_s
        watch: Watch | None = None
        while True:
            record["renewed"] = time.time()
            if self._create(self.path, record):
                self.record, self._renewed_at = record, time.monotonic()
                return
            seen = self._snapshot()
            if seen is None:  # removed meanwhile (or unreadable): try again
                watch = None
            else:
                holder, problems = self._parse(seen.raw)
                judgement = self._judge(holder, job)
                if judgement.verdict is Verdict.REFUSE:
                    raise RunDirInUse(self._held_message(holder))
                if judgement.verdict is Verdict.TAKE:
                    if self._break(seen):
                        self.took_over = f"{self._describe(holder)}: {judgement.why}"
                        watch = None
                else:
                    watch = self._watched(watch, seen, holder, problems, judgement.why)
                    deadline = time.monotonic() + wait_s
            if time.monotonic() >= deadline:
                raise RunDirInUse(f"output_dir {self.path.parent}: could not take {self.path} within {wait_s:g} s; "
                                  f"if no training run writes into this folder, remove {self.path}")
            time.sleep(min(1.0, max(0.02, (watch.timeout if watch else 1.0) / 50)))

    def _judge(self, holder: dict | None, job: Job) -> Judgement:
        if holder is None or holder["host"] is None or holder["pid"] is None:
            return Judgement(Verdict.WATCH, "its record is malformed")
        pid, pid_started = holder["pid"], holder["pid_started"]
        if holder["host"] == socket.gethostname():
            if pid == os.getpid() and pid_started is None:  # a lease naming this very process has its start
                return Judgement(Verdict.TAKE, "its pid is this run's own (it is gone)")
            if not process_alive(pid, pid_started):
                gone = pid_started is None or not process_alive(pid)
                return Judgement(Verdict.TAKE, "its process is gone" if gone else f"pid {pid} is another process now")
            if pid_started is None:  # a lock from before start times were recorded: the pid may be anyone's now
                return Judgement(Verdict.WATCH, f"it records no start time for pid {pid}, which may be another "
                                                f"process now")
            return Judgement(Verdict.REFUSE)
        if job.requeue_of(holder):
            return Judgement(Verdict.TAKE, f"its job {job.name} was requeued (restart {holder['restart'] or 0} -> "
                                           f"{job.restart})")
        if job.name is not None and holder["job"] == job.name:
            how = "its restart count is not lower" if job.name.startswith("slurm ") else "a user-chosen rendezvous id"
            return Judgement(Verdict.WATCH, f"the same job {job.name} ({how}): another live run of it, or a dead one")
        return Judgement(Verdict.WATCH, "a process of another host")

    def _watched(self, watch: Watch | None, seen: Snapshot, holder: dict | None, problems: list[str],
                 why: str) -> Watch | None:
        """The watch on a lease judged by its renewals, one look later: refused when its writer renewed it, taken
        over (None) when it stayed unchanged for its timeout."""
        writer = self._writer(holder)
        if watch is None or watch.writer != writer:
            timeout = _number((holder or {}).get("timeout_s")) or self.timeout_s
            for problem in problems:
                _warn(problem)
            _warn(f"{self.path} is held by {self._describe(holder)} ({why}): watching whether it is renewed "
                  f"within {timeout:g} s, its lease timeout, before taking it over")
            return Watch(seen, writer, time.monotonic(), timeout, why)
        if seen != watch.seen:
            if writer is not None:  # the same holder wrote it again: it is alive
                raise RunDirInUse(self._held_message(holder, renewed_while_watched=True))
            return None  # no holder to tell apart (an unreadable lease being written): judge it afresh
        waited = time.monotonic() - watch.since
        if waited >= watch.timeout and self._break(seen):
            self.took_over = f"{self._describe(holder)}: {watch.why}; not renewed while this run watched it for " \
                             f"{waited:.3g} s"
            return None
        return watch

    # ---------------------------------------------------------------- keeping it
    def start_renewing(self) -> None:
        """Renew the lease every ``renew_s`` in a daemon thread until :meth:`release`."""
        self._stop.clear()
        self._renewing = True
        self._renewer = threading.Thread(target=self._renew_loop, name="nemo-anchor-lease", daemon=True)
        self._renewer.start()

    def check(self) -> str | None:
        """None while this run holds its lease, read from the file now; otherwise why not. A writer asks before each
        write, so a takeover is seen before the next one, not at the next renewal. A lease that cannot be read is
        not held for that write (the renewals give it up when that lasts); one this run left unrenewed for as long
        as another host could judge it stale (a process paused, a file system stalled) is lost."""
        if self.record is None:
            return "it holds no lease"
        if self.lost.is_set():
            return self._lost_why
        unrenewed = time.monotonic() - self._renewed_at
        if self._renewing and unrenewed + self.renew_s >= self.timeout_s:
            return self._lose(f"not renewed for {unrenewed:.0f} s: another run may judge it stale")
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return self._lose(f"{self.path} was removed")
        except OSError as err:
            return f"{self.path} cannot be read: {err}"
        current, _ = self._parse(raw)
        if current is not None and current["token"] == self.record["token"]:
            return None
        return self._lose(f"taken over by {self._describe(current)}")

    def held(self) -> bool:
        """Whether this run holds its lease now (:meth:`check`)."""
        return self.check() is None

    def renew(self) -> bool:
        """Write the lease again; False when it is no longer this one's (removed, taken over, or left unrenewed for
        too long: :attr:`lost` is set). A lease is never written again once gone. OSError when the file system does
        not answer."""
        if self.record is None or self.lost.is_set():
            return False
        if not self._hold_break():
            return True  # another run judges the lease right now: it finds it fresh, or it was not ours
        try:
            why_not = self.check()
            if self.lost.is_set():
                return False
            if why_not is not None:  # unreadable: the renewal loop counts the failure
                raise OSError(why_not)
            record = {**self.record, "renewed": time.time(), "renewals": self.record.get("renewals", 0) + 1}
            staging = self.path.with_name(f"{self.path.name}.{self.record['token']}.tmp")
            staging.write_text(json.dumps(record))
            os.replace(staging, self.path)
            self.record, self._renewed_at = record, time.monotonic()
            return True
        finally:
            self._drop_break()

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

    def _lose(self, why: str) -> str:
        if not self.lost.is_set():
            self._lost_why = why
            self.lost.set()
            _warn(f"this run no longer holds {self.path} ({why}); it writes nothing more into {self.path.parent}")
        return self._lost_why

    # ---------------------------------------------------------------- the .break lock
    def _hold_break(self, wait_s: float = 1.0) -> bool:
        """Take ``.break`` (waiting up to ``wait_s``). A ``.break`` that stays unchanged, by this host's monotonic
        clock over this and earlier calls, for the lease's timeout (this run's or the lease's, the longer) was left
        by a run that died holding it: it goes."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._create(self.break_path, {"host": socket.gethostname(), "pid": os.getpid(), "token": self._token}):
                self._break_seen = None
                return True
            seen = self._identity(self.break_path)
            if seen is not None:
                if self._break_seen is None or self._break_seen[0] != seen:
                    self._break_seen = (seen, time.monotonic())
                elif time.monotonic() - self._break_seen[1] >= self._break_stale_s():
                    if self._identity(self.break_path) == seen:
                        self.break_path.unlink(missing_ok=True)
                    self._break_seen = None
                    continue
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _break_stale_s(self) -> float:
        seen = self._snapshot()
        holder = self._parse(seen.raw)[0] if seen is not None else None
        return max(self.timeout_s, _number((holder or {}).get("timeout_s")) or 0.0)

    def _drop_break(self) -> None:
        """Remove ``.break`` if it is still this run's (a stale one may have been broken and taken meanwhile)."""
        with contextlib.suppress(OSError, ValueError):
            if json.loads(self.break_path.read_bytes()).get("token") == self._token:
                self.break_path.unlink(missing_ok=True)

    def _break(self, stale: Snapshot) -> bool:
        """Remove the lease if it still is ``stale``, holding ``.break`` meanwhile; True when this run removed it."""
        if not self._hold_break(wait_s=0.0):
            return False
        try:
            seen = self._snapshot()
            if seen is not None and seen.raw == stale.raw:  # nobody else removes or renews a lease meanwhile
                self.path.unlink()
                return True
            return False
        finally:
            self._drop_break()

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

    def _snapshot(self) -> Snapshot | None:
        """The lease file as read now, or None when there is none."""
        identity = self._identity(self.path)
        return None if identity is None else Snapshot(identity[3], identity[:3])

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
    def _writer(holder: dict | None) -> tuple | None:
        """Who wrote a lease (host, pid, token): the same writer again is a renewal."""
        return None if holder is None else (holder["host"], holder["pid"], holder["token"])

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
            how = (f"its lease is taken over when not renewed for {timeout:g} s, or at once by a requeue of its Slurm "
                   f"job (the same SLURM_JOB_ID with a higher SLURM_RESTART_COUNT); to start another run, choose "
                   f"another output_dir")
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
    """This run's hold on its output_dir (rank 0): the lease, renewed until released, the fence before each change
    of the folder, and what to remove if a fresh run fails.

    Taking a lease over is said in one line (``took over the lease of ...``), whichever front door takes it.
    ``release(failed=True)`` of a run that found no folder (or an empty one), saved no checkpoint and still holds
    the lease (read from the file) removes what it wrote, leaving the folder as it was found; otherwise only the
    lock goes.
    """

    def __init__(self, run: RunDir):
        self.run = run
        self.lease = RunLease(run.lock)  # a bad NEMO_ANCHOR_LEASE_* setting is refused before anything is made
        self.existed = run.root.exists()
        self.fresh = not self.existed or (run.root.is_dir() and not any(run.root.iterdir()))
        run.root.mkdir(parents=True, exist_ok=True)
        self.lease.acquire()  # when refused, the folder and everything in it belong to the holder
        self.lease.start_renewing()
        if self.lease.took_over:
            print(f"took over the lease of {self.lease.took_over}", flush=True)

    def fence(self, act: str) -> bool:
        """Whether this run may ``act`` on its folder now ("publish iter_0000010", "evict iter_0000002"...): reads
        the lease file; when this run does not hold it, says so in one line and returns False."""
        why_not = self.lease.check()
        if why_not is None:
            return True
        _warn(f"output_dir {self.run.root}: this run does not {act}: it does not hold its lease ({why_not})")
        return False

    def release(self, *, failed: bool) -> None:
        self.lease.stop_renewing()  # no renewal into a folder being removed
        if failed and self.fresh and not self.run.list_checkpoints() and self.fence("remove the folder it made"):
            if not self.existed:
                shutil.rmtree(self.run.root, ignore_errors=True)
                return
            for path in self.run.root.iterdir():
                if path != self.run.lock:
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        self.lease.release()


class RunGuard:
    """Every rank's side of a run's hold on its folder, the same for ``nemo-anchor train``, NeMo and Bridge: rank 0
    holds the :class:`RunClaim` (the other ranks pass None); before each save every rank learns whether rank 0 lost
    the lease (:meth:`stop_if_lost`), and rank 0 fences each change of the folder (:meth:`fence`)."""

    def __init__(self, claim: RunClaim | None, root: str | os.PathLike):
        self.claim, self.root = claim, Path(root)

    def fence(self, act: str) -> bool:
        """:meth:`RunClaim.fence` on the lease holder; True elsewhere (the other ranks change nothing in the folder)."""
        return self.claim is None or self.claim.fence(act)

    def fence_everywhere(self, act: str, device) -> bool:
        """:meth:`fence` decided on the lease holder and agreed by every rank (one all-reduce on ``device``): for an
        act all ranks take together (a distributed save), which no rank may start when the holder may not."""
        import torch
        import torch.distributed as dist

        allowed = self.fence(act)
        if dist.is_initialized():
            flag = torch.tensor([int(allowed)], device=device, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            allowed = bool(flag.item())
        return allowed

    def lost_here(self) -> bool:
        """Whether this rank held the lease and lost it (read from the file now; an unreadable one is not lost
        yet: its fence refuses each write, and the renewals give it up when that lasts)."""
        return self.claim is not None and self.claim.lease.check() is not None and self.claim.lease.lost.is_set()

    def lost_message(self, step: int) -> str:
        return (f"output_dir {self.root}: another run took this run's lease over; this run stops at step {step} "
                f"without saving")

    def stop_if_lost(self, device, step: int) -> None:
        """RunDirInUse on every rank when rank 0 lost the lease (one all-reduce on ``device``): a front door calls it
        before each save."""
        import torch
        import torch.distributed as dist

        lost = self.lost_here()
        if dist.is_initialized():
            flag = torch.tensor([int(lost)], device=device, dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            lost = bool(flag.item())
        if lost:
            raise RunDirInUse(self.lost_message(step))

    def release(self, *, failed: bool) -> None:
        if self.claim is not None:
            self.claim.release(failed=failed)
            self.claim = None
