"""Training checkpoints with Megatron ``dist_checkpointing``: every rank writes and reads its own shards.

One checkpoint directory (layout: :mod:`nemo_anchor.run_dir`) holds

- ``model.*``: the model's own ``sharded_state_dict()`` (its parameters in their dtype, sharded
  as the model is, one replica written);
- ``optimizer.*``: the optimizer state in model space (:mod:`nemo_anchor.training.optimizer_state`):
  Adam's moments and, for bf16 parameters, their fp32 masters (``optimizer.state.fp32_param.*``),
  each rank writing the slice it owns. Any tensor x pipeline x context x data layout can resume
  it, and exports and new runs (``model.init_from_hf``) read full-precision weights from it;
- ``train``: step, scheduler and sampler state (small, replicated); ``rng``: each rank's RNG state.

A checkpoint is written into ``checkpoints/.tmp.iter_*`` and renamed when every rank has finished,
so a ``kill -9`` at any moment leaves the previous complete checkpoint. Before loading, the
files a checkpoint's metadata refers to are checked, so a truncated or missing file is named
and the trainer can fall back to an older checkpoint (:func:`pick_resumable`).
"""
from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import optimizer_state

MODEL_PREFIX = "model."


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file or key."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def layout() -> dict:
    """The parallel layout a checkpoint is saved with (recorded, and compared on resume)."""
    return {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
            "context": parallel_state.get_context_parallel_world_size(),
            "data": parallel_state.get_data_parallel_world_size(),
            "world": _world()}


def _rng_object(state) -> ShardedObject:
    return ShardedObject("rng_state", state, (_world(),), (_rank(),), replica_id=0)


def _rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run: RunDir, step: int, engine, train_state: dict, run_config_yaml: str,
                    keep_last: int) -> Path:
    """Save this rank's shards of the model, optimizer, ``train_state`` and RNG; returns the directory.

    Every tensor handed to ``dist_checkpointing`` is a view of the training state: nothing is
    gathered, and the only copy is the writer's host staging of what this rank writes
    (:func:`nemo_anchor.training.memory.checkpoint_peak`).
    """
    final = run.checkpoint(step)
    tmp = run.checkpoints / f".tmp.{final.name}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    state = {
        "model": model_state,
        "optimizer": optimizer_state.sharded_state(engine.optimizer, model_state, is_loading=False),
        "train": {**train_state, "layout": layout(), "scheduler": engine.scheduler.state_dict(),
                  "distributed_optimizer": optimizer_state.is_distributed(engine.optimizer)},
        "rng": _rng_object(_rng_state()),
    }
    dist_checkpointing.save(state, str(tmp))
    _barrier()
    if _rank() == 0:
        (tmp / "config.yaml").write_text(run_config_yaml)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = run.checkpoints / f".{run.latest_file.name}.tmp"
        latest_tmp.write_text(str(step))
        os.replace(latest_tmp, run.latest_file)
        for old in run.list_checkpoints()[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def verify_files(ckpt_dir: str | os.PathLike) -> None:
    """CheckpointError naming the first missing, unreadable or truncated file of a checkpoint.

    Reads only metadata: ``metadata.json``, the common state and the tensor index, whose entries
    say how many bytes of which file each tensor occupies. (Megatron-Core before 0.19 keeps the
    common state in ``common.pt``; later versions inside the checkpoint's own files.)
    """
    ckpt_dir = Path(ckpt_dir)
    for name in ("metadata.json", ".metadata"):
        if not (ckpt_dir / name).is_file():
            raise CheckpointError(f"{ckpt_dir / name} is missing")
    try:
        with open(ckpt_dir / ".metadata", "rb") as handle:
            index = pickle.load(handle)
        dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"{ckpt_dir}: unreadable checkpoint metadata ({type(err).__name__}: {err})") from None
    needed: dict[str, int] = {}
    for info in index.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if path.stat().st_size < size:
            raise CheckpointError(f"{path} is truncated: {path.stat().st_size} bytes, the checkpoint index "
                                  f"needs {size}")


