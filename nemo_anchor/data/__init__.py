"""Packed-sequence data pipeline: documents in, anchor-ready windows with ``cu_seqlens`` out.

Knows nothing of Megatron or the model. See README.md in this folder for the on-disk format,
what the loss mask masks and why, and the options of ``nemo-anchor pack``.
"""
from nemo_anchor.data.dataset import PackedDataset, collate_windows, fixed_shape_batch, variable_shape_batch
from nemo_anchor.data.nemo_format import read_nemo_packed, write_nemo_packed
from nemo_anchor.data.pipeline import PackOptions, pack
from nemo_anchor.data.sampler import DEFAULT_SEED, WindowSampler, WindowStream, rank_microbatches
from nemo_anchor.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "DEFAULT_SEED",
    "PackOptions",
    "PackedDataset",
    "Tokenizer",
    "WindowSampler",
    "WindowStream",
    "rank_microbatches",
    "byte_tokenizer",
    "collate_windows",
    "fixed_shape_batch",
    "load_tokenizer",
    "pack",
    "read_nemo_packed",
    "train_bpe_tokenizer",
    "variable_shape_batch",
    "write_nemo_packed",
]
