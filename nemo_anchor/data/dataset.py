"""Serve packed windows to the trainer: :class:`PackedDataset` and :func:`collate_windows`."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from nemo_anchor.data.layout import (DOCUMENT_DOMAINS_FILE, DOCUMENT_SOURCES_FILE, MASKED_SPANS_FILE,
                                     SEGMENT_DOCUMENTS_FILE, SEGMENT_STARTS_FILE, TOKENS_FILE, read_metadata)
from nemo_anchor.data.tokenizer import TOKENIZER_SUBDIR, Tokenizer, load_tokenizer


class PackedDataset(torch.utils.data.Dataset):
    """The windows of a packed dataset directory, memory-mapped.

    ``ds[i]`` is window i as a dict of tensors, T = ``ds.seq_length``:

    - ``tokens`` ``[T]`` int64: the anchor at position 0, then documents each ended by EOS, padding last;
    - ``labels`` ``[T]`` int64: ``tokens[t + 1]``; the last label is PAD (masked);
    - ``loss_mask`` ``[T]`` float32: 1 where ``labels[t]`` is trained, 0 where it is padding or a domain
      tag (or masked by a NeMo input), where the prediction crosses into another segment (the last
      position of every segment, the window's last position included);
    - ``position_ids`` ``[T]`` int64: ``0..T-1``, continuous over the window (AnchorAttention);
    - ``cu_seqlens`` ``[S + 1]`` int32: segment boundaries from 0 to T. A segment is one document's
      tokens inside this window; the first segment holds the anchor; trailing padding is a segment.

    Attributes:
        seq_length: T.
        metadata: the directory's ``metadata.json``.
        tokenizer_path: the tokenizer directory (``tokenizer`` property: loaded on first use).
        document_sources: int64 ``[D]`` input document index of each packed document (repeats
            when upsampled); ``document_domains`` int32 ``[D]`` its domain code (``metadata["domains"]``).

    Raises:
        ValueError: a missing or inconsistent file (named in the message).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata = read_metadata(self.path)
        self.seq_length = int(self.metadata["seq_length"])
        self.num_windows = int(self.metadata["num_windows"])
        self.pad_id = int(self.metadata["pad_id"])
        self.tokenizer_path = self.path / TOKENIZER_SUBDIR
        self._tokens = self._map_tokens(np.dtype(self.metadata["token_dtype"]))
        # every id pack wrote is below its tokenizer's size; the token dtype bounds the rest
        self._id_bound = int(self.metadata.get("vocab_size") or np.iinfo(self._tokens.dtype).max + 1)
        self.document_sources = self._load(DOCUMENT_SOURCES_FILE, 1)
        self.document_domains = self._load(DOCUMENT_DOMAINS_FILE, 1)
        self._segment_starts = self._load(SEGMENT_STARTS_FILE, 1)
        self._segment_documents = self._load(SEGMENT_DOCUMENTS_FILE, 1)
        spans = self._load(MASKED_SPANS_FILE, 2)
        self._span_starts, self._span_ends = spans[:, 0].copy(), spans[:, 1].copy()
        self._check_index()

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = self._window(index)
        T = self.seq_length
        first = index * T
        tokens = self._tokens[index].astype(np.int64)
        if tokens.max() >= self._id_bound:
            raise ValueError(f"{self.path / TOKENS_FILE}: window {index} holds token id {int(tokens.max())}, outside "
                             f"the packing tokenizer's vocabulary of {self._id_bound} (metadata.json): the file is "
                             f"corrupt; repack the data")
        cu_seqlens = self._cu_seqlens(index)
        labels = np.empty(T, dtype=np.int64)
        labels[:-1], labels[-1] = tokens[1:], self.pad_id
        loss_mask = np.ones(T, dtype=np.float32)
        loss_mask[:-1][self._masked_tokens(first)[1:]] = 0.0
        loss_mask[cu_seqlens[1:] - 1] = 0.0
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.arange(T, dtype=torch.int64),
            "cu_seqlens": torch.from_numpy(cu_seqlens),
        }

    def window_cu_seqlens(self, index: int) -> np.ndarray:
        """int32 ``[S + 1]``: the ``cu_seqlens`` of window ``index`` alone, without reading its tokens."""
        return self._cu_seqlens(self._window(index))

    def _cu_seqlens(self, index: int) -> np.ndarray:
        first = index * self.seq_length
        return np.append(self._segment_starts[self._segment_range(index)] - first, self.seq_length).astype(np.int32)

    def window_documents(self, index: int) -> np.ndarray:
        """int64 ``[S]``: the packed document of each segment of window ``index`` (-1: padding)."""
        return self._segment_documents[self._segment_range(self._window(index))].copy()

    def check_token_ids(self, vocab_size: int, chunk_windows: int = 4096) -> None:
        """ValueError naming this dataset, its largest token id and ``vocab_size`` when an id is ``>= vocab_size``.

        ``pack`` bounds every id by its tokenizer's ``metadata["vocab_size"]``, and ``ds[i]`` checks
        that bound on every window it reads (a corrupt ``tokens.bin`` is named when read). So when
        the model's vocabulary is at least the tokenizer's, nothing is read here: a corpus of
        100B tokens starts at once on every rank. Only a smaller model vocabulary makes this scan
        ``tokens.bin`` (memory-mapped, ``chunk_windows`` windows at a time) for its largest id.
        """
        if self._id_bound <= vocab_size:
            return
        largest = max((int(self._tokens[start:start + chunk_windows].max())
                       for start in range(0, self.num_windows, chunk_windows)), default=-1)
        if largest >= vocab_size:
            raise ValueError(f"packed dataset {self.path}: largest token id {largest} is outside the model's "
                             f"vocabulary of {vocab_size} (model.vocab_size, or the data's tokenizer); repack "
                             f"the data or raise model.vocab_size")

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer it was packed with, named as when packed (``metadata["tokenizer"]``: byte, bpe-N, a path)."""
        loaded = load_tokenizer(self.tokenizer_path)
        return Tokenizer(loaded.hf, str(self.metadata.get("tokenizer") or loaded.name))

    def __reduce__(self):
        # DataLoader workers reopen the memory maps instead of pickling the windows
        return type(self), (self.path,)

    def _window(self, index: int) -> int:
        if not -self.num_windows <= index < self.num_windows:
            raise IndexError(f"window {index} out of range for {self.num_windows} windows")
        return index % self.num_windows

    def _segment_range(self, index: int) -> slice:
        first, end = np.searchsorted(self._segment_starts, [index * self.seq_length, (index + 1) * self.seq_length])
        return slice(int(first), int(end))

    def _masked_tokens(self, first: int) -> np.ndarray:
        """bool ``[T]``: tokens of the window at stream position ``first`` that are never labels."""
        T = self.seq_length
        lo = np.searchsorted(self._span_ends, first, side="right")
        hi = np.searchsorted(self._span_starts, first + T, side="left")
        edges = np.zeros(T + 1, dtype=np.int32)
        np.add.at(edges, np.clip(self._span_starts[lo:hi] - first, 0, T), 1)
        np.add.at(edges, np.clip(self._span_ends[lo:hi] - first, 0, T), -1)
        return np.cumsum(edges[:T]) > 0

    def _map_tokens(self, dtype: np.dtype) -> np.ndarray:
        path = self.path / TOKENS_FILE
        expected = self.num_windows * self.seq_length * dtype.itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected or expected == 0:
            raise ValueError(f"{path}: expected {expected} bytes for {self.num_windows} windows of "
                             f"{self.seq_length} {dtype} tokens, found {actual}")
        return np.memmap(path, dtype=dtype, mode="r", shape=(self.num_windows, self.seq_length))

    def _load(self, name: str, ndim: int) -> np.ndarray:
        path = self.path / name
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read {path}: {error}") from error
        if array.ndim != ndim or not np.issubdtype(array.dtype, np.integer) or (ndim == 2 and array.shape[1] != 2):
            raise ValueError(f"{path}: unexpected {array.dtype} array of shape {array.shape}")
        return array

    def _check_index(self) -> None:
        total = self.num_windows * self.seq_length
        starts, documents = self._segment_starts, self._segment_documents

        def corrupt(name: str, what: str) -> ValueError:
            return ValueError(f"corrupt packed index {self.path / name}: {what}")

        if len(documents) != len(starts):
            raise corrupt(SEGMENT_DOCUMENTS_FILE, f"{len(documents)} entries for {len(starts)} segments")
        if len(starts) == 0 or starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= total:
            raise corrupt(SEGMENT_STARTS_FILE, f"segment starts must rise strictly from 0 below {total}")
        if not np.isin(np.arange(self.num_windows) * self.seq_length, starts).all():
            raise corrupt(SEGMENT_STARTS_FILE, "a window does not start a segment")
        if documents.min() < -1 or documents.max() >= len(self.document_sources):
            raise corrupt(SEGMENT_DOCUMENTS_FILE, f"document numbers outside [-1, {len(self.document_sources)})")
        if len(self.document_domains) != len(self.document_sources):
            raise corrupt(DOCUMENT_DOMAINS_FILE, f"{len(self.document_domains)} entries for "
                                                 f"{len(self.document_sources)} documents")
        spans_ok = (self._span_starts < self._span_ends).all() and (self._span_starts[1:] >= self._span_ends[:-1]).all()
        if not spans_ok or (len(self._span_starts) and (self._span_starts[0] < 0 or self._span_ends[-1] > total)):
            raise corrupt(MASKED_SPANS_FILE, f"spans must be sorted, disjoint and inside [0, {total})")


def collate_windows(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Batch B windows of equal length T (items of :class:`PackedDataset`).

    Returns:
        ``tokens``, ``labels``, ``loss_mask``, ``position_ids``: ``[B, T]`` (dtypes as in the items);
        ``cu_seqlens``: int32 ``[N + 1]`` segment boundaries over the flattened ``B * T`` tokens
        (window b's offset by ``b * T``), so every window boundary is also a segment boundary;
        ``cu_windows``: int32 ``[B + 1]`` = ``[0, T, 2T, ..., B * T]``.

    Raises:
        ValueError: no items, windows of different lengths, or more tokens than int32 boundaries count.
    """
    if not items:
        raise ValueError("collate_windows needs at least one window")
    lengths = {int(item["tokens"].shape[0]) for item in items}
    if len(lengths) != 1:
        raise ValueError(f"windows of different lengths cannot be batched: {sorted(lengths)}")
    T = lengths.pop()
    if len(items) * T > torch.iinfo(torch.int32).max:
        raise ValueError(f"{len(items)} windows of {T} tokens are {len(items) * T} tokens, more than the int32 "
                         f"cu_seqlens of a batch count: lower the micro-batch size")
    batch = {key: torch.stack([item[key] for item in items]) for key in ("tokens", "labels", "loss_mask",
                                                                         "position_ids")}
    batch["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int32)]
                                    + [item["cu_seqlens"][1:] + b * T for b, item in enumerate(items)])
    batch["cu_windows"] = torch.arange(len(items) + 1, dtype=torch.int32) * T
    return batch


