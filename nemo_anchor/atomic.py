"""Every output of every command is written here: staged beside its target, renamed into place when complete.

The rules, the same for ``pack``, ``export-hf``, ``import-hf``, ``probe`` and ``eval``:

- checked before anything is touched: an output that is, contains or lies inside one of the
  command's inputs is refused (naming both paths); so is an output whose parent is a file or
  cannot be written to, and an existing output unless ``--overwrite``;
- ``--overwrite`` replaces only a directory the same subcommand wrote and nobody changed since: each
  output directory holds :data:`MARKER`, naming the subcommand and listing every path written into
  it with each file's size and SHA-256. A directory without it, written by another subcommand
  (``export-hf --overwrite`` over a packed dataset), holding anything it does not list, or a file
  whose content differs from what was written (an edited ``config.json``), is refused (an empty
  directory counts as absent);
- the new output is built in a hidden staging directory next to the target and renamed into place,
  so a failure leaves the earlier output (or nothing) behind, never half of one; a full disk, an
  exceeded quota, a read-only file system or a folder without write permission is reported as one
  line naming the output and the cause (:func:`write_faults_named`);
- SIGTERM cleans up as SIGINT does (the staging directory is removed; exit status 143), and staging
  directories of runs that died without cleaning up (``kill -9``) are removed by the next run;
- outputs get the user's normal permissions (``0o777``/``0o666`` less the umask).

What processes on several hosts may write into one shared folder at once (the user cache, a run's
copy of its HF reference) goes through :func:`file_lock` (a POSIX record lock, which NFS and
Lustre carry between hosts) or :func:`copy_directory_once` (the first rename wins); temporary names
hold host, pid and a random token, so no two writers ever share one.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path
from typing import Iterable, Iterator

MARKER = ".nemo-anchor-output.json"
_TOOL = "nemo-anchor"
_STAGING = "nemo-anchor-staging"  # suffixes of this tool's hidden siblings of a target
_RETIRED = "nemo-anchor-retired"


class OutputError(ValueError):
    """An output that cannot be written (the message names the paths and why)."""


def check_output(target: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (), *,
                 overwrite: bool = False, command: str = "") -> Path:
    """Refuse an output that would lose data or cannot be written; returns its absolute path.

    Raises:
        OutputError: the output is, contains or lies inside an input; its parent is not a writable
            directory; it exists and ``overwrite`` is False; or ``overwrite`` would replace
            something subcommand ``command`` of this tool did not write.
    """
    check_not_an_input(target, inputs)
    target = Path(os.path.abspath(target))
    ancestor = next(path for path in (target.parent, *target.parent.parents) if path.exists())
    if not ancestor.is_dir():
        raise OutputError(f"cannot create output {target}: {ancestor} is a file, not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"cannot create output {target}: no permission to write in {ancestor}")
    if target.is_dir() and not any(target.iterdir()):
        return target
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise OutputError(f"output {target} already exists: remove it or pass --overwrite")
        _check_ours(target, command)
    return target


def check_not_an_input(target: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> None:
    """OutputError when ``target`` is, contains or lies inside one of ``inputs`` (None entries are skipped)."""
    target = Path(os.path.abspath(target))
    real = target.resolve()
    for item in inputs:
        if item is None or not Path(item).exists():
            continue
        source = Path(item).resolve()
        if real == source:
            raise OutputError(f"output {target} is the input {item}: choose another output path")
        if real in source.parents:
            raise OutputError(f"output {target} contains the input {item}: choose another output path")
        if source in real.parents:
            raise OutputError(f"output {target} lies inside the input {item}: choose another output path")


def written_by(directory: str | os.PathLike) -> str | None:
    """The subcommand whose output ``directory`` is (from its :data:`MARKER`), or None when it has none."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return str(marker.get("command")) if isinstance(marker, dict) else None


def _check_ours(target: Path, command: str) -> None:
    """OutputError unless ``target`` is a directory ``nemo-anchor COMMAND`` wrote, holding only what it wrote."""
    if not target.is_dir() or target.is_symlink():
        raise OutputError(f"--overwrite refused: {target} is not a directory written by {_TOOL}; remove it yourself")
    try:
        marker = json.loads((target / MARKER).read_text())
        written = marker["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise OutputError(f"--overwrite refused: {target} was not written by {_TOOL} (no readable {MARKER}); "
                          f"remove it yourself or choose another output path") from None
    if marker.get("command") != command:
        raise OutputError(f"--overwrite refused: {target} was written by `{_TOOL} {marker.get('command')}`, and "
                          f"`{_TOOL} {command} --overwrite` replaces only its own kind of output; remove it "
                          f"yourself or choose another output path")
    if not isinstance(written, dict):
        raise OutputError(f"--overwrite refused: {target / MARKER} records no sizes and digests (an older "
                          f"{_TOOL} wrote it), so changes since cannot be ruled out; remove it yourself or choose "
                          f"another output path")
    extra = sorted(set(_listing(target)) - set(written))
    if extra:
        raise OutputError(f"--overwrite refused: {target} holds {target / extra[0]}, which {_TOOL} did not write "
                          f"there ({len(extra)} such path(s)); remove it yourself or choose another output path")
    for relative, record in sorted(written.items()):
        path = target / relative
        if record is not None and path.is_file() and _content(path, record) != record:
            raise OutputError(f"--overwrite refused: {path} changed since `{_TOOL} {command}` wrote it (size or "
                              f"SHA-256 differs); remove it yourself or choose another output path")


