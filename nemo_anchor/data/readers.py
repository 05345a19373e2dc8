"""Input discovery and text readers: JSONL, Parquet and plain text files and folders.

Pre-tokenized inputs (Megatron ``.bin``/``.idx``, NeMo packed ``.npy``) are recognised here and read
by :mod:`nemo_anchor.data.megatron_indexed` and :mod:`nemo_anchor.data.nemo_format`.

Every document gets a domain (the paper's source: SlimPajama's CC, C4, GitHub...): the record's
``domain`` field, else its ``source`` field, else the name of the input it came from. A record's
optional ``group`` field keeps related documents in the same train/validation split.
"""
from __future__ import annotations

import itertools
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
NEMO_SUFFIXES = (".npy",)
MEGATRON_SUFFIXES = (".bin", ".idx")
ON_INVALID_UTF8 = ("error", "skip")
# A JSON escape of a UTF-16 surrogate decodes to a str that has no UTF-8 encoding.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class InputFile:
    """One input: ``kind`` is jsonl, parquet, text, megatron (``path`` is the prefix) or nemo."""

    path: Path
    kind: str
    domain: str  # default domain of its documents
    key: str  # path from the input argument's parent: names documents independently of where the data lives


@dataclass(frozen=True)
class Record:
    """One text document and where it came from (``where`` is ``file:line`` or ``file:row``)."""

    text: str
    domain: str
    group: str
    where: str


def expand_inputs(paths: list[str | Path]) -> list[InputFile]:
    """Resolve input arguments into files, in argument order; folders are walked recursively in name order.

    A Megatron dataset is given as its prefix, its ``.bin`` or its ``.idx``. Inside folders, hidden
    files and empty files are skipped; any other file without a known suffix is plain text.

    Raises:
        ValueError: a missing path, an explicitly named empty file, a folder with no input files.
    """
    if not paths:
        raise ValueError("no inputs given")
    files: list[InputFile] = []
    for arg in paths:
        path = Path(arg)
        megatron_prefix = path.with_suffix("") if path.suffix in MEGATRON_SUFFIXES else path
        if _is_megatron_prefix(megatron_prefix):
            files.append(InputFile(megatron_prefix, "megatron", megatron_prefix.name, megatron_prefix.name))
        elif path.is_dir():
            found = _walk_folder(path)
            if not found:
                raise ValueError(f"input folder {path} holds no input files")
            files.extend(found)
        elif path.is_file():
            if path.stat().st_size == 0:
                raise ValueError(f"input file {path} is empty")
            files.append(InputFile(path, _kind_of(path), path.stem, path.name))
        else:
            raise ValueError(f"input {path} does not exist")
    return files


def _is_megatron_prefix(prefix: Path) -> bool:
    return all(prefix.with_name(prefix.name + suffix).is_file() for suffix in MEGATRON_SUFFIXES)


def _kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in NEMO_SUFFIXES:
        return "nemo"
    return "text"


def _walk_folder(folder: Path) -> list[InputFile]:
    files, seen_prefixes = [], set()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if any(part.startswith(".") for part in path.relative_to(folder).parts) or path.stat().st_size == 0:
            continue
        if path.suffix in MEGATRON_SUFFIXES and _is_megatron_prefix(path.with_suffix("")):
            prefix = path.with_suffix("")
            if prefix not in seen_prefixes:
                seen_prefixes.add(prefix)
                files.append(InputFile(prefix, "megatron", folder.name, str(prefix.relative_to(folder.parent))))
            continue
        files.append(InputFile(path, _kind_of(path), folder.name, str(path.relative_to(folder.parent))))
    return files


def iter_records(source: InputFile, text_key: str, on_invalid_utf8: str, skipped: Counter) -> Iterator[Record]:
    """Text documents of a jsonl, parquet or text input, in file order.

    Args:
        text_key: field holding the text in JSONL and Parquet inputs.
        on_invalid_utf8: ``"error"`` raises ValueError naming file and line; ``"skip"`` logs a
            warning, skips that document and counts it in ``skipped["invalid_utf8"]``.
    """
    if on_invalid_utf8 not in ON_INVALID_UTF8:
        raise ValueError(f"on_invalid_utf8 must be one of {ON_INVALID_UTF8}, got {on_invalid_utf8!r}")
    readers = {"jsonl": _jsonl_records, "parquet": _parquet_records, "text": _text_records}
    if source.kind not in readers:
        raise ValueError(f"{source.path}: a {source.kind} input holds tokens, not text")
    try:
        yield from readers[source.kind](source, text_key, on_invalid_utf8, skipped)
    except OSError as error:
        raise ValueError(f"cannot read {source.path}: {error}") from error


def _invalid_utf8(where: str, error: UnicodeError, policy: str, skipped: Counter) -> None:
    message = f"{where}: invalid UTF-8 ({error})"
    if policy == "error":
        raise ValueError(message + "; pass on_invalid_utf8='skip' (--on-invalid-utf8 skip) to skip such documents")
    log.warning("%s; skipped", message)
    skipped["invalid_utf8"] += 1


def _jsonl_records(source: InputFile, text_key: str, policy: str, skipped: Counter) -> Iterator[Record]:
    with open(source.path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{source.path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                _invalid_utf8(where, error, policy, skipped)
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if text_key not in record:
                raise ValueError(f"{where}: no {text_key!r} field (fields: {sorted(record)})")
            text = record[text_key]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {text_key!r} is {type(text).__name__}, not a string")
            if _SURROGATE_ESCAPE.search(raw):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as error:
                    _invalid_utf8(where, error, policy, skipped)
                    continue
            yield _record(text, record, source, str(number))


def _record(text: str, fields: dict, source: InputFile, position: str) -> Record:
    """A Record with the domain and group taken from ``fields`` when present (None counts as absent)."""
    where = f"{source.path}:{position}"
    domain = next((fields[key] for key in ("domain", "source") if fields.get(key) is not None), source.domain)
    if not isinstance(domain, str) or not domain:
        raise ValueError(f"{where}: domain/source must be a non-empty string, got {domain!r}")
    group = fields.get("group")
    return Record(text, domain, f"{source.key}:{position}" if group is None else str(group), where)


def _parquet_records(source: InputFile, text_key: str, policy: str, skipped: Counter) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(source.path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{source.path}: not a readable Parquet file ({error})") from error
    names = parquet.schema_arrow.names
    if text_key not in names:
        raise ValueError(f"{source.path}: no {text_key!r} column (columns: {names})")
    columns = [text_key] + [name for name in ("domain", "source", "group") if name in names]
    records = itertools.chain.from_iterable(batch.to_pylist() for batch in parquet.iter_batches(columns=columns))
    for row, record in enumerate(records):
        where = f"{source.path}:row {row}"
        text = record[text_key]
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as error:
                _invalid_utf8(where, error, policy, skipped)
                continue
        if not isinstance(text, str):
            raise ValueError(f"{where}: column {text_key!r} is {type(text).__name__}, not a string")
        yield _record(text, record, source, f"row {row}")


def _text_records(source: InputFile, text_key: str, policy: str, skipped: Counter) -> Iterator[Record]:
    raw = source.path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        _invalid_utf8(f"{source.path}:{line}", error, policy, skipped)
        return
    yield Record(text, source.domain, source.key, str(source.path))
