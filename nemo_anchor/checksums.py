"""Checksums of written files: a checkpoint's ``checksums.json`` and a packed dataset's ``metadata.json``
``checksums`` both map each file to ``[bytes, CRC-32]``.

CRC-32 (zlib) is the fastest digest the standard library offers (measured on this project's CPU: 1.0 GB/s,
against 0.47 for SHA-1, 0.40 for SHA-256 and 0.21 for BLAKE2b); it catches any change that was not made
on purpose to collide, which is what it is for: damaged files, and data that is not what a run trained on.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

CHUNK = 16 << 20


def crc32_file(path: str | os.PathLike) -> int:
    """CRC-32 of a file's bytes, read in 16 MiB chunks (zlib releases the GIL: a thread can do this)."""
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_checksums(root: Path, names: list[str]) -> dict[str, list[int]]:
    """``{name: [bytes, CRC-32]}`` of the files ``root/name``."""
    return {name: [(root / name).stat().st_size, crc32_file(root / name)] for name in names}


class RunningChecksum:
    """``[bytes, CRC-32]`` of a file computed from the buffers as they are written, so it is never read back.

    The CRC runs on a thread of its own (zlib releases the GIL), one buffer in flight: hashing a buffer
    overlaps producing the next. A buffer given to :meth:`update` must not change afterwards."""

    def __init__(self):
        self.size = self.crc = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum")
        self._in_flight: Future | None = None

    def update(self, data) -> None:
        self._wait()
        self._in_flight = self._thread.submit(self._add, data)

    def value(self) -> list[int]:
        self._wait()
        self._thread.shutdown()
        return [self.size, self.crc]

    def _add(self, data) -> None:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)

    def _wait(self) -> None:
        if self._in_flight is not None:
            self._in_flight.result()
            self._in_flight = None