def _listing(directory: Path) -> list[str]:
    """Every path under ``directory`` (files and folders), relative, without the marker."""
    found = []
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MARKER:
                found.append(relative)
    return sorted(found)


def _content(path: Path, expected: dict | None = None) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of a file (the digest is skipped when the size already
    differs from ``expected``'s)."""
    size = path.stat().st_size
    if expected is not None and expected.get("bytes") != size:
        return {"bytes": size}
    with open(path, "rb") as handle:
        return {"bytes": size, "sha256": hashlib.file_digest(handle, "sha256").hexdigest()}


def _inventory(directory: Path) -> dict[str, dict | None]:
    """:func:`_listing` with each file's :func:`_content` (None for a folder or a link)."""
    return {relative: _content(directory / relative) if (directory / relative).is_file()
            and not (directory / relative).is_symlink() else None for relative in _listing(directory)}


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, inputs: Iterable[str | os.PathLike | None] = (),
                     overwrite: bool = False, command: str = "") -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; it becomes ``target`` only if the block succeeds.

    ``target`` is checked first (:func:`check_output` with ``inputs``). On success :data:`MARKER`
    records ``command`` and what was written, and an earlier ``target`` is replaced; on any exception, SIGTERM
    included, the staging directory is removed and ``target`` is left as it was.
    """
    target = check_output(target, inputs, overwrite=overwrite, command=command)
    remove_stale_staging(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(target, _STAGING)
    with _sigterm_raises(), write_faults_named(target, staging):
        staging.mkdir()  # mode 0o777 less the umask, unlike mkdtemp's 0o700
        yield staging
        (staging / MARKER).write_text(json.dumps({"tool": _TOOL, "command": command,
                                                  "files": _inventory(staging)}, indent=1))
        _give_user_modes(staging)
        _replace(staging, target)


def _give_user_modes(directory: Path) -> None:
    """Modes ``open``/``mkdir`` would give (0o666/0o777 less the umask) to everything under ``directory``;
    libraries that write through private temporary files (safetensors, mkstemp) leave 0o600 behind."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o100
                os.chmod(path, (0o777 if executable else 0o666) & ~umask)


def _replace(staging: Path, target: Path) -> None:
    if not (target.exists() or target.is_symlink()):
        os.replace(staging, target)
        return
    retired = _sibling(target, _RETIRED)
    os.replace(target, retired)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(retired, target)  # the earlier output comes back
        raise
    if retired.is_dir() and not retired.is_symlink():
        shutil.rmtree(retired, ignore_errors=True)
    else:
        retired.unlink()


def _sibling(target: Path, kind: str) -> Path:
    """A hidden name next to ``target`` that says which host and process made it."""
    return target.parent / f".{target.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"


