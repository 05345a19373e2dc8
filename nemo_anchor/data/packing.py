"""Write packed windows: the anchor, then documents (optional domain tag, tokens, EOS) back to back.

A document longer than the space left continues in the next window, right after its anchor. The
documents' concatenation (the *body*) is therefore cut every ``T - 1`` tokens and each cut is
prefixed with the anchor, which makes packing a streamed reshape: memory stays flat in corpus size and
window length.
Body position ``p`` lands at window position ``p + p // (T - 1) + 1``; segment boundaries, tag and
padding spans are mapped the same way, from document lengths alone. On-disk layout: see README.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nemo_anchor.checksums import ContentDigest, file_digests
from nemo_anchor.data.arrays import exclusive_cumsum, runs_of_false
from nemo_anchor.data.layout import (DOCUMENT_DOMAINS_FILE, DOCUMENT_SOURCES_FILE, MASKED_SPANS_FILE,
                                     PADDING_DOCUMENT, SEGMENT_DOCUMENTS_FILE, SEGMENT_STARTS_FILE, TOKENS_FILE)
from nemo_anchor.data.plan import Pieces
from nemo_anchor.data.store import DocumentStore

PART_TOKENS = 1 << 20  # the longest piece read at once
BATCH_TOKENS = 1 << 20  # body tokens built and written per step (bounds the index temporaries)


@dataclass(frozen=True)
class WindowLayout:
    """What goes around the documents. ``tags[d]``: tag token ids of domain code d (empty: no tag)."""

    seq_length: int
    anchor_id: int
    eos_id: int
    pad_id: int
    tags: list[np.ndarray]  # one per domain code
    drop_last: bool  # drop the last partial window instead of padding it


@dataclass(frozen=True)
class PackSummary:
    num_windows: int
    document_tokens: int
    tag_tokens: int
    eos_tokens: int
    padding_tokens: int
    dropped_tokens: int  # body tokens lost with a dropped last window
    num_segments: int
    segments_per_window_max: int


def write_packed(store: DocumentStore, documents: np.ndarray, pieces: Pieces, layout: WindowLayout,
                 out_dir: Path) -> tuple[PackSummary, dict[str, list[int]]]:
    """Pack ``pieces`` of ``documents`` (global document indices) into windows under ``out_dir``; returns the
    summary and ``{file: [bytes, XXH3-128]}`` of every file written (the tokens' computed as they are written).

    Raises:
        ValueError: the split fills no window (too few tokens with drop_last, or no documents).
    """
    body_per_window = layout.seq_length - 1
    domains = store.domains[documents]
    wrap = _Wrapping(layout, domains, store.last_tokens()[documents], store.dtype)
    piece_tag, piece_eos = wrap.tag_lengths(pieces), wrap.eos_lengths(pieces)
    piece_body = piece_tag + pieces.length + piece_eos
    piece_body_start = exclusive_cumsum(piece_body)
    body_tokens = int(piece_body.sum())
    full, partial = divmod(body_tokens, body_per_window)
    num_windows = full if layout.drop_last else full + (partial > 0)
    if num_windows == 0:
        raise ValueError(f"{body_tokens} tokens fill no window of {layout.seq_length}"
                         + (" (the last partial window is dropped; pad it instead)" if body_tokens else ""))

    mask_runs, tokens_checksum = _write_tokens(store, documents, pieces.split(PART_TOKENS), wrap, num_windows,
                                               out_dir / TOKENS_FILE)
    segment_starts, segment_documents = _segments(piece_body_start, pieces.document, body_tokens, num_windows,
                                                  body_per_window)
    has_tag = piece_tag > 0
    tag_spans = np.stack([piece_body_start[has_tag], piece_body_start[has_tag] + piece_tag[has_tag]], axis=1)
    spans = _masked_spans(np.concatenate([tag_spans, mask_runs]), body_tokens, num_windows, layout.seq_length)

    np.save(out_dir / SEGMENT_STARTS_FILE, segment_starts)
    np.save(out_dir / SEGMENT_DOCUMENTS_FILE, segment_documents)
    np.save(out_dir / MASKED_SPANS_FILE, spans)
    np.save(out_dir / DOCUMENT_SOURCES_FILE, documents.astype(np.int64))
    np.save(out_dir / DOCUMENT_DOMAINS_FILE, domains.astype(np.int32))
    index_files = [SEGMENT_STARTS_FILE, SEGMENT_DOCUMENTS_FILE, MASKED_SPANS_FILE, DOCUMENT_SOURCES_FILE,
                   DOCUMENT_DOMAINS_FILE]
    checksums = {TOKENS_FILE: tokens_checksum, **file_digests(out_dir, index_files)}  # the index files are small
    kept_body = min(body_tokens, num_windows * body_per_window)
    return PackSummary(
        num_windows=num_windows,
        document_tokens=int(pieces.length.sum()),
        tag_tokens=int(piece_tag.sum()),
        eos_tokens=int(piece_eos.sum()),
        padding_tokens=num_windows * body_per_window - kept_body,
        dropped_tokens=body_tokens - kept_body,
        num_segments=len(segment_starts),
        segments_per_window_max=int(np.bincount(segment_starts // layout.seq_length).max()),
    ), checksums


class _Wrapping:
    """The tokens around each document: its domain tag before the first piece, EOS after the last."""

    def __init__(self, layout: WindowLayout, document_domains: np.ndarray, document_last_tokens: np.ndarray,
                 dtype: np.dtype):
        self.layout, self.document_domains = layout, document_domains
        # pre-tokenized documents (Megatron --append-eod, NeMo sequences) may already end with EOS
        self.appends_eos = document_last_tokens != layout.eos_id
        self.domain_tag_lengths = np.array([len(tag) for tag in layout.tags], dtype=np.int64)
        self.domain_tag_offsets = exclusive_cumsum(self.domain_tag_lengths)
        self.tag_table = np.concatenate([np.zeros(0, dtype)] + [tag.astype(dtype) for tag in layout.tags])

    def tag_lengths(self, pieces: Pieces) -> np.ndarray:
        return np.where(pieces.opens, self.domain_tag_lengths[self.document_domains[pieces.document]], 0)

    def eos_lengths(self, pieces: Pieces) -> np.ndarray:
        return (pieces.closes & self.appends_eos[pieces.document]).astype(np.int64)

    def insertions(self, parts: Pieces, tag_lengths: np.ndarray, eos_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Indices into the parts' concatenated document tokens and the tag and EOS tokens to insert there.

        Listed in stream order, which ``np.insert`` keeps among equal indices (a part's EOS comes
        before the next part's tag).
        """
        count = tag_lengths + eos_lengths
        owner = np.repeat(np.arange(len(parts)), count)
        rank = np.arange(len(owner)) - np.repeat(exclusive_cumsum(count), count)
        is_tag = rank < tag_lengths[owner]
        document_start = exclusive_cumsum(parts.length)[owner]
        at = np.where(is_tag, document_start, document_start + parts.length[owner])
        values = np.full(len(owner), self.layout.eos_id, dtype=self.tag_table.dtype)
        tag_domains = self.document_domains[parts.document[owner[is_tag]]]
        values[is_tag] = self.tag_table[self.domain_tag_offsets[tag_domains] + rank[is_tag]]
        return at, values


def _write_tokens(store: DocumentStore, documents: np.ndarray, parts: Pieces, wrap: _Wrapping, num_windows: int,
                  path: Path) -> tuple[np.ndarray, list[int]]:
    """Stream ``num_windows`` windows into ``path``, a batch of parts at a time.

    Returns:
        ``[R, 2]`` body-coordinate runs of tokens the inputs mark untrainable (NeMo loss masks), and the
        file's ``[bytes, XXH3-128]``.
    """
    part_tag, part_eos = wrap.tag_lengths(parts), wrap.eos_lengths(parts)
    part_body = part_tag + parts.length + part_eos
    body_start = exclusive_cumsum(part_body)
    batch_of_part = (body_start + part_body - 1) // BATCH_TOKENS
    batch_edges = np.concatenate(([0], np.flatnonzero(np.diff(batch_of_part)) + 1, [len(parts)]))

    writer = _WindowWriter(path, wrap.layout, store.dtype, num_windows)
    mask_runs = [np.zeros((0, 2), np.int64)]
    with tqdm(total=int(part_body.sum()), desc="pack", unit="tok", unit_scale=True, disable=None) as progress:
        for first, end in zip(batch_edges[:-1], batch_edges[1:]):
            batch = parts[first:end]
            doc_tokens, doc_trainable = store.gather(documents[batch.document], batch.start, batch.length)
            at, values = wrap.insertions(batch, part_tag[first:end], part_eos[first:end])
            body = np.insert(doc_tokens, at, values)
            if doc_trainable is not None:
                mask_runs.append(runs_of_false(np.insert(doc_trainable, at, True)) + body_start[first])
            writer.write(body)
            progress.update(len(body))
    writer.finish()
    return np.concatenate(mask_runs), writer.checksum.value()


class _WindowWriter:
    """Writes exactly ``num_windows`` windows as the body streams in: the anchor before every ``T - 1`` body tokens,
    body tokens past the last window dropped (``drop_last``), the last window padded when the body ends inside it.

    Each write goes out whole, nothing is held back for a window to fill: memory follows the batches written,
    whatever the window length (a window of a million tokens is written over several batches).
    """

    def __init__(self, path: Path, layout: WindowLayout, dtype: np.dtype, num_windows: int):
        self.layout, self.dtype = layout, dtype
        self.file = open(path, "wb")
        self.checksum = ContentDigest()
        self.written = 0  # body tokens written so far
        self.body_left = num_windows * (layout.seq_length - 1)  # body tokens the windows still take

    def write(self, body: np.ndarray) -> None:
        body = body[:self.body_left]
        T, anchor = self.layout.seq_length, self.layout.anchor_id
        stream = np.empty(_stream_length(self.written + len(body), T - 1) - _stream_length(self.written, T - 1),
                          self.dtype)
        head = min(len(body), -self.written % (T - 1))  # what the window an earlier write began still takes
        whole = (len(body) - head) // (T - 1)  # windows begun and filled here
        stream[:head] = body[:head]
        windows = stream[head:head + whole * T].reshape(whole, T)
        windows[:, 0] = anchor
        windows[:, 1:] = body[head:head + whole * (T - 1)].reshape(whole, T - 1)
        begun = stream[head + whole * T:]  # a window begun and not filled here: its anchor and first tokens
        begun[:1] = anchor
        begun[1:] = body[head + whole * (T - 1):]
        stream.tofile(self.file)
        self.checksum.update(stream)
        self.written += len(body)
        self.body_left -= len(body)

    def finish(self) -> None:
        while self.body_left:
            self.write(np.full(min(self.body_left, BATCH_TOKENS), self.layout.pad_id, self.dtype))
        self.file.close()


def _stream_length(body_tokens: int, body_per_window: int) -> int:
    """Window-stream tokens that hold the first ``body_tokens`` body tokens: them and the anchors of their windows."""
    return body_tokens + -(-body_tokens // body_per_window)


def _window_position(body_position: np.ndarray | int, body_per_window: int):
    """Window-stream position of the token at body position ``p`` (an anchor precedes every cut)."""
    return body_position + body_position // body_per_window + 1


def _segments(piece_body_start: np.ndarray, piece_document: np.ndarray, body_tokens: int, num_windows: int,
              body_per_window: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment starts in window-stream coordinates and their packed document (-1: padding).

    A segment starts at every piece and at every window (the continuation of a split document);
    a segment starting at a window's first body token starts at its anchor instead.
    """
    kept_body = min(body_tokens, num_windows * body_per_window)
    starts = np.union1d(piece_body_start, np.arange(num_windows, dtype=np.int64) * body_per_window)
    starts = starts[starts < kept_body]
    owner = np.searchsorted(piece_body_start, starts, side="right") - 1
    documents = piece_document[owner]
    starts = _window_position(starts, body_per_window) - (starts % body_per_window == 0)
    if kept_body < num_windows * body_per_window:  # padding is a segment of its own
        starts = np.append(starts, _window_position(kept_body, body_per_window))
        documents = np.append(documents, PADDING_DOCUMENT)
    return starts.astype(np.int64), documents.astype(np.int64)


def _masked_spans(body_spans: np.ndarray, body_tokens: int, num_windows: int, seq_length: int) -> np.ndarray:
    """``[M, 2]`` sorted ``[start, end)`` window-stream spans of tokens never used as labels:
    tags, input-masked tokens and padding; the dropped tail is cut off."""
    body_per_window = seq_length - 1
    total = num_windows * seq_length
    starts = _window_position(body_spans[:, 0], body_per_window)
    ends = _window_position(body_spans[:, 1] - 1, body_per_window) + 1
    if body_tokens < num_windows * body_per_window:
        starts = np.append(starts, _window_position(body_tokens, body_per_window))
        ends = np.append(ends, total)
    keep = starts < total
    order = np.argsort(starts[keep], kind="stable")
    return np.stack([starts[keep][order], np.minimum(ends[keep][order], total)], axis=1).astype(np.int64)
