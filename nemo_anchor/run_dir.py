"""The layout of a training ``output_dir``: the one place that knows where things live in it.

::

    config.yaml                      effective run config
    tokenizer/                       HF tokenizer files (AutoTokenizer loads them offline)
    metrics.jsonl, tensorboard/      what the trainer logged
    checkpoints/iter_0000100/        one dist_checkpointing directory per saved step
        config.yaml                  the run config again, so the directory stands alone
    checkpoints/latest_checkpointed_iteration.txt
    .nemo-anchor-train.lock          while a run writes into it: its lease (host, pid, job, last renewal)

The trainer writes it, ``import-hf`` writes a weights-only one (step 0), export and evaluation
read it. A checkpoint is written under a hidden staging name and renamed into ``iter_NNNNNNN``
when complete, so every ``iter_*`` directory is a finished one.

One run writes into an ``output_dir`` at a time: its lease (``LOCK_FILE``) is :mod:`nemo_anchor.run_lease`'s.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ITER_PATTERN = re.compile(r"^iter_(\d{7})$")
LATEST_FILE = "latest_checkpointed_iteration.txt"
LOCK_FILE = ".nemo-anchor-train.lock"


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def checkpoint_step(ckpt_dir: str | os.PathLike) -> int:
    match = ITER_PATTERN.match(Path(ckpt_dir).name)
    if not match:
        raise ValueError(f"not a checkpoint directory name (iter_NNNNNNN): {ckpt_dir}")
    return int(match.group(1))


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return bool(ITER_PATTERN.match(path.name)) and (path / "metadata.json").is_file()


@dataclass(frozen=True)
class RunDir:
    """Paths inside one training ``output_dir``."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_file(self) -> Path:
        return self.checkpoints / LATEST_FILE

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / iter_dir_name(step)

    def list_checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first."""
        return list_checkpoints(self.checkpoints)


def list_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint directories under ``checkpoints_dir``, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and ITER_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_step)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A training output_dir -> its latest checkpoint; a checkpoint directory -> itself (unverified: readers
    call :func:`nemo_anchor.checksums.verified_checkpoint`)."""
    return checkpoints_of(path)[-1]


def checkpoints_of(path: str | os.PathLike) -> list[Path]:
    """A checkpoint directory -> ``[itself]``; a training output_dir (or its ``checkpoints/``) -> its
    checkpoints, oldest first. FileNotFoundError when there are none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path does not exist: {path}")
    if is_checkpoint_dir(path):
        return [path]
    for root in (RunDir(path).checkpoints, path):
        found = list_checkpoints(root)
        if found:
            return found
    raise FileNotFoundError(
        f"no checkpoint under {path}: expected an output_dir with checkpoints/iter_NNNNNNN/ or a "
        f"checkpoint directory iter_NNNNNNN containing metadata.json")


def read_run_config(ckpt_dir: str | os.PathLike):
    """The run config saved with a checkpoint (OmegaConf DictConfig)."""
    from omegaconf import OmegaConf

    path = Path(ckpt_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt_dir} has no config.yaml")
    return OmegaConf.load(path)


def run_dir_of(ckpt_dir: str | os.PathLike) -> RunDir:
    """The output_dir a checkpoint directory ``OUTPUT_DIR/checkpoints/iter_N`` belongs to."""
    return RunDir(Path(ckpt_dir).parent.parent)