def remove_stale_staging(target: str | os.PathLike) -> list[Path]:
    """Remove the staging/retired siblings of ``target`` left by dead processes of this host; returns them."""
    target = Path(os.path.abspath(target))
    if not target.parent.is_dir():
        return []
    removed = []
    prefix, host = f".{target.name}.", socket.gethostname()
    for path in target.parent.iterdir():
        name = path.name
        if not name.startswith(prefix) or not name.endswith((_STAGING, _RETIRED)):
            continue
        parts = name[len(prefix):].rsplit(".", 3)  # host (may hold dots), pid, token, kind
        if len(parts) != 4 or parts[0] != host or not parts[1].isdigit() or process_alive(int(parts[1])):
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether process ``pid`` of this host exists (one we may not signal counts as alive); with ``started``
    (its :func:`process_start_time`), whether it is still that process and not a later one given the same pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if started is None:
        return True
    now = process_start_time(pid)
    # psutil derives the start time from the boot time, which the kernel reports to the second
    return now is not None and abs(now - started) < 1.0


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` of this host started (seconds since the epoch); None when there is none.

    With the pid it names one process for good: a pid is reused, a pid and its start time are not.
    """
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While staging, SIGTERM raises SystemExit(143) (as SIGINT raises KeyboardInterrupt), so cleanup runs.

    Only where SIGTERM still has its default action (the trainer installs its own) and in the main thread.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: let the cleanup finish
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike, *, durable: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary path beside ``target``; it replaces ``target`` only if the block succeeds.

    The file is created with mode ``0o666`` less the umask, as ``open(target, "w")`` would. ``durable``: the
    file's bytes and then the rename are flushed to the disk (:func:`fsync_file`, :func:`durable_replace`)
    before the block returns, so that a crash of the machine never leaves an empty or an older ``target``
    that was already reported written (what a checkpoint's ``latest`` and checksums need).
    """
    target = Path(target)
    tmp = _sibling(target, _STAGING)
    with write_faults_named(target, tmp):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        yield tmp
        if durable:
            fsync_file(tmp)
            durable_replace(tmp, target)
        else:
            os.replace(tmp, target)


# errno of an fsync the file system does not offer (some FUSE, SMB and object-store mounts refuse it on folders)
_NO_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR}


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's entries') bytes to the disk, where the file system supports it; an I/O
    error is raised (the bytes may be lost), an fsync the file system does not offer is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    except OSError as error:
        if error.errno in _NO_FSYNC or error.errno == errno.EACCES:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _NO_FSYNC:
            raise
    finally:
        os.close(fd)


def durable_replace(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """``os.replace(source, target)`` (a file or a folder), the rename flushed to the disk: the folder holding
    ``target`` (and ``source``'s, when another) is fsynced after it, where the file system supports it."""
    os.replace(source, target)
    folders = {Path(os.path.abspath(target)).parent, Path(os.path.abspath(source)).parent}
    for folder in folders:
        fsync_file(folder)


# errno of the faults a write can meet that are the disk's or the folder's, not the data's
_WRITE_FAULTS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                 errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                 errno.EPERM: "operation not permitted"}
_NEARLY_FULL = 1 << 20  # bytes: a write that failed without an errno on a file system this full ran out of space


@contextlib.contextmanager
def write_faults_named(target: str | os.PathLike, *partial: str | os.PathLike) -> Iterator[None]:
    """Writing ``target`` (through the ``partial`` staging paths): on any failure the partial output is
    removed, and one caused by the disk (full, over quota, read-only) or the folder's permissions is
    raised as an OutputError naming ``target`` and the cause, not a temporary file or a library's
    internals. Every atomic write of the project goes through here."""
    target = Path(os.path.abspath(target))
    try:
        yield
    except BaseException as error:
        fault = _write_fault(error, target)  # before the partial output, which fills the disk, is removed
        for path in map(Path, partial):
            with contextlib.suppress(OSError):  # a read-only file system refuses even to unlink what is absent
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if fault is None:
            raise
        raise OutputError(f"cannot write {target}: {fault}") from error


def _write_fault(error: BaseException, target: Path) -> str | None:
    """The disk or permission fault of a write next to ``target`` behind ``error``: an errno in its
    chain (on a path in ``target``'s folder when the error names one: reading an input is not
    writing), else, for a short write reported without an errno (torch's zip writer, numpy's
    ``tofile``), a file system with no space left."""
    if isinstance(error, (KeyboardInterrupt, SystemExit, ValueError)):  # interrupted, or refused with a message
        return None
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if getattr(cause, "errno", None) in _WRITE_FAULTS:
            name = getattr(cause, "filename", None)
            if name is None or Path(os.path.abspath(name)).is_relative_to(target.parent):
                return _WRITE_FAULTS[cause.errno]
            return None
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    existing = next(path for path in (target, *target.parents) if path.exists())
    stats = os.statvfs(existing)
    return "no space left on device" if stats.f_bavail * stats.f_frsize < _NEARLY_FULL else None



@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if absent, never removed) while the block runs.

    A POSIX record lock (``fcntl.lockf``): it excludes processes of every host that shares the
    folder over NFS (lockd / NFSv4) or Lustre (mounted with ``flock``), not only this host's, and is
    released by the kernel (or the server) when its holder dies.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def copy_directory_once(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """``target`` as a copy of the directory ``source``, unless it exists; returns ``target``.

    Safe with processes on several hosts doing the same into one shared folder: each copies into its
    own staging sibling, and renaming a directory onto an existing non-empty one fails, so the first
    rename wins and the others discard their copy. ``target`` is never seen half-written.
    """
    target = Path(os.path.abspath(target))
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(target, _STAGING)
    with write_faults_named(target, staging):
        shutil.copytree(source, staging)
        try:
            os.rename(staging, target)
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not target.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)  # another process published it first
    return target
