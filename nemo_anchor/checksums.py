"""Checksums of written files, one owner for both kinds:

- a checkpoint's ``checksums.json``: ``{file: [bytes, CRC-32]}`` (zlib; computed on a thread after the write,
  see :class:`nemo_anchor.training.checkpoint.CheckpointSaver`);
- a packed dataset's ``metadata.json`` ``checksums``: ``{file: [bytes, "xxh3-128:HEX"]}``, the tokens hashed
  from the buffers as ``pack`` writes them. XXH3 is used there because it costs pack nothing measurable:
  on this project's CPU it hashed 22-28 GB/s against 1-3.8 GB/s for zlib's CRC-32 (0.2-0.5 GB/s for
  SHA-256 and BLAKE2b), while a pack writes 0.5-0.7 GB/s of tokens (scripts/bench_data.py, table 4).
Both catch any change that was not made on purpose to collide: damaged files, data that is not what a run
trained on.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path

import xxhash

CHUNK = 16 << 20


def crc32_file(path: str | os.PathLike) -> int:
    """CRC-32 of a file's bytes, read in 16 MiB chunks (zlib releases the GIL: a thread can do this)."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_checksums(root: Path, names: list[str]) -> dict[str, list[int]]:
    """``{name: [bytes, CRC-32]}`` of the files ``root/name`` (a checkpoint's ``checksums.json``)."""
    return {name: [(root / name).stat().st_size, crc32_file(root / name)] for name in names}


class ContentDigest:
    """``[bytes, "xxh3-128:HEX"]`` of a file computed from the buffers as they are written, never read back."""

    def __init__(self):
        self.size, self._hash = 0, xxhash.xxh3_128()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += len(view)

    def value(self) -> list:
        return [self.size, f"xxh3-128:{self._hash.hexdigest()}"]


def file_digests(root: Path, names: list[str]) -> dict[str, list]:
    """``{name: [bytes, "xxh3-128:HEX"]}`` of the files ``root/name`` (small files a pack has just written)."""
    digests = {}
    for name in names:
        digest = ContentDigest()
        with open(root / name, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
        digests[name] = digest.value()
    return digests
