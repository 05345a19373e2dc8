"""On-disk layout of a packed dataset directory (described in README.md) and its metadata."""
from __future__ import annotations

import json
from pathlib import Path

FORMAT_NAME = "nemo-anchor-packed"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
STATS_FILE = "stats.json"
HISTOGRAM_FILE = "document_lengths.png"
VALID_SUBDIR = "valid"
TOKENS_FILE = "tokens.bin"
SEGMENT_STARTS_FILE = "segment_starts.npy"
SEGMENT_DOCUMENTS_FILE = "segment_documents.npy"
MASKED_SPANS_FILE = "masked_spans.npy"
DOCUMENT_SOURCES_FILE = "document_sources.npy"
DOCUMENT_DOMAINS_FILE = "document_domains.npy"
PADDING_DOCUMENT = -1  # segment_documents entry of the padding segment


def read_metadata(directory: str | Path) -> dict:
    """The metadata of a packed dataset directory.

    Raises:
        ValueError: no metadata file, unreadable JSON, or another format or version.
    """
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"{directory} is not a packed dataset: {METADATA_FILE} is missing")
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    found = (metadata.get("format"), metadata.get("version")) if isinstance(metadata, dict) else (None, None)
    if found != (FORMAT_NAME, FORMAT_VERSION):
        raise ValueError(f"{path}: format {found} is not ({FORMAT_NAME!r}, {FORMAT_VERSION})")
    return metadata
