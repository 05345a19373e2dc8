"""The ablation YAML: the trainer's ``model``/``trainer``/``optim``/``checkpoint`` sections, plus
``pack`` (the documents every variant is packed from) and ``eval`` (how every variant is measured).

There is no ``output_dir`` and no ``data`` section: the command owns both (see :mod:`.plan`).
``load_ablation_config`` merges schema defaults <- YAML <- ``key=value`` overrides and checks
everything a run needs before anything is packed or trained; errors name the file, key and value.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_anchor.data import PackOptions
from nemo_anchor.evaluation.models import DTYPES
from nemo_anchor.evaluation.ruler import TASKS
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.training.config import CheckpointConfig, OptimConfig, TrainerConfig


@dataclass
class PackSection:
    """Documents and packing shared by every variant (``nemo-anchor pack`` options of the same names)."""

    inputs: List[str] = field(default_factory=list)  # JSONL / Parquet / text files or folders
    tokenizer: str = "byte"  # "byte", a local HF tokenizer directory, or train-bpe:VOCAB
    valid_fraction: float = 0.05  # held-out documents: the evaluation data of every variant
    shuffle: bool = True
    seed: int = 1234
    min_doc_tokens: int = 1
    text_key: str = "text"
    tag_template: str = "<{domain}>\n"  # the +tag variants' domain tag
    interleave_chunks: int = 4  # the +interleave variants: documents cut into up to this many chunks

    def options(self, seq_length: int, packing: str) -> PackOptions:
        """The PackOptions of one packing (plain | tag | interleave); only the option differs."""
        return PackOptions(
            seq_length=seq_length, shuffle=self.shuffle, seed=self.seed, min_doc_tokens=self.min_doc_tokens,
            domain_tags=packing == "tag", tag_template=self.tag_template,
            interleave_chunks=self.interleave_chunks if packing == "interleave" else 1,
            valid_fraction=self.valid_fraction, text_key=self.text_key)


@dataclass
class EvalSection:
    """How every variant is measured, on the held-out split of the plain packing."""

    lengths: List[int] = field(default_factory=list)  # RULER context lengths; empty: [model.seq_length]
    last_k: int = 2  # average over the last K checkpoints (checkpoint.keep_last is raised to K)
    tasks: List[str] = field(default_factory=lambda: list(TASKS))
    num_samples: int = 4  # RULER samples per task and length
    max_new_tokens: Optional[int] = None  # override every task's generation budget
    seed: int = 0  # of the generated RULER samples
    perplexity_windows: int = 8  # held-out windows for perplexity by position
    perplexity_buckets: int = 8
    probe_sequences: int = 2  # BF16 probe sequences; 0 skips the probe
    probe_sequence_length: int = 256
    dtype: str = "bf16"  # of the evaluated models: bf16 | fp16 | fp32
    device: str = "cpu"


@dataclass
class AblationConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    pack: PackSection = field(default_factory=PackSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def ruler_lengths(self) -> list[int]:
        return list(self.eval.lengths) or [self.model.seq_length]

    def num_checkpoints(self) -> int:
        """Checkpoints a run keeps at the end: every save_every steps and the last step, at most keep_last."""
        steps, every = self.trainer.max_steps, self.checkpoint.save_every
        saved = (steps // every + bool(steps % every)) if every else 1
        return min(saved, self.checkpoint.keep_last)


def load_ablation_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = (), *,
                         eval_lengths: list[int] | None = None, last_k: int | None = None) -> AblationConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides <- ``--eval-lengths``/``--last-k``, validated.

    ``checkpoint.keep_last`` is raised to ``eval.last_k``, and ``trainer.eval_every`` (when 0) set to
    ``checkpoint.save_every``, so each of the last K checkpoints has its held-out loss.
    """
    where = f"invalid ablation config {path}"
    if not Path(path).is_file():
        raise FileNotFoundError(f"ablation config file not found: {path}")
    bad_overrides = [item for item in overrides if "=" not in item]
    if bad_overrides:
        raise ValueError(f"overrides must look like key=value, got {bad_overrides}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(AblationConfig), OmegaConf.load(path),
                                 OmegaConf.from_dotlist(list(overrides)))
        if eval_lengths:
            merged.eval.lengths = list(eval_lengths)
        if last_k is not None:
            merged.eval.last_k = last_k
        config: AblationConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(f"{where}: {err.msg} (key: {err.full_key})") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    try:
        return validate(config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def validate(config: AblationConfig) -> AblationConfig:
    """Checks beyond the trainer's (each variant's RunConfig is validated by the plan)."""
    def bad(key, value, why):
        raise ValueError(f"{key}={value!r}: {why}")

    p, e, c, t = config.pack, config.eval, config.checkpoint, config.trainer
    if config.model.init_from_hf and not Path(config.model.init_from_hf).exists():
        bad("model.init_from_hf", config.model.init_from_hf, "does not exist: the weights every variant starts from")
    if not p.inputs:
        bad("pack.inputs", list(p.inputs), "list the documents every variant is packed from")
    for item in p.inputs:
        if not Path(item).exists():
            bad("pack.inputs", item, "does not exist")
    if not 0 < p.valid_fraction < 1:
        bad("pack.valid_fraction", p.valid_fraction, "must lie in (0, 1): the held-out split is the evaluation data")
    if p.interleave_chunks < 2:
        bad("pack.interleave_chunks", p.interleave_chunks, "must be >= 2 (the +interleave variants cut documents)")
    p.options(config.model.seq_length, "tag").check()
    if e.last_k < 1:
        bad("eval.last_k", e.last_k, "must be >= 1")
    c.keep_last = max(c.keep_last, e.last_k)
    if config.num_checkpoints() < e.last_k:
        bad("checkpoint.save_every", c.save_every,
            f"trainer.max_steps={t.max_steps} leaves {config.num_checkpoints()} checkpoint(s), fewer than "
            f"eval.last_k={e.last_k}: save every max_steps/last_k steps or less")
    if t.eval_every == 0:
        t.eval_every = c.save_every
    elif c.save_every % t.eval_every:
        bad("trainer.eval_every", t.eval_every,
            f"must divide checkpoint.save_every={c.save_every} so every checkpoint has its held-out loss")
    unknown = sorted(set(e.tasks) - set(TASKS))
    if unknown:
        bad("eval.tasks", unknown, f"unknown; choose from {sorted(TASKS)}")
    if min(config.ruler_lengths()) < 2:
        bad("eval.lengths", list(e.lengths), "must be positive token counts")
    if e.dtype not in DTYPES:
        bad("eval.dtype", e.dtype, f"choose one of {sorted(DTYPES)}")
    for key in ("num_samples", "perplexity_windows", "perplexity_buckets"):
        if getattr(e, key) < 1:
            bad(f"eval.{key}", getattr(e, key), "must be >= 1")
    if e.probe_sequences < 0 or e.probe_sequence_length < 2:
        bad("eval.probe_sequences", (e.probe_sequences, e.probe_sequence_length),
            "need probe_sequences >= 0 and probe_sequence_length >= 2")
    if e.probe_sequence_length > config.model.seq_length:
        bad("eval.probe_sequence_length", e.probe_sequence_length,
            f"must be <= model.seq_length={config.model.seq_length} (probe sequences are held-out windows)")
    return config


def to_yaml(config: AblationConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
