"""``nemo-anchor pack``: documents in, anchor-ready packed windows out."""
from __future__ import annotations

import argparse

from nemo_anchor.data.pipeline import TRAIN_BPE_PREFIX, PackOptions, pack
from nemo_anchor.data.readers import ON_INVALID_UTF8
from nemo_anchor.data.stats import format_statistics

DESCRIPTION = """Pack documents into windows of exactly --seq-length tokens: the anchor (BOS, or EOS for
tokenizers without BOS) first, then documents each ended by EOS; a document that does not fit
continues in the next window after its anchor. Writes a memory-mapped dataset directory (temporary
directory, then rename) with its tokenizer, metadata, stats.json and a document-length histogram."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("pack", help="pack documents into anchor-ready windows", description=DESCRIPTION)
    io = parser.add_argument_group("inputs and outputs")
    io.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help="JSONL ({'text', optional 'domain'/'source'/'group'}), Parquet, text files, folders, "
                         "Megatron .bin/.idx (prefix or either file), NeMo packed .npy")
    io.add_argument("--tokenizer", required=True, metavar="SPEC",
                    help=f"'byte', a local Hugging Face tokenizer directory, or {TRAIN_BPE_PREFIX}VOCAB_SIZE to train "
                         "a byte-level BPE on the training documents")
    io.add_argument("--seq-length", type=int, required=True, metavar="N", help="tokens per window (>= 2)")
    io.add_argument("--output", required=True, metavar="DIR", help="dataset directory to create")
    io.add_argument("--overwrite", action="store_true",
                    help="replace an output directory an earlier `nemo-anchor pack` wrote (nothing else)")
    io.add_argument("--text-key", default="text", help="text field of JSONL/Parquet records (default: text)")
    io.add_argument("--on-invalid-utf8", choices=ON_INVALID_UTF8, default="error",
                    help="stop at a document that is not valid UTF-8 (naming file and line), or skip it")
    io.add_argument("--valid-fraction", type=float, default=0.0, metavar="F",
                    help="hold out this share of documents (whole 'group's) as DIR/valid, packed the same way")
    io.add_argument("--nemo", action="store_true",
                    help="also write NeMo 2 packed files: DIR/nemo/training_N.npy, validation_N.npy, N_metadata.jsonl")

    mix = parser.add_argument_group("document order and mixture")
    mix.add_argument("--shuffle", action="store_true", help="shuffle documents (seeded)")
    mix.add_argument("--seed", type=int, default=1234, help="seed of shuffling, upsampling, chunking, validation split")
    mix.add_argument("--min-doc-tokens", type=int, default=1, metavar="N", help="drop documents shorter than N tokens")
    mix.add_argument("--upsample-long", type=float, default=1.0, metavar="FACTOR", dest="upsample_factor",
                     help="per-source length upsampling (UpSampledMix): within each domain draw long documents "
                          "FACTOR times as often, keeping each domain's token count")
    mix.add_argument("--long-doc-tokens", type=int, default=4096, metavar="N",
                     help="documents of at least N tokens count as long (default: 4096)")
    mix.add_argument("--domain-tags", action="store_true",
                     help="'+ Tag': put a loss-masked domain tag before each document")
    mix.add_argument("--tag-template", default="<{domain}>\n", help="text of the domain tag (default: '<{domain}>\\n')")
    mix.add_argument("--interleave-chunks", type=int, default=1, metavar="K",
                     help="cut each training document into up to K chunks interleaved with other documents' "
                          "chunks of about one window, order within a document kept (Section 5.2)")
    mix.add_argument("--last-window", choices=("pad", "drop"), default="pad",
                     help="pad the last partial window (PAD, loss-masked) or drop it")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = PackOptions(
        seq_length=args.seq_length, shuffle=args.shuffle, seed=args.seed, min_doc_tokens=args.min_doc_tokens,
        upsample_factor=args.upsample_factor, long_doc_tokens=args.long_doc_tokens, domain_tags=args.domain_tags,
        tag_template=args.tag_template, interleave_chunks=args.interleave_chunks,
        drop_last=args.last_window == "drop", valid_fraction=args.valid_fraction,
        on_invalid_utf8=args.on_invalid_utf8, text_key=args.text_key)
    stats = pack(args.input, args.tokenizer, args.output, options, overwrite=args.overwrite, export_nemo=args.nemo)
    print(format_statistics(stats))
    print(f"packed dataset written to {args.output}")
    return 0
