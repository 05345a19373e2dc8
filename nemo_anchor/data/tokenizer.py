"""Tokenizers for packing: a local Hugging Face tokenizer, the lossless ``byte`` tokenizer, or a
byte-level BPE trained on the corpus.

Every tokenizer is a ``transformers.PreTrainedTokenizerFast`` underneath, so :meth:`Tokenizer.save`
writes files that ``AutoTokenizer.from_pretrained(dir)`` loads offline and HF export can copy
unchanged. The wrapper adds the ids packing needs: the anchor (BOS, or EOS for tokenizers without
BOS such as Qwen's, as in the paper's Section 5.3), the document terminator and the padding id.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # BOS, EOS, PAD of the tokenizers built here
NUM_BYTES = 256
TOKENIZER_SUBDIR = "tokenizer"  # where a packed dataset keeps its tokenizer
# roles of the special tokens of a bare tokenizer.json, by the names common tokenizers use
BARE_SPECIAL_TOKENS = {
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos_token": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
}


class Tokenizer:
    """A fast Hugging Face tokenizer plus the special ids that packing and the model need.

    Attributes:
        hf: the ``transformers.PreTrainedTokenizerFast``.
        bos_id: BOS id, or None when the tokenizer has none.
        eos_id: the document terminator: EOS, or BOS when the tokenizer has no EOS.
        pad_id: PAD, or ``eos_id`` when the tokenizer has no PAD (padding is always loss-masked).
        anchor_id: the shared anchor that opens every window: BOS, or EOS when there is no BOS.
        vocab_size: number of ids, added tokens included (every id is ``< vocab_size``).
    """

    def __init__(self, hf_tokenizer, name: str):
        if not hf_tokenizer.is_fast:
            raise ValueError(f"tokenizer {name}: only fast (tokenizer.json) tokenizers are supported")
        bos, eos = hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id
        if bos is None and eos is None:
            raise ValueError(f"tokenizer {name} has neither a BOS nor an EOS token; the anchor needs one")
        self.hf = hf_tokenizer
        self.name = name
        self.bos_id = bos
        self.eos_id = eos if eos is not None else bos
        self.pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else self.eos_id
        self.anchor_id = bos if bos is not None else eos
        self.vocab_size = len(hf_tokenizer)
        # Document text is data, not markup: a literal "</s>" inside a document must stay text,
        # or documents could terminate themselves and the packed stream would not round-trip.
        self._encoder = tokenizers.Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
        self._encoder.encode_special_tokens = True
        self._encoder.no_truncation()
        self._encoder.no_padding()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added and none are parsed from the text."""
        return self._encoder.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` for many texts, in parallel on all cores (HF tokenizers' thread pool)."""
        return [e.ids for e in self._encoder.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens are kept, so ``decode(encode(t)) == t`` for byte-level tokenizers."""
        return self._encoder.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and configs loadable with ``AutoTokenizer.from_pretrained(directory)``."""
        self.hf.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, anchor_id={self.anchor_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id})")


def _wrap_byte_level(model: models.Model, name: str, use_regex: bool) -> Tokenizer:
    """Byte-level tokenizer around ``model`` with the <s> </s> <pad> specials; prepends <s> for HF users."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    bos = SPECIAL_TOKENS[0]
    # Training windows open with the BOS anchor, so HF-side encoding (inference) does too.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
                                 pad_token=SPECIAL_TOKENS[2], clean_up_tokenization_spaces=False)
    return Tokenizer(hf, name)


def byte_tokenizer() -> Tokenizer:
    """The ``byte`` tokenizer: id ``b`` is byte ``b`` of the UTF-8 text; 256 BOS, 257 EOS, 258 PAD.

    A byte-level BPE with no merges, so it round-trips any text exactly.
    """
    from nemo_anchor.compat import bytes_to_unicode

    char_of_byte = bytes_to_unicode()  # the printable stand-in ByteLevel uses for each byte
    vocab = {char_of_byte[b]: b for b in range(NUM_BYTES)}
    # No regex pre-split: with no merges, words are irrelevant and one word per text is fastest.
    return _wrap_byte_level(models.BPE(vocab=vocab, merges=[]), "byte", use_regex=False)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 pre-split, lossless) with HF ``tokenizers`` on ``texts``.

    Ids 0, 1, 2 are <s>, </s>, <pad>; the 256 bytes are always in the vocabulary, so any text encodes.
    Deterministic for a given sequence of texts.
    """
    smallest = NUM_BYTES + len(SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise ValueError(f"BPE vocab_size {vocab_size} is below {smallest} (256 bytes + {len(SPECIAL_TOKENS)} specials)")
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    return _wrap_byte_level(backend.model, f"bpe-{vocab_size}", use_regex=True)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """Load a tokenizer from ``spec``.

    Args:
        spec: ``"byte"``; a local Hugging Face tokenizer directory (``AutoTokenizer`` files, or a
            bare ``tokenizer.json`` whose BOS/EOS/PAD are recognised by their usual names, see
            ``BARE_SPECIAL_TOKENS``); or a directory holding one in a ``tokenizer/`` subdirectory,
            such as a packed dataset. Nothing is downloaded.

    Raises:
        ValueError: unknown spec, unloadable directory, a slow-only tokenizer, or no BOS and no EOS.
    """
    if str(spec) == "byte":
        return byte_tokenizer()
    path = Path(spec)
    if (path / TOKENIZER_SUBDIR).is_dir():
        path = path / TOKENIZER_SUBDIR
    if not path.is_dir():
        raise ValueError(f"tokenizer {str(spec)!r}: expected 'byte' or a local Hugging Face tokenizer directory")
    if (path / "tokenizer_config.json").is_file():
        return Tokenizer(_auto_tokenizer(path), str(path))
    if (path / "tokenizer.json").is_file():
        return Tokenizer(_bare_tokenizer(path / "tokenizer.json"), str(path))
    raise ValueError(f"cannot load a Hugging Face tokenizer from {path}: no tokenizer_config.json or tokenizer.json")


def _auto_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as error:  # what HF raises varies by file
        first_line = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        raise ValueError(f"cannot load a Hugging Face tokenizer from {path}: {first_line}") from error


def _bare_tokenizer(path: Path):
    """A ``tokenizer.json`` without configs: its special added tokens take the BOS/EOS/PAD roles by name."""
    from transformers import PreTrainedTokenizerFast

    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust loader raises a bare Exception
        raise ValueError(f"cannot load {path}: {error}") from error
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    roles = {role: next((name for name in names if name in special), None) for role, names in BARE_SPECIAL_TOKENS.items()}
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   **{role: name for role, name in roles.items() if name})


def check_same_tokenizer(data_tokenizer, data_source: str, model_tokenizer, model_source: str) -> None:
    """ValueError naming both unless the two tokenizers map the same tokens to the same ids.

    Either argument may be a :class:`Tokenizer` or a ``transformers`` tokenizer. Data tokenized by
    one and read by a model trained with the other gives meaningless losses and perplexities.
    """
    data_hf = getattr(data_tokenizer, "hf", data_tokenizer)
    model_hf = getattr(model_tokenizer, "hf", model_tokenizer)
    if data_hf.get_vocab() != model_hf.get_vocab():
        raise ValueError(
            f"{data_source} was tokenized with {_describe(data_tokenizer)} but {model_source} uses "
            f"{_describe(model_tokenizer)}: pack the data with the model's tokenizer (nemo-anchor pack --tokenizer)")


def _describe(tokenizer) -> str:
    hf = getattr(tokenizer, "hf", tokenizer)
    name = getattr(tokenizer, "name", None) or getattr(hf, "name_or_path", None) or type(hf).__name__
    return f"tokenizer {name!r} (vocabulary {len(hf)})"


def find_tokenizer(path: str | Path) -> Path | None:
    """The directory :func:`load_tokenizer` would read for ``path`` (itself or its ``tokenizer/``), or None."""
    path = Path(path)
    for candidate in (path / TOKENIZER_SUBDIR, path):
        if (candidate / "tokenizer_config.json").is_file() or (candidate / "tokenizer.json").is_file():
            return candidate
    return None
