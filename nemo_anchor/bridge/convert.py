"""Hugging Face <-> Megatron checkpoints through Megatron-Bridge's ``AutoBridge``, with our provider.

``import_hf`` gives a Megatron-Bridge checkpoint (``iter_0000000/`` with ``run_config.yaml``: a
starting point for ``nemo_anchor.bridge.pretrain`` via ``checkpoint.pretrained_checkpoint``)
whose model is :class:`AnchorGPTModelProvider`'s. ``export_hf`` turns it, or any checkpoint that
``pretrain`` saved from it, back into a Hugging Face directory. Both compare an HF directory's
weights with its config.json (``check_hf_dir``, as ``import-hf`` does): the source before an
import, the staged output before an export is published. Bridge's config translation needs
the original HF config and tokenizer as a reference; ``import_hf`` keeps them in ``hf_reference/``.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from nemo_anchor import launch
from nemo_anchor.bridge.provider import AnchorGPTModelProvider
from nemo_anchor.convert.hf_mapping import check_hf_dir
from nemo_anchor.parallel.distributed import initialize_parallel

HF_REFERENCE = "hf_reference"
# what Bridge reads from the reference: the config, generation defaults, and the tokenizer it re-saves
_REFERENCE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


def _check_paths(source: Path, out_dir: Path, what: str) -> None:
    if not source.exists():
        raise FileNotFoundError(f"{what} {source} does not exist")
    src, out = source.resolve(), out_dir.resolve()
    if out == src or src in out.parents or out in src.parents:
        raise ValueError(f"output {out_dir} overlaps the input {source}: choose a separate directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output {out_dir} is not empty: choose a new directory")


def _staging(out_dir: Path) -> Path:
    staging = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def _publish(staging: Path, out_dir: Path) -> Path:
    if out_dir.exists():
        out_dir.rmdir()  # checked empty before anything was written
    staging.replace(out_dir)
    return out_dir


def import_hf(hf_dir, out_dir, attention_type: str = "anchor") -> Path:
    """A Hugging Face Llama / Mistral / Qwen2 directory -> a Megatron-Bridge checkpoint at ``out_dir``."""
    from megatron.bridge import AutoBridge

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _check_paths(hf_dir, out_dir, "Hugging Face directory")
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir / 'config.json'} is missing: not a Hugging Face model directory")
    # transformers (under AutoBridge) fills a tensor the files lack, or a layer config.json adds, at random
    check_hf_dir(hf_dir)
    initialize_parallel()
    bridge = AutoBridge.from_hf_pretrained(str(hf_dir), torch_dtype=torch.float32)
    provider = AnchorGPTModelProvider.from_provider(bridge.to_megatron_provider(load_weights=False), attention_type)
    provider.perform_initialization = False  # every weight comes from the HF checkpoint
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False)
    bridge.load_hf_weights(model)
    staging = _staging(out_dir)
    bridge.save_megatron_model(model, str(staging), hf_tokenizer_path=str(hf_dir))
    (staging / HF_REFERENCE).mkdir()
    for name in _REFERENCE_FILES:
        if (hf_dir / name).is_file():
            shutil.copy2(hf_dir / name, staging / HF_REFERENCE / name)
    return _publish(staging, out_dir)


def find_reference(megatron_dir: Path) -> Path:
    """The HF reference of ``megatron_dir`` (an ``import_hf`` output, or a ``pretrain`` ``checkpoint.save``)."""
    reference = megatron_dir / HF_REFERENCE
    if not (reference / "config.json").is_file():
        raise FileNotFoundError(f"{reference / 'config.json'} is missing: export_hf reads checkpoints made by "
                                f"nemo_anchor.bridge.import_hf or nemo_anchor.bridge.pretrain")
    return reference


def export_hf(megatron_dir, hf_dir) -> Path:
    """A Megatron-Bridge checkpoint (its newest ``iter_*``) -> a Hugging Face directory at ``hf_dir``."""
    from megatron.bridge import AutoBridge

    megatron_dir, hf_dir = Path(megatron_dir), Path(hf_dir)
    _check_paths(megatron_dir, hf_dir, "Megatron checkpoint")
    reference = find_reference(megatron_dir)
    initialize_parallel()
    bridge = AutoBridge.from_auto_config(str(megatron_dir), str(reference))
    model = bridge.load_megatron_model(str(megatron_dir), wrap_with_ddp=False)
    staging = _staging(hf_dir)
    bridge.save_hf_pretrained(model, str(staging), show_progress=False, source_path=str(reference))
    try:  # every tensor its config.json describes written, and nothing else, before publishing
        check_hf_dir(staging)
    except ValueError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return _publish(staging, hf_dir)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m nemo_anchor.bridge.convert",
                                     description="Hugging Face <-> Megatron-Bridge checkpoints with AnchorAttention")
    commands = parser.add_subparsers(dest="command", required=True)
    to_megatron = commands.add_parser("import-hf", help="HF directory -> Megatron-Bridge checkpoint")
    to_megatron.add_argument("hf_dir")
    to_megatron.add_argument("out_dir")
    to_megatron.add_argument("--attention-type", default="anchor")
    to_hf = commands.add_parser("export-hf", help="Megatron-Bridge checkpoint (import-hf or pretrain output) -> HF")
    to_hf.add_argument("megatron_dir")
    to_hf.add_argument("hf_dir")
    args = parser.parse_args(argv)
    with launch.cpu_capable(f"{parser.prog} {args.command}"):  # converts on the CPU where an expected GPU is missing
        if args.command == "import-hf":
            print(import_hf(args.hf_dir, args.out_dir, args.attention_type))
        else:
            print(export_hf(args.megatron_dir, args.hf_dir))


if __name__ == "__main__":
    main()
