"""Checksums of written files, one owner for both kinds:

- a checkpoint's ``checksums.json``: ``{file: [bytes, "xxh3-128:HEX"]}``, and ``recorded``, how (:data:`RECORDED`).
  Each shard's digest is computed from the bytes as Megatron's writer writes them (its ``open`` wrapped:
  :func:`nemo_anchor.training.checkpoint_saver.digested_writes`), never read back, so that a stop's checkpoint,
  which has no time to read 100 GB back, is protected from its save on: damage on the disk before the next start
  (a flipped byte, the size unchanged) is caught by the next read. The few small files written in the main
  process (``.metadata``, ``common.pt``, ``metadata.json``, ``config.yaml``: kilobytes) are digested right after
  they are written, from the page cache. Hashing the file bytes, not the tensors, keeps the check layout-free: a
  checkpoint is verified file by file without a model or the layout it was saved in, as before. Checkpoints of
  earlier versions record ``[bytes, CRC-32]`` (zlib), still verified;
- a packed dataset's ``metadata.json`` ``checksums``: ``{file: [bytes, "xxh3-128:HEX"]}``, the tokens hashed
  from the buffers as ``pack`` writes them.

XXH3 is used for both because it costs a writer nothing measurable: on this project's CPU it hashed 22-28 GB/s
against 1-3.8 GB/s for zlib's CRC-32 (0.2-0.5 GB/s for SHA-256 and BLAKE2b), while a pack writes 0.5-0.7 GB/s
of tokens (scripts/bench_data.py, table 4). Both catch any change that was not made on purpose to collide:
damaged files, data that is not what a run trained on.

Every reader of a checkpoint verifies it here first (:func:`verified_checkpoint`), the ranks sharing one read.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import pickle
import zlib
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import xxhash

from nemo_anchor.atomic import atomic_file
from nemo_anchor.run_dir import checkpoints_of, is_checkpoint_dir

CHUNK = 16 << 20
CHECKSUMS = "checksums.json"  # {file: [bytes, digest]} of every other file of the checkpoint, written at save
RECORDED = "recorded"  # the one key of CHECKSUMS that names no file: how its digests were made
AS_WRITTEN = "as written"  # from the bytes as they were written (read back and compared too, unless on a stop)
READ_BACK = "read back after the write"  # files another tool wrote (import-hf), or whose writer reported no digests
AFTER_THE_FACT = "read back at the next start"  # a stop's checkpoint of an older version, or whose writer reported
# no digests: computed from the files as the next start found them, which proves only that they did not change since
XXH3 = "xxh3-128:"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file or key."""


def crc32_file(path: str | os.PathLike) -> int:
    """CRC-32 of a file's bytes (what checkpoints of earlier versions recorded), read in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_digest(path: str | os.PathLike) -> str:
    """``"xxh3-128:HEX"`` of a file's bytes, read in 16 MiB chunks (xxhash releases the GIL: a thread can do this)."""
    digest = ContentDigest()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.value()[1]


class ContentDigest:
    """``[bytes, "xxh3-128:HEX"]`` of a file computed from the buffers as they are written, never read back."""

    def __init__(self):
        self.size, self._hash = 0, xxhash.xxh3_128()

    def update(self, data) -> None:
        """Add the bytes of ``data``: any C-contiguous buffer (bytes, a numpy array of any shape, empty ones too)."""
        self._hash.update(data)
        self.size += memoryview(data).nbytes

    def value(self) -> list:
        return [self.size, f"xxh3-128:{self._hash.hexdigest()}"]


def file_digests(root: Path, names: list[str]) -> dict[str, list]:
    """``{name: [bytes, "xxh3-128:HEX"]}`` of the files ``root/name`` (small files just written, a read-back)."""
    return {name: [(root / name).stat().st_size, file_digest(root / name)] for name in names}


def process_rank() -> int:
    """This process's rank in torch.distributed's default group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def process_count() -> int:
    """How many processes torch.distributed's default group holds (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_from_first(value):
    """Rank 0's ``value`` on every rank (itself without a process group)."""
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_from_all(value) -> list:
    """Every rank's ``value``, in rank order."""
    if not dist.is_initialized():
        return [value]
    every = [None] * process_count()
    dist.all_gather_object(every, value)
    return every


