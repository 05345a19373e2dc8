"""``pack``: documents in, a packed dataset directory out (tokenize, split, plan, pack, statistics)."""
from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from nemo_anchor.data import plan
from nemo_anchor.atomic import atomic_directory
from nemo_anchor.checksums import file_digests
from nemo_anchor.data.layout import (FORMAT_NAME, FORMAT_VERSION, HISTOGRAM_FILE, METADATA_FILE, STATS_FILE,
                                     VALID_SUBDIR)
from nemo_anchor.data.packing import WindowLayout, write_packed
from nemo_anchor.data.readers import ON_INVALID_UTF8, InputFile, expand_inputs, iter_records
from nemo_anchor.data.stats import plot_document_lengths, split_statistics
from nemo_anchor.data.store import DocumentStore, HoldOut, read_documents
from nemo_anchor.data.tokenizer import TOKENIZER_SUBDIR, Tokenizer, load_tokenizer, train_bpe_tokenizer

TRAIN_BPE_PREFIX = "train-bpe:"
NEMO_SUBDIR = "nemo"
# Upper bounds checked before tokenizing: a window's cu_seqlens are int32 (packing streams windows of any
# length in bounded memory); interleaving draws (documents x chunks) random cuts at once.
MAX_SEQ_LENGTH = (1 << 31) - 1
MAX_INTERLEAVE_CHUNKS = 1024


@dataclass
class PackOptions:
    """How documents become windows (``nemo-anchor pack --help`` describes each option)."""

    seq_length: int
    shuffle: bool = False
    seed: int = 1234
    min_doc_tokens: int = 1
    upsample_factor: float = 1.0  # > 1: per-source long-document upsampling (UpSampledMix)
    long_doc_tokens: int = 4096  # what counts as long for upsampling
    domain_tags: bool = False  # "+ Tag": a loss-masked domain tag before each document
    tag_template: str = "<{domain}>\n"
    interleave_chunks: int = 1  # > 1: cut documents into up to this many interleaved chunks
    drop_last: bool = False  # drop the last partial window instead of padding it
    valid_fraction: float = 0.0  # share of document groups held out into DIR/valid
    on_invalid_utf8: str = "error"  # or "skip"
    text_key: str = "text"

    def check(self) -> None:
        """Raises ValueError naming the first invalid option."""
        if not 2 <= self.seq_length <= MAX_SEQ_LENGTH:
            raise ValueError(f"seq_length must be at least 2 (the anchor plus one token) and at most {MAX_SEQ_LENGTH} "
                             f"(cu_seqlens are int32), got {self.seq_length}")
        if self.min_doc_tokens < 1:
            raise ValueError(f"min_doc_tokens must be at least 1, got {self.min_doc_tokens}")
        if self.upsample_factor < 1 or self.long_doc_tokens < 1:
            raise ValueError(f"upsample_factor must be >= 1 and long_doc_tokens >= 1, got "
                             f"{self.upsample_factor} and {self.long_doc_tokens}")
        if not 1 <= self.interleave_chunks <= MAX_INTERLEAVE_CHUNKS:
            raise ValueError(f"interleave_chunks must be in [1, {MAX_INTERLEAVE_CHUNKS}], got {self.interleave_chunks}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.on_invalid_utf8 not in ON_INVALID_UTF8:
            raise ValueError(f"on_invalid_utf8 must be one of {ON_INVALID_UTF8}, got {self.on_invalid_utf8!r}")
        try:
            self.tag_template.format(domain="x")
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"tag_template {self.tag_template!r} must only use {{domain}}: {error}") from None


