"""Tokenized documents of all inputs, addressed by one global document index in input order.

Text inputs are tokenized once into a flat token file (parallel on all cores, streamed, so memory
does not grow with the corpus); Megatron inputs are memory-mapped as they are; NeMo inputs are
loaded. The packer then reads any subset of documents, in any order, with :meth:`DocumentStore.gather`.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from nemo_anchor.data.arrays import concat_ranges, exclusive_cumsum
from nemo_anchor.data.megatron_indexed import read_indexed_dataset
from nemo_anchor.data.nemo_format import read_nemo_packed
from nemo_anchor.data.readers import InputFile, Record, iter_records
from nemo_anchor.data.tokenizer import Tokenizer

TEXT_BATCH_DOCUMENTS = 1024
TEXT_BATCH_CHARS = 8 << 20
# Copying run by run costs ~1 us of Python per run; one vectorised gather costs ~40 ns per token.
SLICE_COPY_MIN_MEAN_RUN = 64


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class HoldOut:
    """Deterministic validation split: a group is held out when its seeded hash falls below ``fraction``.

    Hashing the group (not drawing in order) keeps related documents together and makes the split
    independent of input order and of how the corpus is read.
    """

    def __init__(self, fraction: float, seed: int):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"valid fraction must be in [0, 1), got {fraction}")
        self.fraction, self.seed = fraction, seed
        self._threshold = int(fraction * 2.0**64)

    def __call__(self, group: str) -> bool:
        if self._threshold == 0:
            return False
        digest = hashlib.blake2b(f"{self.seed}\0{group}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "little") < self._threshold

    def of_documents(self, name: str, count: int) -> np.ndarray:
        """Held-out flags of documents ``name:0`` ... ``name:count-1`` (inputs without groups)."""
        if self._threshold == 0:
            return np.zeros(count, dtype=bool)
        return np.fromiter((self(f"{name}:{d}") for d in range(count)), dtype=bool, count=count)


@dataclass
class DocumentSource:
    """Documents of one input: ``tokens[offsets[d]:offsets[d + 1]]`` is document d."""

    name: str
    tokens: np.ndarray  # flat ids, memmap or array
    offsets: np.ndarray  # int64 [D + 1]
    domains: np.ndarray  # int32 [D], index into DocumentStore.domain_names
    held_out: np.ndarray  # bool [D]
    trainable: np.ndarray | None = None  # bool like tokens: False where a token is never a label (NeMo masks)


class DocumentStore:
    """All documents of all inputs, in input order.

    Attributes:
        lengths: int64 ``[D]`` tokens per document.
        domains: int32 ``[D]`` domain code per document (``domain_names[code]``).
        held_out: bool ``[D]`` documents of the validation split.
        has_label_masks: some documents carry tokens that must never be labels.
    """

    def __init__(self, sources: list[DocumentSource], domain_names: list[str], vocab_size: int):
        self.sources, self.domain_names, self.vocab_size = sources, domain_names, vocab_size
        counts = np.array([len(source.offsets) - 1 for source in sources], dtype=np.int64)
        self._first_document = exclusive_cumsum(counts)
        self.lengths = np.concatenate([np.diff(source.offsets) for source in sources])
        self.domains = np.concatenate([source.domains for source in sources]).astype(np.int32)
        self.held_out = np.concatenate([source.held_out for source in sources])
        self.has_label_masks = any(source.trainable is not None for source in sources)
        self.dtype = token_dtype(vocab_size)

    def __len__(self) -> int:
        return len(self.lengths)

    def last_tokens(self) -> np.ndarray:
        """int64 ``[D]`` last token of each document (-1 for empty ones)."""
        last = np.full(len(self), -1, dtype=np.int64)
        for source, first in zip(self.sources, self._first_document):
            ends = source.offsets[1:]
            nonempty = np.flatnonzero(ends > source.offsets[:-1])
            last[first + nonempty] = source.tokens[ends[nonempty] - 1]
        return last

    def gather(self, documents: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Concatenate ``tokens of documents[i][starts[i]:starts[i] + lengths[i]]`` for every i.

        Returns:
            the tokens (``self.dtype``) and, when :attr:`has_label_masks`, their trainable flags.
        """
        tokens = np.empty(int(lengths.sum()), dtype=self.dtype)
        trainable = np.ones(len(tokens), dtype=bool) if self.has_label_masks else None
        source_of = np.searchsorted(self._first_document, documents, side="right") - 1
        source_starts = np.empty(len(documents), dtype=np.int64)
        for number in np.unique(source_of):
            chosen = source_of == number
            source_starts[chosen] = self.sources[number].offsets[documents[chosen] - self._first_document[number]]
        source_starts += starts
        views = [np.asarray(source.tokens) for source in self.sources]  # slicing a np.memmap costs microseconds
        masks = [source.trainable for source in self.sources]
        if len(tokens) >= SLICE_COPY_MIN_MEAN_RUN * len(documents):
            position = 0
            for number, start, length in zip(source_of.tolist(), source_starts.tolist(), lengths.tolist()):
                tokens[position:position + length] = views[number][start:start + length]
                if masks[number] is not None:
                    trainable[position:position + length] = masks[number][start:start + length]
                position += length
        else:
            out_starts = exclusive_cumsum(lengths)
            for number in np.unique(source_of):
                chosen = source_of == number
                destination = concat_ranges(out_starts[chosen], lengths[chosen])
                origin = concat_ranges(source_starts[chosen], lengths[chosen])
                tokens[destination] = views[number][origin]
                if masks[number] is not None:
                    trainable[destination] = masks[number][origin]
        return tokens, trainable