def _is_digest(value) -> bool:
    """A CRC-32 (int, older checkpoints) or ``"xxh3-128:"`` and 32 hex digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 0
    return isinstance(value, str) and value.startswith(XXH3) and len(value) == len(XXH3) + 32 and \
        all(c in "0123456789abcdef" for c in value[len(XXH3):])


def read_manifest(path: Path) -> dict[str, list]:
    """A checkpoint's ``checksums.json`` (its files' entries, without :data:`RECORDED`), read as untrusted input:
    CheckpointError naming the file and the field unless it is a non-empty ``{file: [bytes, digest]}`` (an empty or
    malformed one verifies nothing)."""
    try:
        sums = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    if isinstance(sums, dict):
        sums = {name: entry for name, entry in sums.items() if name != RECORDED}
    if not isinstance(sums, dict) or not sums:
        what = "empty" if sums == {} else f"a JSON {type(sums).__name__}"
        raise CheckpointError(f"{path} is {what}, not {{file: [bytes, CRC-32]}} of the checkpoint's files: it "
                              f"verifies nothing")
    for name, entry in sums.items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and entry[0] >= 0 and _is_digest(entry[1])):
            raise CheckpointError(f"{path}: field {name!r} is {entry!r}, not [bytes, CRC-32]")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{path}: field {name!r} names no file of the checkpoint")
    return sums


def write_manifest(ckpt_dir: Path, sums: dict[str, list], recorded: str) -> None:
    """``ckpt_dir``'s ``checksums.json``: ``sums`` and how they were made (``recorded``), flushed to the disk."""
    with atomic_file(ckpt_dir / CHECKSUMS, durable=True) as staging:
        staging.write_text(json.dumps({RECORDED: recorded, **dict(sorted(sums.items()))}, indent=1))


def verify_digests(root: Path, recorded: dict) -> dict[str, str]:
    """{file: what is wrong with it} for the files of ``recorded`` (``{name: [bytes, "xxh3-128:HEX"]}``, a packed
    dataset's ``metadata.json`` ``checksums``) that differ from it; every byte of every file is read."""
    problems = {}
    for name, entry in sorted(recorded.items()):
        path = root / name
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and isinstance(entry[1], str)):
            problems[name] = f"{root / 'metadata.json'}: field checksums.{name} is {entry!r}, not [bytes, digest]"
        elif not path.is_file():
            problems[name] = f"{path} is missing"
        elif path.stat().st_size != entry[0]:
            problems[name] = f"{path} has {path.stat().st_size} bytes, metadata.json recorded {entry[0]}"
        elif file_digests(root, [name])[name][1] != entry[1]:
            problems[name] = f"{path} changed since it was packed: its XXH3-128 differs from the one metadata.json " \
                             f"recorded"
    return problems


def _damaged_files(ckpt_dir: Path, sums: dict, names: list[str]) -> dict[str, str]:
    """{file: what is wrong with it} for those of ``names`` that do not match the manifest."""
    problems = {}
    for name in names:
        path = ckpt_dir / name
        size, digest = sums[name]
        if not path.is_file():
            problems[name] = f"{path} is missing"
        elif path.stat().st_size != size:
            problems[name] = f"{path} has {path.stat().st_size} bytes, {CHECKSUMS} recorded {size}"
        elif (crc32_file(path) if isinstance(digest, int) else file_digest(path)) != digest:
            kind = "CRC-32" if isinstance(digest, int) else "XXH3-128"
            problems[name] = f"{path} is corrupt: its {kind} differs from the one {CHECKSUMS} recorded at save"
    return problems


_VERIFY = contextvars.ContextVar("nemo_anchor_verify_checkpoints", default=True)
NOT_VERIFIED = "not verified"


@contextlib.contextmanager
def verification(enabled: bool):
    """Within the block, checkpoints are read with (default) or without verifying their files first; only an
    explicit ``--no-verify`` / ``checkpoint.verify=false`` turns it off."""
    token = _VERIFY.set(enabled)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def say_once(message: str) -> None:
    """Print ``message`` on rank 0 only."""
    if process_rank() == 0:
        print(message, flush=True)


