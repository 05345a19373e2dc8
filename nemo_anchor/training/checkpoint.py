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
so a ``kill -9`` at any moment leaves the previous complete checkpoint; a full disk is named and
the partial checkpoint removed (:func:`nemo_anchor.atomic.write_faults_named`). Its ``CHECKSUMS``
manifest records every file's size and CRC-32; before loading they are checked, so a missing,
truncated or corrupt file is named and the trainer falls back to an older checkpoint
(:func:`pick_resumable`).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from nemo_anchor.atomic import atomic_file, write_faults_named
from nemo_anchor.convert.megatron_state import MASTER_PREFIX
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import optimizer_state

MODEL_PREFIX = "model."
CHECKSUMS = "checksums.json"  # {file: [bytes, CRC-32]} of every other file of the checkpoint, written at save
_CHUNK = 16 << 20


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
                    keep_last: int, save_every: int = 0) -> Path:
    """Save this rank's shards of the model, optimizer, ``train_state`` and RNG; returns the directory.

    Every tensor handed to ``dist_checkpointing`` is a view of the training state: nothing is
    gathered, and the only copy is the writer's host staging of what this rank writes
    (:func:`nemo_anchor.training.memory.checkpoint_peak`). Older checkpoints beyond ``keep_last``
    are then removed (:func:`evict_old_checkpoints`).
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
    with write_faults_named(final, tmp):  # a full disk is named, and the partial checkpoint removed
        dist_checkpointing.save(state, str(tmp))
        _barrier()
        if _rank() == 0:
            (tmp / "config.yaml").write_text(run_config_yaml)
        record_checksums(tmp)
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with atomic_file(run.latest_file) as latest:
            latest.write_text(str(step))
        evict_old_checkpoints(run, keep_last, save_every)
    _barrier()
    return final


def evict_old_checkpoints(run: RunDir, keep_last: int, save_every: int = 0) -> list[Path]:
    """Remove all but the newest checkpoint and the newest ``keep_last`` scheduled ones (every
    ``save_every`` steps; all of them when 0); returns the removed.

    An off-schedule checkpoint (a signal's, the last step's) is kept only while it is the newest: it
    exists to resume from, and must never push out a scheduled checkpoint that checkpoint averaging
    over the last ``keep_last`` saves needs."""
    saved = run.list_checkpoints()
    scheduled = [path for path in saved if not save_every or checkpoint_step(path) % save_every == 0]
    kept = set(scheduled[-keep_last:] + saved[-1:])
    removed = [path for path in saved if path not in kept]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def record_checksums(ckpt_dir: str | os.PathLike) -> None:
    """Write ``CHECKSUMS``: the size and CRC-32 of every file of a just-written checkpoint.

    Collective, after every rank has written its files: each rank reads its share of the files (a
    multi-GB checkpoint is read once, in parallel), rank 0 writes the manifest.
    """
    ckpt_dir = Path(ckpt_dir)
    names = _files(ckpt_dir) if _rank() == 0 else None
    names = _broadcast(names)
    mine = {name: [(ckpt_dir / name).stat().st_size, _crc32(ckpt_dir / name)] for name in names[_rank()::_world()]}
    every = _gather(mine)
    if _rank() == 0:
        sums = {name: value for part in every for name, value in part.items()}
        (ckpt_dir / CHECKSUMS).write_text(json.dumps(dict(sorted(sums.items())), indent=1))


def _broadcast(value):
    box = [value]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    every = [None] * _world()
    dist.all_gather_object(every, value)
    return every


def _damaged_files(ckpt_dir: Path, sums: dict, names: list[str]) -> dict[str, str]:
    """{file: what is wrong with it} for those of ``names`` that do not match the manifest."""
    problems = {}
    for name in names:
        path = ckpt_dir / name
        size, crc = sums[name]
        if not path.is_file():
            problems[name] = f"{path} is missing"
        elif path.stat().st_size != size:
            problems[name] = f"{path} has {path.stat().st_size} bytes, {CHECKSUMS} recorded {size}"
        elif _crc32(path) != crc:
            problems[name] = f"{path} is corrupt: its CRC-32 differs from the one {CHECKSUMS} recorded at save"
    return problems


def verify_files(ckpt_dir: str | os.PathLike) -> None:
    """CheckpointError naming the first missing, unreadable, truncated or corrupt file of a checkpoint.

    Collective. With a ``CHECKSUMS`` manifest (every checkpoint this trainer saves) each file's size
    and CRC-32 are compared, the ranks sharing the reading. Without one (a weights-only checkpoint)
    only metadata is read: ``metadata.json``, the common state (``common.pt`` up to megatron-core
    0.18, inside the torch_dist files from 0.19 on) and the tensor index, whose entries say
    how many bytes of which file each tensor occupies.
    """
    ckpt_dir = Path(ckpt_dir)
    problem = sums = None  # rank 0 reads them; every rank gets them
    if _rank() == 0:
        try:
            sums = json.loads((ckpt_dir / CHECKSUMS).read_text()) if (ckpt_dir / CHECKSUMS).is_file() else None
            if sums is None:
                _verify_against_index(ckpt_dir)
        except CheckpointError as err:
            problem, sums = str(err), None
        except (OSError, ValueError) as err:
            problem, sums = f"{ckpt_dir / CHECKSUMS} is unreadable ({err})", None
    problem, sums = _broadcast((problem, sums))
    if sums is not None:
        names = sorted(sums)
        found = {name: why for part in _gather(_damaged_files(ckpt_dir, sums, names[_rank()::_world()]))
                 for name, why in part.items()}
        problem = found[min(found)] if found else None
    if problem:
        raise CheckpointError(problem)


def _verify_against_index(ckpt_dir: Path) -> None:
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

    A damaged checkpoint is reported (``report(message)``, naming the bad file) and the next older
    one tried. Collective: rank 0 lists the checkpoints, the ranks share verifying them, every rank
    gets the same answer. Weights-only checkpoints are not resumable.
    """
    for candidate in reversed(_broadcast(run.list_checkpoints() if _rank() == 0 else None)):
        try:
            verify_files(candidate)
        except CheckpointError as err:
            report(f"warning: cannot resume from {candidate.name}: {err}; trying the previous checkpoint")
            continue
        return candidate if _broadcast(has_training_state(candidate) if _rank() == 0 else None) else None
    return None


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
        master = f"{MASTER_PREFIX}{value.key}"
        if master in stored:
            sharded[name] = value = replace(value, key=master)
        _check_global_shapes(value, stored, ckpt_dir)
    _load_model_weights(gpt, dist_checkpointing.load({"model": sharded}, str(ckpt_dir))["model"], ckpt_dir)