# Megatron-LM's packed-batch sentinel: entries of a padded ``cu_seqlens`` past the last boundary
CU_SEQLENS_PAD = -1


def fixed_shape_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A :func:`collate_windows` batch in fixed shapes, as Megatron-LM's packed batches are.

    Every tensor's shape depends only on the micro-batch size B and the window length T, so tensor
    ranks and pipeline stages can allocate it before it arrives: ``tokens``, ``labels``,
    ``loss_mask``, ``position_ids`` ``[B, T]``; ``cu_seqlens`` int32 ``[1, B*T + 1]`` (the document
    boundaries, then :data:`CU_SEQLENS_PAD`); ``cu_seqlens_argmin`` int64 ``[1]`` (the index of the
    first pad: the boundary count); ``max_seqlen`` int32 ``[1]`` (the longest document). The window
    boundaries are ``[0, T, ..., B*T]``, read from the ``[B, T]`` shape; :func:`variable_shape_batch`
    turns the batch back.
    """
    b, t = batch["tokens"].shape
    boundaries = batch["cu_seqlens"]
    cu_seqlens = torch.full((1, b * t + 1), CU_SEQLENS_PAD, dtype=torch.int32)
    cu_seqlens[0, :len(boundaries)] = boundaries
    return {**{key: batch[key] for key in ("tokens", "labels", "loss_mask", "position_ids")},
            "cu_seqlens": cu_seqlens,
            "cu_seqlens_argmin": torch.tensor([len(boundaries)], dtype=torch.int64),
            "max_seqlen": (boundaries[1:] - boundaries[:-1]).max().reshape(1).to(torch.int32)}


def variable_shape_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The :func:`collate_windows` batch of a :func:`fixed_shape_batch` (any other batch is returned as
    it is): ``cu_seqlens`` cut at ``cu_seqlens_argmin``, ``cu_windows`` from the ``[B, T]`` shape.

    Reads only host tensors' values (``cu_seqlens_argmin``; ``cu_seqlens`` is sliced, not read);
    ValueError when the padded boundaries are not a fixed-shape batch of these windows.
    """
    if "cu_seqlens_argmin" not in batch:
        return batch
    b, t = batch["tokens"].shape
    padded = batch["cu_seqlens"].reshape(-1)
    count = int(batch["cu_seqlens_argmin"].reshape(-1)[0])
    if padded.numel() != b * t + 1 or not 2 <= count <= padded.numel():
        raise ValueError(f"fixed-shape batch: cu_seqlens of {padded.numel()} entries with cu_seqlens_argmin={count} "
                         f"do not describe {b} windows of {t} tokens (expected {b * t + 1} entries, argmin in "
                         f"[2, {b * t + 1}])")
    unpadded = {key: value for key, value in batch.items() if key not in ("cu_seqlens_argmin", "max_seqlen")}
    unpadded["cu_seqlens"] = padded[:count]
    unpadded["cu_windows"] = torch.arange(b + 1, dtype=torch.int32, device=padded.device) * t
    return unpadded