def verifying() -> bool:
    """Whether checkpoints are verified before they are read here (:func:`verification`)."""
    return _VERIFY.get()


def verify_files(ckpt_dir: str | os.PathLike, report: Callable[[str], None] = say_once) -> None:
    """CheckpointError naming the first missing, unreadable, truncated or corrupt file of a checkpoint.

    Collective. With a ``CHECKSUMS`` manifest (every checkpoint nemo-anchor writes) each file's size
    and digest are compared, the ranks sharing the reading: the checkpoint is read once. Without one
    only metadata is read (``metadata.json``, the common state, and the tensor index, whose entries say
    how many bytes of which file each tensor occupies), and ``report`` says it is not verified.
    """
    ckpt_dir = Path(ckpt_dir)
    problem = sums = None  # rank 0 reads them; every rank gets them
    if process_rank() == 0:
        try:
            sums = read_manifest(ckpt_dir / CHECKSUMS) if (ckpt_dir / CHECKSUMS).is_file() else None
            if sums is None:
                _verify_against_index(ckpt_dir)
        except CheckpointError as err:
            problem, sums = str(err), None
        except (OSError, ValueError) as err:
            problem, sums = f"{ckpt_dir / CHECKSUMS} is unreadable ({err})", None
        else:
            if sums is None:
                report(f"warning: {ckpt_dir} has no {CHECKSUMS}: {NOT_VERIFIED} (only its files' sizes were "
                       f"checked against its index)")
    problem, sums = broadcast_from_first((problem, sums))
    if sums is not None:
        names = sorted(sums)
        mine = names[process_rank()::process_count()]
        found = {name: why for part in gather_from_all(_damaged_files(ckpt_dir, sums, mine))
                 for name, why in part.items()}
        problem = found[min(found)] if found else None
    if problem:
        raise CheckpointError(problem)


def newest_intact(candidates: list[Path], report: Callable[[str], None]) -> tuple[Path | None, list[str]]:
    """The newest of ``candidates`` (oldest first) whose files verify, and what is wrong with each newer one."""
    damaged = []
    for candidate in reversed(candidates):
        try:
            verify_files(candidate, report)
        except CheckpointError as err:
            damaged.append(str(err))
            continue
        return candidate, damaged
    return None, damaged


def verified_checkpoint(path: str | os.PathLike, report: Callable[[str], None] = say_once) -> Path:
    """The checkpoint directory to read for ``path``, its files verified; every reader of a checkpoint calls this.

    ``path`` is a checkpoint directory (``iter_NNNNNNN``), which must be intact, or a run folder, whose
    newest intact checkpoint is used, each newer damaged one named in a warning. Collective: the ranks
    share one read of the checkpoint. Inside ``verification(False)`` the files are not read.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no checkpoint.
        CheckpointError: the checkpoint, or every checkpoint of the run, is damaged (naming the files).
    """
    path = Path(path)
    candidates = checkpoints_of(path)
    if not _VERIFY.get():
        return candidates[-1]
    found, damaged = newest_intact(candidates, report)
    if found is None:
        what = f"{candidates[0]} is damaged" if is_checkpoint_dir(path) else f"no intact checkpoint under {path}"
        raise CheckpointError(f"{what}: {'; '.join(damaged)} (pass --no-verify, or checkpoint.verify=false, to "
                              f"read it unverified)")
    if damaged:
        report(f"warning: {damaged[0]}; reading {found}, the newest intact checkpoint of {path}, instead")
    return found


def _verify_against_index(ckpt_dir: Path) -> None:
    for name in ("metadata.json", ".metadata"):
        if not (ckpt_dir / name).is_file():
            raise CheckpointError(f"{ckpt_dir / name} is missing")
    try:
        with open(ckpt_dir / ".metadata", "rb") as handle:
            index = pickle.load(handle)
        from megatron.core import dist_checkpointing

        dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"{ckpt_dir}: unreadable checkpoint metadata ({type(err).__name__}: {err})") from None
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if path.stat().st_size < size:
            raise CheckpointError(f"{path} is truncated: {path.stat().st_size} bytes, the checkpoint index "
                                  f"needs {size}")
