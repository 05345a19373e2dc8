"""Which documents go into a packed split, how often, in which order, and in which pieces.

All of it is decided on document lengths alone (numpy, no tokens), seeded and deterministic:
filtering, per-source long-document upsampling (UpSampledMix), shuffling and interleaved chunks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from nemo_anchor.data.arrays import exclusive_cumsum

# independent random streams, so enabling one option does not change what another draws
_UPSAMPLE, _SHUFFLE, _INTERLEAVE = 1, 2, 3


@dataclass(frozen=True)
class Pieces:
    """The packed stream in order: piece i is ``length[i]`` tokens of packed document ``document[i]``
    from token ``start[i]``. ``opens``: the document's first piece (it carries the domain tag);
    ``closes``: its last piece (EOS follows). Each piece is one attention segment."""

    document: np.ndarray  # int64
    start: np.ndarray  # int64
    length: np.ndarray  # int64
    opens: np.ndarray  # bool
    closes: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.document)

    def __getitem__(self, index: slice) -> "Pieces":
        return Pieces(*(getattr(self, field.name)[index] for field in fields(self)))

    def split(self, max_length: int) -> "Pieces":
        """The same stream cut into parts of at most ``max_length`` tokens (for bounded streaming)."""
        parts = np.maximum(1, -(-self.length // max_length))
        owner = np.repeat(np.arange(len(self)), parts)
        rank = np.arange(len(owner)) - np.repeat(exclusive_cumsum(parts), parts)
        start = self.start[owner] + rank * max_length
        length = np.minimum(max_length, self.start[owner] + self.length[owner] - start)
        return Pieces(self.document[owner], start, length, self.opens[owner] & (rank == 0),
                      self.closes[owner] & (rank == parts[owner] - 1))


def upsample_long_documents(documents: np.ndarray, lengths: np.ndarray, domains: np.ndarray, factor: float,
                            long_tokens: int, seed: int) -> np.ndarray:
    """Per-source length upsampling (Fu et al. 2024, the paper's UpSampledMix).

    Within each domain, a document of at least ``long_tokens`` tokens is drawn ``factor`` times as
    often as a shorter one, while the domain keeps its token count, so the mixture of domains is
    unchanged and only the length distribution inside each domain shifts. Expected copies of a
    document are ``w * budget_d / sum(w * length)`` (``w`` = ``factor`` or 1), rounded stochastically.

    Returns:
        the chosen documents with repeats, in input order.
    """
    if factor < 1:
        raise ValueError(f"upsampling factor must be >= 1, got {factor}")
    weight = np.where(lengths[documents] >= long_tokens, factor, 1.0)
    copies = np.zeros(len(documents))
    domain_of = domains[documents]
    for domain in np.unique(domain_of):
        mine = domain_of == domain
        doc_lengths = lengths[documents[mine]]
        copies[mine] = weight[mine] * doc_lengths.sum() / (weight[mine] * doc_lengths).sum()
    rng = np.random.default_rng([seed, _UPSAMPLE])
    whole = np.floor(copies)
    counts = (whole + (rng.random(len(copies)) < copies - whole)).astype(np.int64)
    return np.repeat(documents, counts)


def shuffle(documents: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, _SHUFFLE]).permutation(documents)


def whole_documents(lengths: np.ndarray) -> Pieces:
    """One piece per document: documents stay contiguous (they still split at window ends)."""
    count = len(lengths)
    ones = np.ones(count, dtype=bool)
    return Pieces(np.arange(count, dtype=np.int64), np.zeros(count, np.int64), lengths.astype(np.int64), ones, ones)


def interleaved_chunks(lengths: np.ndarray, chunks: int, group_tokens: int, seed: int) -> Pieces:
    """Interleaved chunks (the paper's Section 5.2, after Zhao et al. 2024).

    Each document is cut at ``chunks - 1`` random points (coinciding cuts merge, so short documents
    get fewer chunks); consecutive documents are grouped into about ``group_tokens`` tokens (one
    window) and the chunks of a group are shuffled, each document's chunks staying in their order.
    """
    rng = np.random.default_rng([seed, _INTERLEAVE])
    count = len(lengths)
    cut_fractions = np.sort(rng.random((count, chunks - 1)), axis=1)
    cuts = np.concatenate([np.zeros((count, 1), np.int64), (cut_fractions * lengths[:, None]).astype(np.int64),
                           lengths[:, None].astype(np.int64)], axis=1)
    chunk_lengths = np.diff(cuts, axis=1)
    keep = chunk_lengths > 0
    document = np.broadcast_to(np.arange(count)[:, None], keep.shape)[keep]
    start, length = cuts[:, :-1][keep], chunk_lengths[keep]  # row-major: documents in order, chunks in order
    group = (exclusive_cumsum(lengths) // max(1, group_tokens))[document]
    shuffled = np.lexsort((rng.random(len(document)), group))
    # The k-th appearance of a document in the shuffled order takes its k-th chunk.
    by_document = np.argsort(document[shuffled], kind="stable")
    order = np.empty(len(document), dtype=np.int64)
    order[by_document] = np.arange(len(document))  # order[position] = chunk placed there
    document, start, length = document[order], start[order], length[order]
    opens, closes = start == 0, start + length == lengths[document]
    return Pieces(document.astype(np.int64), start, length, opens, closes)
