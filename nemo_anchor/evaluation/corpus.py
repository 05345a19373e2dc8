"""Fixed-length token windows from a packed dataset, JSONL files or plain text files."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

import torch


def read_token_windows(
    sources: Sequence[str | Path],
    tokenizer,
    *,
    num_windows: int,
    length: int,
    text_key: str = "text",
) -> torch.Tensor:
    """Read ``num_windows`` windows of ``length`` tokens: int64 ``[num_windows, length]``.

    - One directory: a packed dataset (``nemo_anchor.data.PackedDataset``); window ``i`` is the
      first ``length`` tokens of sample ``i``, kept as packed (its first token is the anchor).
    - Files: ``*.jsonl`` holds one document per line (its text under ``text_key``); any other file
      is one plain-text document. Documents are tokenized without special tokens, joined with EOS
      (when the tokenizer has one) and cut into consecutive windows, each opened with BOS (when the
      tokenizer has one), as a model sees a document at inference.
    """
    if num_windows < 1 or length < 2:
        raise ValueError(f"need num_windows >= 1 and length >= 2, got {num_windows} and {length}")
    paths = [Path(source) for source in sources]
    if not paths:
        raise ValueError("no input given: pass a packed dataset directory or text/JSONL files")
    for path in paths:
        if not path.exists():
            raise ValueError(f"input {path} does not exist")
    if any(path.is_dir() for path in paths):
        if len(paths) != 1:
            raise ValueError(f"a packed dataset directory must be the only input, got {[str(p) for p in paths]}")
        return _packed_windows(paths[0], tokenizer, num_windows, length)
    return _text_windows(paths, tokenizer, num_windows, length, text_key)


def _packed_windows(directory: Path, tokenizer, num_windows: int, length: int) -> torch.Tensor:
    from nemo_anchor.data import PackedDataset
    from nemo_anchor.data.tokenizer import check_same_tokenizer

    dataset = PackedDataset(directory)
    check_same_tokenizer(dataset.tokenizer, f"packed dataset {directory}", tokenizer, "the model")
    if len(dataset) < num_windows:
        raise ValueError(f"packed dataset {directory} has {len(dataset)} samples, {num_windows} requested")
    windows = []
    for index in range(num_windows):
        tokens = torch.as_tensor(dataset[index]["tokens"], dtype=torch.int64)
        if tokens.numel() < length:
            raise ValueError(
                f"packed dataset {directory}: sample {index} has {tokens.numel()} tokens, {length} requested"
            )
        windows.append(tokens[:length])
    return torch.stack(windows)


def check_token_ids(windows: torch.Tensor, vocab_size: int, sources: Sequence[str | Path]) -> None:
    """ValueError naming the inputs, the largest id and ``vocab_size`` when a token id is ``>= vocab_size``."""
    largest = int(windows.max())
    if largest >= vocab_size:
        raise ValueError(f"{', '.join(str(s) for s in sources)}: largest token id {largest} is outside the model's "
                         f"vocabulary of {vocab_size}")


def _text_windows(paths: list[Path], tokenizer, num_windows: int, length: int, text_key: str) -> torch.Tensor:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    body_length = length - len(bos)
    needed = num_windows * body_length
    stream: list[int] = []
    for document in _documents(paths, text_key):
        for piece in _pieces(document):
            stream += tokenizer(piece, add_special_tokens=False)["input_ids"]
            if len(stream) >= needed:
                break
        stream += separator
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        names = ", ".join(str(p) for p in paths)
        raise ValueError(
            f"{names} hold {len(stream)} tokens, {num_windows} windows of {length} need {needed}: "
            "give more text, fewer windows or shorter windows"
        )
    body = torch.tensor(stream[:needed], dtype=torch.int64).view(num_windows, body_length)
    return torch.cat([torch.tensor(bos, dtype=torch.int64).expand(num_windows, len(bos)), body], dim=1)


def _pieces(document: str, size: int = 1 << 16) -> Iterator[str]:
    """Line-aligned pieces of about ``size`` characters, so a huge file is tokenized only as far as needed."""
    start = 0
    while start < len(document):
        end = document.find("\n", start + size)
        end = len(document) if end < 0 else end + 1
        yield document[start:end]
        start = end


def _documents(paths: list[Path], text_key: str) -> Iterator[str]:
    """Documents of JSONL / Parquet / text inputs, read by the data pipeline's readers (same errors)."""
    from nemo_anchor.data.readers import expand_inputs, iter_records

    skipped: Counter = Counter()
    for source in expand_inputs(paths):
        for record in iter_records(source, text_key, "error", skipped):
            yield record.text
