"""Training checkpoints with Megatron ``dist_checkpointing``, written atomically.

The layout of the run directory is :mod:`nemo_anchor.run_dir`'s.

A checkpoint is saved into ``checkpoints/.tmp.iter_*`` and renamed when every rank has
finished, so a ``kill -9`` at any moment leaves the previous complete checkpoint loadable.
Model weights are sharded fp32 tensors under ``model.`` (in bf16 runs: the optimizer's fp32
master weights, so resuming is exact and exports keep full precision); optimizer, scheduler and data-sampler state
are replicated across data-parallel ranks and saved once; RNG state is saved per rank.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from nemo_anchor.run_dir import LATEST_FILE, checkpoint_step, iter_dir_name, list_checkpoints, resolve_checkpoint  # noqa: F401


def has_training_state(ckpt_dir: str | os.PathLike) -> bool:
    """False for a weights-only checkpoint (``import-hf`` output): start from it, do not resume it."""
    return "extra" in (dist_checkpointing.load_common_state_dict(str(ckpt_dir)) or {})


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_object(state) -> ShardedObject:
    return ShardedObject("rng_state", state, (_world(),), (_rank(),), replica_id=0)


def _model_state(model, weights: dict[int, torch.Tensor] | None = None) -> dict:
    """The model's sharded state dict, each tensor swapped for ``weights[data_ptr]`` when given."""
    sharded = model.sharded_state_dict(prefix="model.")
    for value in sharded.values():
        if weights and isinstance(value, ShardedTensor) and value.data.data_ptr() in weights:
            value.data = weights[value.data.data_ptr()]
            value.dtype = value.data.dtype
    return sharded


def save_checkpoint(output_dir: str | os.PathLike, step: int, model, extra_state: dict,
                    run_config_yaml: str, keep_last: int, weights: dict[int, torch.Tensor] | None = None) -> Path:
    """Save model (sharded), ``extra_state`` (replicated: optimizer, scheduler, sampler) and RNG.

    ``weights`` maps a parameter's ``data_ptr`` to the tensor to store for it (fp32 masters).
    """
    checkpoints = Path(output_dir) / "checkpoints"
    final = checkpoints / iter_dir_name(step)
    tmp = checkpoints / f".tmp.{final.name}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = {
        "model": _model_state(model, weights),
        "extra": extra_state,
        "rng": _rng_object({"torch": torch.get_rng_state()}),
    }
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _rank() == 0:
        (tmp / "config.yaml").write_text(run_config_yaml)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = checkpoints / f".{LATEST_FILE}.tmp"
        latest_tmp.write_text(str(step))
        os.replace(latest_tmp, checkpoints / LATEST_FILE)
        for old in list_checkpoints(checkpoints)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint_state(ckpt_dir: str | os.PathLike, model, extra_template: dict,
                          weights: dict[int, torch.Tensor] | None = None) -> tuple[dict, dict]:
    """Load the RNG state; returns (fp32 model weights by parameter name, saved ``extra_state``).

    ``extra_template`` has the same structure as the saved extra state (e.g. a fresh optimizer's
    ``state_dict()``); only its keys matter, values come from the checkpoint. ``weights`` as for
    :func:`save_checkpoint` gives the dtype to load into.
    """
    state = {
        "model": _model_state(model, weights),
        "extra": extra_template,
        "rng": _rng_object(None),
    }
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    torch.set_rng_state(loaded["rng"]["torch"])
    return _strip_prefix(loaded["model"], "model."), loaded["extra"]


def load_model_weights(model, ckpt_dir: str | os.PathLike) -> None:
    """Load only the model weights of a training checkpoint into ``model``."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"not a dist_checkpointing directory (no metadata.json): {ckpt_dir}")
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(prefix="model.")}, str(ckpt_dir))
    missing, unexpected = model.load_state_dict(_strip_prefix(loaded["model"], "model."), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"checkpoint {ckpt_dir} lacks model weights: {missing[:5]}")


def _strip_prefix(state: dict, prefix: str) -> dict:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
