"""Megatron-Bridge's own ``pretrain()`` on packed windows with AnchorAttention.

    python -m nemo_anchor.bridge.pretrain --recipe anchor_smollm2_135m \\
        dataset.path=runs/packed checkpoint.pretrained_checkpoint=runs/smollm2-bridge \\
        checkpoint.save=runs/bridge-run checkpoint.load=runs/bridge-run train.train_iters=6
    python -m nemo_anchor.bridge.pretrain --config my-run.yaml ...   # a `nemo-anchor train` config as the recipe

Overrides name Bridge's ``ConfigContainer`` fields (``model.num_layers=2``, ``train.global_batch_size=2``,
``optimizer.lr=1e-3`` ...), plus ``dataset.path``, a ``nemo-anchor pack`` directory. Under torchrun
each process is one rank (gloo on the CPU), in any data, tensor, pipeline and context-parallel layout. ``metrics.jsonl`` is written under ``checkpoint.save``;
with ``checkpoint.load`` pointing there too, running the same command again resumes. SIGTERM, SIGINT and
SIGUSR1 save and exit 75 (``nemo_anchor.bridge.preemption``); a job that expects CUDA and sees none stops first
with one line (``nemo_anchor.launch.cuda``; ``NEMO_ANCHOR_ALLOW_CPU=1`` trains on the CPU).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from nemo_anchor import launch
from nemo_anchor.atomic import copy_directory_once
from nemo_anchor.bridge import run_guard
from nemo_anchor.bridge.convert import HF_REFERENCE
from nemo_anchor.bridge.preemption import stopping_as_every_door
from nemo_anchor.bridge.recipes import RECIPES, from_run_config, get_recipe
from nemo_anchor.bridge.training import MetricsCallback, anchor_forward_step
from nemo_anchor.model.vocab import padded_vocab_size
from nemo_anchor.parallel.context_parallel import pads_documents
from nemo_anchor.training.config import load_config
from nemo_anchor.training.preemption import start_checkpoint_writer_queue


def apply_overrides(config, overrides: list[str]) -> None:
    """``a.b=value`` sets field ``b`` of ``config.a`` (YAML value syntax); ValueError naming an unknown key."""
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep:
            raise ValueError(f"override {override!r} must look like key=value")
        *path, name = key.split(".")
        owner = config
        for i, part in enumerate(path):
            if not hasattr(owner, part):
                raise ValueError(f"unknown config key {'.'.join(path[:i + 1])} (in {override!r})")
            owner = getattr(owner, part)
        if not hasattr(owner, name):
            raise ValueError(f"unknown config key {key} (in {override!r})")
        setattr(owner, name, OmegaConf.from_dotlist([f"value={text}"])["value"])


def prepare(config) -> None:
    """Check the data against the model and size the vocabulary as ``nemo-anchor train`` does."""
    model, dataset = config.model, config.dataset
    dataset.seq_length = model.seq_length
    windows = dataset.open()
    if model.vocab_size is None:
        model.vocab_size = padded_vocab_size(windows.tokenizer.vocab_size, model.tensor_model_parallel_size)
    windows.check_token_ids(model.vocab_size)
    config.tokenizer.vocab_size = model.vocab_size
    if model.pipeline_model_parallel_size > 1 and (
            config.train.micro_batch_size > 1 or pads_documents(model.attention_type, model.context_parallel_size)):
        # Bridge's schedule sizes the activations sent between stages as [seq_length / cp, micro-batch,
        # hidden]; a THD pack is [micro-batch * seq_length / cp, 1, hidden], longer where context
        # parallelism pads documents: the stages send each shape ahead (as nemo-anchor train does)
        model.variable_seq_lengths = True
    if not config.checkpoint.save:
        raise ValueError("checkpoint.save is not set: give the run's output directory")
    start = config.checkpoint.pretrained_checkpoint
    # export_hf of this run needs the HF model it started from. The launch's ranks all run this before
    # Bridge initialises torch.distributed, on any host sharing the folder: the global rank 0 copies it,
    # and a copy published first by another launch is kept
    if launch.global_rank() == 0 and start and (Path(start) / HF_REFERENCE).is_dir():
        copy_directory_once(Path(start) / HF_REFERENCE, Path(config.checkpoint.save) / HF_REFERENCE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nemo_anchor.bridge.pretrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--recipe", choices=sorted(RECIPES))
    source.add_argument("--config", help="a `nemo-anchor train` YAML file: its run, configured for Bridge")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: measured)")
    parser.add_argument("--allow-change", action="append", default=[], metavar="KEY[,KEY]",
                        help="keys a resume may change, as nemo-anchor train --allow-change (optim.lr, ...)")
    parser.add_argument("overrides", nargs="*", help="ConfigContainer overrides, key=value")
    args = parser.parse_intermixed_args(argv)
    try:
        config = get_recipe(args.recipe) if args.recipe else from_run_config(load_config(args.config))
        apply_overrides(config, args.overrides)
        launch.resolve_bridge_config(config)  # this process's devices decide what the recipe left to them
    except launch.CudaExpected as error:  # a GPU job that sees no GPU: one line, before anything is written
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if launch.global_rank() == 0:
        print(f"{parser.prog}: {launch.devices()}", flush=True)
    allow_change = [key for value in args.allow_change for key in value.split(",") if key]
    with run_guard.claimed(config) as guard:  # the lock, resume comparison, tokenizer check, exit status
        prepare(config)
        with run_guard.checked(config, allow_change, guard) as guards:
            _pretrain(config, [MetricsCallback(args.peak_tflops), *guards])


def _pretrain(config, callbacks: list) -> None:
    from megatron.bridge.training.pretrain import pretrain

    # SIGTERM, SIGINT and SIGUSR1 save and stop with one line and status 75, the processes Bridge starts survive a
    # group signal, and the distributed optimizer resumes exactly over torch's Adam (nemo_anchor.bridge.preemption)
    with stopping_as_every_door(config) as stops:
        # the writer's result queue, forked now rather than spawned by the first save, which may be a stop's
        # (a spawned one imports this whole stack again: 20-40 s per run here)
        start_checkpoint_writer_queue(config.checkpoint.async_write_results_mp_mode)
        pretrain(config, anchor_forward_step, callbacks=[*callbacks, stops])


if __name__ == "__main__":
    main()