def has_training_state(ckpt_dir: str | os.PathLike) -> bool:
    """False for a weights-only checkpoint (``import-hf`` output): start from it, do not resume it."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir)) or {}
    return "train" in common


def pick_resumable(run: RunDir, report) -> Path | None:
    """The newest complete checkpoint with training state whose files are intact, or None.

    A damaged checkpoint is reported (``report(message)``) and the next older one tried. Rank 0
    decides; every rank gets the same answer. Weights-only checkpoints are not resumable.
    """
    chosen = [None]
    if _rank() == 0:
        for candidate in reversed(run.list_checkpoints()):
            try:
                verify_files(candidate)
            except CheckpointError as err:
                report(f"warning: cannot resume from {candidate.name}: {err}; trying the previous checkpoint")
                continue
            if has_training_state(candidate):
                chosen[0] = str(candidate)
            break
    if dist.is_initialized():
        dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0]) if chosen[0] else None


def load_checkpoint(ckpt_dir: str | os.PathLike, engine) -> dict:
    """Restore model, optimizer, scheduler and RNG from ``ckpt_dir``, saved in any parallel layout;
    returns its ``train`` state. The RNG state is restored only when the layout is the same."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    saved, now = common["train"]["layout"], layout()
    distributed = optimizer_state.is_distributed(engine.optimizer)
    if common["train"].get("distributed_optimizer") != distributed:
        raise CheckpointError(f"{ckpt_dir} was not saved with trainer.distributed_optimizer={distributed} (or by "
                              f"an older nemo-anchor): resume it with the setting and version that wrote it, or start "
                              f"a new run from its weights with model.init_from_hf={ckpt_dir}")
    optimizer_state.prepare_load(engine.optimizer, common["optimizer"])
    model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    state = {"model": model_state,
             "optimizer": optimizer_state.sharded_state(engine.optimizer, model_state, is_loading=True)}
    targets = optimizer_state.load_targets(engine.optimizer, state["optimizer"])
    if saved == now:  # per-rank RNG state means something only in the same layout
        state["rng"] = _rng_object(None)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    _load_model_weights(engine.gpt, loaded["model"], ckpt_dir)
    optimizer_state.finish_load(engine.optimizer, loaded["optimizer"], targets)
    engine.scheduler.load_state_dict(loaded["train"]["scheduler"])
    if "rng" in loaded:
        _set_rng_state(loaded["rng"])
    return loaded["train"]


def _check_global_shapes(value, stored: dict, ckpt_dir) -> None:
    """CheckpointError unless the checkpoint holds every tensor of ``value`` with the model's shape
    (dist_checkpointing would otherwise fill a larger vocabulary's extra rows without a word)."""
    for part in optimizer_state.parts(value):
        saved = stored.get(part.key)
        if saved is None:
            raise CheckpointError(f"{ckpt_dir} has no weights for {part.key}")
        if tuple(saved.global_shape) != tuple(part.global_shape):
            raise CheckpointError(f"{ckpt_dir}: {part.key} has shape {tuple(saved.global_shape)}, the model being "
                                  f"trained has {tuple(part.global_shape)}")


def _load_model_weights(gpt: torch.nn.Module, loaded: dict, ckpt_dir) -> None:
    weights = {k[len(MODEL_PREFIX):]: v for k, v in loaded.items() if k.startswith(MODEL_PREFIX)}
    missing, _ = gpt.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir} lacks model weights: {missing[:5]}")


def load_weights(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Load a checkpoint's full-precision weights (training or weights-only, any parallel layout) into
    ``gpt``, this rank's shards only.

    A bf16 run's parameters are saved in bf16; their fp32 masters are the optimizer's
    ``optimizer.state.fp32_param.*`` entries, which are read instead where the checkpoint has them.
    """
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    sharded = gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    for name, value in sharded.items():
        if not isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            continue
        master = f"{optimizer_state.MASTER_PREFIX}{value.key}"
        if master in stored:
            sharded[name] = value = replace(value, key=master)
        _check_global_shapes(value, stored, ckpt_dir)
    _load_model_weights(gpt, dist_checkpointing.load({"model": sharded}, str(ckpt_dir))["model"], ckpt_dir)
