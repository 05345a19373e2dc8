"""Read Megatron-Core indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) with numpy, without Megatron.

The ``.idx`` layout (``megatron.core.datasets.indexed_dataset._IndexWriter``, version 1):
``b"MMIDIDX\\x00\\x00"``, version ``<Q``, dtype code ``<B``, sequence count S ``<Q``, document
count D+1 ``<Q``, then ``int32[S]`` sequence lengths, ``int64[S]`` byte pointers into ``.bin``,
``int64[D+1]`` document indices (document d is sequences ``idx[d]:idx[d+1]``), and for multimodal
data ``int8[S]`` modes (ignored here). Every inconsistency is reported as a corrupt index.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType
DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                 8: np.uint16}
_FIXED = struct.Struct("<9sQBQQ")


@dataclass(frozen=True)
class IndexedDocuments:
    """Documents of an indexed dataset: ``tokens[offsets[d]:offsets[d + 1]]`` is document d."""

    tokens: np.ndarray  # read-only memmap of the .bin
    offsets: np.ndarray  # int64 [D + 1], in tokens


def read_indexed_dataset(prefix: str | Path) -> IndexedDocuments:
    """Memory-map ``PREFIX.bin`` and read the document boundaries from ``PREFIX.idx``.

    Raises:
        ValueError: a corrupt or unsupported index (names the file and what is wrong).
    """
    prefix = Path(prefix)
    idx_path, bin_path = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    try:
        raw = np.fromfile(idx_path, dtype=np.uint8)
        actual_bytes = bin_path.stat().st_size
    except OSError as error:
        raise ValueError(f"cannot read Megatron dataset {prefix}: {error}") from error

    def corrupt(what: str) -> ValueError:
        return ValueError(f"corrupt Megatron index {idx_path}: {what}")

    if raw.size < _FIXED.size:
        raise corrupt(f"{raw.size} bytes is shorter than the {_FIXED.size}-byte header")
    header, version, code, num_sequences, num_indices = _FIXED.unpack(raw[:_FIXED.size].tobytes())
    if header != INDEX_HEADER:
        raise corrupt(f"header {header!r} is not {INDEX_HEADER!r}")
    if version != 1:
        raise corrupt(f"version {version} is not 1")
    if code not in DTYPE_OF_CODE or not np.issubdtype(DTYPE_OF_CODE[code], np.integer):
        raise corrupt(f"dtype code {code} is not an integer token type")
    dtype = np.dtype(DTYPE_OF_CODE[code])
    needed = _FIXED.size + 4 * num_sequences + 8 * num_sequences + 8 * num_indices
    if raw.size < needed or num_indices < 1:
        raise corrupt(f"{num_sequences} sequences and {num_indices} document indices need {needed} bytes, "
                      f"file has {raw.size}")
    lengths = np.frombuffer(raw, np.int32, num_sequences, _FIXED.size).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, num_sequences, _FIXED.size + 4 * num_sequences)
    doc_index = np.frombuffer(raw, np.int64, num_indices, _FIXED.size + 12 * num_sequences)

    if (lengths < 0).any():
        raise corrupt("negative sequence length")
    token_starts = np.concatenate(([0], np.cumsum(lengths)))
    if not np.array_equal(pointers, token_starts[:-1] * dtype.itemsize):
        raise corrupt("sequence pointers are not the running sum of sequence lengths")
    if doc_index[0] != 0 or doc_index[-1] != num_sequences or (np.diff(doc_index) < 0).any():
        raise corrupt("document indices must rise from 0 to the sequence count")
    expected_bytes = int(token_starts[-1]) * dtype.itemsize
    if actual_bytes != expected_bytes:
        raise corrupt(f"{bin_path} has {actual_bytes} bytes, the index describes {expected_bytes}")
    tokens = (np.memmap(bin_path, dtype=dtype, mode="r") if expected_bytes else np.zeros(0, dtype))
    return IndexedDocuments(tokens, token_starts[doc_index])