def pack(inputs: list[str | Path], tokenizer: str | Tokenizer, output: str | Path, options: PackOptions, *,
         overwrite: bool = False, export_nemo: bool = False) -> dict:
    """Pack documents into a memory-mapped dataset directory of anchor-ready windows.

    Args:
        inputs: files and folders (JSONL, Parquet, text, Megatron ``.bin``/``.idx``, NeMo ``.npy``).
        tokenizer: a :class:`Tokenizer`, ``"byte"``, a local HF tokenizer directory, or
            ``"train-bpe:VOCAB_SIZE"`` to train a byte-level BPE on the training documents.
        output: the dataset directory; its tokenizer is saved in ``output/tokenizer``, the held-out
            split (``valid_fraction > 0``) in ``output/valid``, statistics in ``stats.json`` and
            ``document_lengths.png``, and with ``export_nemo`` NeMo packed files in ``output/nemo``.
        overwrite: replace an existing ``output`` that ``pack`` wrote (:mod:`nemo_anchor.atomic`).

    Returns:
        the statistics (also saved as ``stats.json``).

    Raises:
        ValueError: bad options or inputs (the message names file, line, key or value), or an
            output that would overwrite an input or something else (checked before tokenizing).
            Nothing is left at ``output`` on any error.
    """
    options.check()
    files = expand_inputs(inputs)
    hold_out = HoldOut(options.valid_fraction, options.seed)
    skipped: Counter = Counter()
    sources = [*inputs, *(item.path for item in files), *([] if isinstance(tokenizer, Tokenizer) else [str(tokenizer)])]
    with atomic_directory(output, inputs=sources, overwrite=overwrite, command="pack") as work:
        tokenizer = _resolve_tokenizer(tokenizer, files, options, hold_out)
        store = read_documents(files, tokenizer, work / ".store", text_key=options.text_key,
                               on_invalid_utf8=options.on_invalid_utf8, hold_out=hold_out, skipped=skipped)
        train, valid = _split(store, options, skipped)
        layout = WindowLayout(options.seq_length, tokenizer.anchor_id, tokenizer.eos_id, tokenizer.pad_id,
                              _tags(tokenizer, store.domain_names, options), options.drop_last)
        common = {"inputs": [str(item.path) for item in files], "options": asdict(options)}
        train = _train_order(store, train, options)
        stats = {"input_documents": len(store), "skipped": {key: value for key, value in skipped.items() if value},
                 "held_out": len(valid),
                 "splits": {"train": _pack_split(store, train, tokenizer, layout, options, work, split="train",
                                                 common=common)}}
        if len(valid):
            stats["splits"]["valid"] = _pack_split(store, valid, tokenizer, replace(layout, drop_last=False), options,
                                                   work / VALID_SUBDIR, split="valid", common=common)
        plot_document_lengths(store.lengths[train], store.domains[train], store.domain_names, options.seq_length,
                              work / HISTOGRAM_FILE)
        shutil.rmtree(work / ".store")
        (work / STATS_FILE).write_text(json.dumps(stats, indent=2))
        if export_nemo:
            _export_nemo(work, options.seq_length, has_valid=bool(len(valid)))
    return stats


def _split(store: DocumentStore, options: PackOptions, skipped: Counter) -> tuple[np.ndarray, np.ndarray]:
    """Training and held-out documents, in input order, after dropping empty and short ones."""
    usable = store.lengths >= options.min_doc_tokens
    skipped["empty"] += int((store.lengths == 0).sum())
    skipped["short"] += int(((store.lengths > 0) & ~usable).sum())
    train, valid = np.flatnonzero(usable & ~store.held_out), np.flatnonzero(usable & store.held_out)
    if len(train) == 0:
        raise ValueError(f"no training documents left of {len(store)} read (skipped: {dict(skipped)}, "
                         f"held out: {len(valid)})")
    if options.valid_fraction > 0 and len(valid) == 0:
        raise ValueError(f"valid_fraction {options.valid_fraction} held out none of {len(store)} documents")
    return train, valid


