"""NeMo 2 packed-sequence interop: read and write the ``.npy`` of ``prepare_packed_sequence_data``.

NeMo's format (``nemo/collections/llm/gpt/data/packed_sequence.py``, ``nemo/utils/sequence_packing_utils.py``,
read by ``GPTSFTPackedDataset`` in ``core.py``): ``np.save`` of a 1-D object array of dicts, one per pack:

- ``input_ids``: list of token ids, the pack's sequences concatenated (at most ``pack_size``);
- ``seq_start_id``: list, start of each sequence in ``input_ids`` (the first is 0);
- ``loss_mask``: list of bools aligned with ``input_ids``: ``loss_mask[j]`` trains the prediction of
  token ``j + 1`` from position ``j`` (NeMo rolls the per-token mask by one). NeMo's collate feeds
  ``seq[:-1]`` of each sequence and predicts ``seq[1:]``, so no prediction crosses a sequence.

The metadata JSON (``{pack_size}_metadata.jsonl``, a JSON list despite the name) gets one dict per
packed file (train, then validation): ``dataset_max_seqlen``, ``max_samples_per_bin``,
``packing_factor``, ``packing_efficiency``, ``pack_size``, ``min_packed_seqlen``.

Writing: every window becomes a pack and every segment (``cu_seqlens``) a sequence, the trailing
padding segment left out; our loss mask already masks each segment's last position, which NeMo
drops. Reading: every sequence becomes a document whose tokens are kept as they are and whose label
mask follows NeMo's (a sequence's first token is never a label). ``.npy`` files are unpickled:
open only files you trust, as with NeMo itself.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nemo_anchor.atomic import atomic_file

NEMO_KEYS = ("input_ids", "loss_mask", "seq_start_id")


@dataclass(frozen=True)
class NemoSequences:
    """All sequences of a NeMo packed file: ``tokens[offsets[d]:offsets[d + 1]]`` is sequence d."""

    tokens: np.ndarray  # int64, flat
    offsets: np.ndarray  # int64 [D + 1]
    trainable: np.ndarray  # bool like tokens: False where NeMo never trains the prediction of that token


def read_nemo_packed(path: str | Path) -> NemoSequences:
    """Read a NeMo packed ``.npy`` into its sequences.

    Raises:
        ValueError: unreadable file, or a pack without the NeMo keys or with inconsistent fields.
    """
    path = Path(path)
    try:
        packs = np.load(path, allow_pickle=True)
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise ValueError(f"{path}: not a readable NeMo packed .npy ({error})") from error
    if packs.dtype != object or packs.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D array of dicts, got {packs.dtype} with shape {packs.shape}")
    tokens, trainable, offsets = [], [], [np.zeros(1, np.int64)]
    base = 0
    for number, pack in enumerate(packs):
        where = f"{path}: pack {number}"
        if not isinstance(pack, dict) or any(key not in pack for key in NEMO_KEYS):
            found = sorted(pack) if isinstance(pack, dict) else type(pack).__name__
            raise ValueError(f"{where}: expected a dict with keys {NEMO_KEYS}, got {found}")
        ids = np.asarray(pack["input_ids"], dtype=np.int64)
        mask = np.asarray(pack["loss_mask"]).astype(bool)
        starts = np.asarray(pack["seq_start_id"], dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0 or mask.shape != ids.shape:
            raise ValueError(f"{where}: input_ids ({ids.shape}) and loss_mask ({mask.shape}) must be equal, non-empty")
        if starts.ndim != 1 or starts.size == 0 or starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= ids.size:
            raise ValueError(f"{where}: seq_start_id must rise strictly from 0 below len(input_ids)={ids.size}")
        labels = np.zeros(ids.size, dtype=bool)
        labels[1:] = mask[:-1]
        labels[starts] = False
        tokens.append(ids)
        trainable.append(labels)
        offsets.append(base + np.append(starts[1:], ids.size))
        base += ids.size
    if base == 0:
        raise ValueError(f"{path}: holds no packs")
    return NemoSequences(np.concatenate(tokens), np.concatenate(offsets), np.concatenate(trainable))


def write_nemo_packed(dataset, npy_path: str | Path, metadata_path: str | Path | None = None) -> dict:
    """Write a packed dataset (a :class:`~nemo_anchor.data.PackedDataset` or its directory) as a NeMo ``.npy``.

    Args:
        npy_path: output file (NeMo names them ``training_{pack_size}.npy``, ``validation_{pack_size}.npy``).
        metadata_path: NeMo's packing metadata file; this file's entry is appended to its list.

    Returns:
        the packing metadata entry.
    """
    from nemo_anchor.data.dataset import PackedDataset

    if not isinstance(dataset, PackedDataset):
        dataset = PackedDataset(dataset)
    packs = np.empty(len(dataset), dtype=object)
    packed_lengths, sequence_lengths, sequences_per_pack = [], [], []
    for index in range(len(dataset)):
        window = dataset[index]
        boundaries = window["cu_seqlens"].numpy()
        if dataset.window_documents(index)[-1] < 0:  # trailing padding is not a sequence for NeMo
            boundaries = boundaries[:-1]
        end = int(boundaries[-1])
        packs[index] = {
            "input_ids": window["tokens"][:end].tolist(),
            "loss_mask": (window["loss_mask"][:end] > 0).tolist(),
            "seq_start_id": boundaries[:-1].tolist(),
        }
        packed_lengths.append(end)
        sequence_lengths.extend(np.diff(boundaries).tolist())
        sequences_per_pack.append(len(boundaries) - 1)
    metadata = {
        "dataset_max_seqlen": int(max(sequence_lengths)),
        "max_samples_per_bin": int(max(sequences_per_pack)),
        "packing_factor": round(len(sequence_lengths) / len(packs), 2),
        "packing_efficiency": round(sum(packed_lengths) / len(packs) / dataset.seq_length * 100, 2),
        "pack_size": dataset.seq_length,
        "min_packed_seqlen": int(min(packed_lengths)),
    }
    earlier_entries = _read_metadata(Path(metadata_path)) if metadata_path is not None else []
    with atomic_file(npy_path) as tmp:
        with open(tmp, "wb") as out:
            np.save(out, packs, allow_pickle=True)
    if metadata_path is not None:
        with atomic_file(metadata_path) as tmp:
            tmp.write_text(json.dumps(earlier_entries + [metadata]))
    return metadata


def _read_metadata(path: Path) -> list:
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read NeMo packing metadata {path}: {error}") from error
    if not isinstance(entries, list):
        raise ValueError(f"NeMo packing metadata {path} must hold a JSON list, found {type(entries).__name__}")
    return entries