class _DomainCodes(dict):
    """Domain name -> code, assigned in order of first appearance."""

    def __missing__(self, name: str) -> int:
        self[name] = len(self)
        return self[name]


def read_documents(inputs: list[InputFile], tokenizer: Tokenizer, work_dir: Path, *, text_key: str,
                   on_invalid_utf8: str, hold_out: HoldOut, skipped: Counter) -> DocumentStore:
    """Tokenize or map every input into a :class:`DocumentStore`; token files go to ``work_dir``.

    Consecutive text-like inputs (jsonl, parquet, text) share one token file.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    domain_codes = _DomainCodes()
    sources: list[DocumentSource] = []
    for kind_is_text, group in itertools.groupby(inputs, key=lambda item: item.kind in ("jsonl", "parquet", "text")):
        group = list(group)
        if kind_is_text:
            records = itertools.chain.from_iterable(
                iter_records(item, text_key, on_invalid_utf8, skipped) for item in group)
            path = work_dir / f"text-{len(sources)}.bin"
            sources.append(_tokenize(records, tokenizer, path, domain_codes, hold_out, name=str(group[0].path)))
        else:
            sources.extend(_pretokenized(item, tokenizer.vocab_size, domain_codes, hold_out) for item in group)
    return DocumentStore(sources, list(domain_codes), tokenizer.vocab_size)


def _pretokenized(item: InputFile, vocab_size: int, domain_codes: _DomainCodes, hold_out: HoldOut) -> DocumentSource:
    if item.kind == "megatron":
        documents = read_indexed_dataset(item.path)
        tokens, offsets, trainable = documents.tokens, documents.offsets, None
    else:
        sequences = read_nemo_packed(item.path)
        tokens, offsets, trainable = sequences.tokens, sequences.offsets, sequences.trainable
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{item.path}: token ids span [{tokens.min()}, {tokens.max()}], outside the tokenizer's "
                         f"vocabulary of {vocab_size}; wrong tokenizer?")
    count = len(offsets) - 1
    return DocumentSource(str(item.path), tokens, offsets, np.full(count, domain_codes[item.domain], np.int32),
                          hold_out.of_documents(item.key, count), trainable)


def _batches(records: Iterable[Record]) -> Iterator[list[Record]]:
    batch, chars = [], 0
    for record in records:
        batch.append(record)
        chars += len(record.text)
        if len(batch) >= TEXT_BATCH_DOCUMENTS or chars >= TEXT_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _tokenize(records: Iterable[Record], tokenizer: Tokenizer, path: Path, domain_codes: _DomainCodes,
              hold_out: HoldOut, name: str) -> DocumentSource:
    """Stream ``records`` through the tokenizer into ``path``.

    One batch is encoded (HF tokenizers, all cores, GIL released) while the next is read and parsed.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    lengths: list[int] = []
    domains: list[int] = []
    held_out: list[bool] = []

    def write(batch: list[Record], encoded: list[list[int]], out) -> None:
        counts = [len(ids) for ids in encoded]
        np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=sum(counts)).tofile(out)
        lengths.extend(counts)
        domains.extend(domain_codes[record.domain] for record in batch)
        held_out.extend(hold_out(record.group) for record in batch)
        progress.update(len(batch))

    with open(path, "wb") as out, ThreadPoolExecutor(max_workers=1) as encoder, \
            tqdm(desc="tokenize", unit="doc", disable=None) as progress:
        in_flight: deque = deque()
        for batch in _batches(records):
            in_flight.append((batch, encoder.submit(tokenizer.encode_batch, [record.text for record in batch])))
            if len(in_flight) > 1:
                batch, future = in_flight.popleft()
                write(batch, future.result(), out)
        while in_flight:
            batch, future = in_flight.popleft()
            write(batch, future.result(), out)
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    tokens = np.memmap(path, dtype=dtype, mode="r") if offsets[-1] else np.zeros(0, dtype)
    return DocumentSource(name, tokens, offsets, np.array(domains, np.int32), np.array(held_out, bool))