def _resolve_tokenizer(spec: str | Tokenizer, files: list[InputFile], options: PackOptions,
                       hold_out: HoldOut) -> Tokenizer:
    if isinstance(spec, Tokenizer):
        return spec
    spec = str(spec)
    if not spec.startswith(TRAIN_BPE_PREFIX):
        return load_tokenizer(spec)
    size = spec[len(TRAIN_BPE_PREFIX):]
    if not size.isdigit():
        raise ValueError(f"tokenizer {spec!r}: expected {TRAIN_BPE_PREFIX}VOCAB_SIZE, e.g. {TRAIN_BPE_PREFIX}8192")
    pretokenized = [str(item.path) for item in files if item.kind in ("megatron", "nemo")]
    if pretokenized:
        raise ValueError(f"{TRAIN_BPE_PREFIX} needs text inputs; {pretokenized} are already tokenized")
    ignored: Counter = Counter()  # counted again when the documents are tokenized
    texts = (record.text for item in files
             for record in iter_records(item, options.text_key, options.on_invalid_utf8, ignored)
             if not hold_out(record.group))  # held-out documents stay unseen, the tokenizer included
    return train_bpe_tokenizer(texts, int(size))


def _tags(tokenizer: Tokenizer, domain_names: list[str], options: PackOptions) -> list[np.ndarray]:
    if not options.domain_tags:
        return [np.zeros(0, np.int64) for _ in domain_names]
    return [np.array(tokenizer.encode(options.tag_template.format(domain=name)), np.int64) for name in domain_names]


def _train_order(store: DocumentStore, documents: np.ndarray, options: PackOptions) -> np.ndarray:
    if options.upsample_factor > 1:
        documents = plan.upsample_long_documents(documents, store.lengths, store.domains, options.upsample_factor,
                                                 options.long_doc_tokens, options.seed)
    return plan.shuffle(documents, options.seed) if options.shuffle else documents


def _pack_split(store: DocumentStore, documents: np.ndarray, tokenizer: Tokenizer, layout: WindowLayout,
                options: PackOptions, out_dir: Path, *, split: str, common: dict) -> dict:
    """Pack ``documents`` (in this order) into ``out_dir`` with its tokenizer and metadata."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = store.lengths[documents]
    if split == "train" and options.interleave_chunks > 1:
        pieces = plan.interleaved_chunks(lengths, options.interleave_chunks, options.seq_length - 1, options.seed)
    else:
        pieces = plan.whole_documents(lengths)
    summary, checksums = write_packed(store, documents, pieces, layout, out_dir)
    tokenizer.save(out_dir / TOKENIZER_SUBDIR)
    tokenizer_files = sorted(str(path.relative_to(out_dir)) for path in (out_dir / TOKENIZER_SUBDIR).rglob("*")
                             if path.is_file())
    checksums.update(file_digests(out_dir, tokenizer_files))
    metadata = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "split": split,
        "seq_length": options.seq_length, "num_windows": summary.num_windows, "token_dtype": store.dtype.name,
        "vocab_size": tokenizer.vocab_size, "anchor_id": tokenizer.anchor_id, "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id, "tokenizer": tokenizer.name,
        "domains": store.domain_names, "valid": VALID_SUBDIR if split == "train" and options.valid_fraction else None,
        **common,
        # {file: [bytes, XXH3-128]} of every other file of the split: the content a resume compares
        # (nemo_anchor.training.resume.dataset_fingerprint)
        "checksums": dict(sorted(checksums.items())),
    }
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2))
    return split_statistics(lengths, store.domains[documents], store.domain_names, summary, options.seq_length)


def _export_nemo(directory: Path, seq_length: int, has_valid: bool) -> None:
    """NeMo's file names for a packed fine-tuning set: ``training_T.npy``, ``validation_T.npy``, ``T_metadata.jsonl``."""
    from nemo_anchor.data.nemo_format import write_nemo_packed

    metadata = directory / NEMO_SUBDIR / f"{seq_length}_metadata.jsonl"
    write_nemo_packed(directory, directory / NEMO_SUBDIR / f"training_{seq_length}.npy", metadata)
    if has_valid:
        write_nemo_packed(directory / VALID_SUBDIR, directory / NEMO_SUBDIR / f"validation_{seq_length}.npy", metadata)
