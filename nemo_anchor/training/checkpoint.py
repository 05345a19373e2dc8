"""Training checkpoints with Megatron ``dist_checkpointing``: every rank writes and reads its own shards.

One checkpoint directory (layout: :mod:`nemo_anchor.run_dir`) holds

- ``model.*``: the fp32 weights in model space, sharded as the model is (tensor and pipeline
  parallel), one replica written. In bf16 runs these are the optimizer's fp32 *master* weights,
  gathered parameter by parameter from the distributed optimizer's shards, so exports and new runs
  started from a checkpoint (``model.init_from_hf``) get full precision from any layout;
- ``optimizer.*``: Megatron's distributed-optimizer state in its ``dp_reshardable`` format (each
  data x context-parallel rank writes its own slice of the fp32 masters and Adam moments; a
  resume may change the data- or context-parallel size, not the tensor/pipeline split), or the
  plain optimizer's state when ``trainer.distributed_optimizer`` is off;
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
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from nemo_anchor.atomic import atomic_file, write_faults_named
from nemo_anchor.run_dir import RunDir, checkpoint_step

MODEL_PREFIX = "model."
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
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


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def fp32_master_weights(optimizer, params: list[torch.nn.Parameter]) -> dict[int, torch.Tensor]:
    """``param.data_ptr()`` -> the full fp32 master of each bf16 parameter (fp32 parameters are their own).

    With the distributed optimizer every data x context-parallel rank holds a contiguous slice of
    each master; the slices are summed into the full tensor over that group, one parameter at a
    time, so only one parameter's fp32 copy exists at once beyond what training holds anyway.
    Collective: every rank of the group calls it with the same parameters.
    """
    masters = {}
    for opt in _optimizers(optimizer):
        if hasattr(opt, "model_param_gbuf_map"):  # DistributedOptimizer
            for buffer in opt.buffers:
                for param in buffer.params:
                    if param.dtype == torch.float32:
                        continue
                    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                    if param in opt.model_param_group_index_map:
                        owned = opt._get_model_param_range_map(param)["param"]
                        full[owned.start:owned.end] = opt._get_main_param_and_optimizer_states(param)["param"]
                    dist.all_reduce(full, group=opt.data_parallel_group)
                    masters[param.data_ptr()] = full.view(param.shape)
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for model_group, master_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for param, master in zip(model_group, master_group):
                    masters[param.data_ptr()] = master.detach()
    missing = [p for p in params if p.dtype != torch.float32 and p.data_ptr() not in masters]
    if missing:
        raise RuntimeError(f"no fp32 master for {len(missing)} bf16 parameters of shapes "
                           f"{[tuple(p.shape) for p in missing[:3]]}")
    return masters


def _with_weights(sharded: dict, weights: dict[int, torch.Tensor]) -> dict:
    """The model's sharded state dict with every tensor swapped for ``weights[data_ptr]`` when given."""
    for value in sharded.values():
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data.data_ptr() in weights:
            value.data = weights[value.data.data_ptr()]
            if isinstance(value, ShardedTensor):
                value.dtype = value.data.dtype
    return sharded


def save_checkpoint(run: RunDir, step: int, engine, train_state: dict, run_config_yaml: str,
                    keep_last: int, save_every: int = 0) -> Path:
    """Save this rank's shards of the model (fp32), optimizer, ``train_state`` and RNG; returns the directory.

    Older checkpoints beyond ``keep_last`` are then removed (:func:`evict_old_checkpoints`)."""
    final = run.checkpoint(step)
    tmp = run.checkpoints / f".tmp.{final.name}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    gpt = engine.gpt
    masters = fp32_master_weights(engine.optimizer, list(gpt.parameters()))
    model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    state = {
        # the optimizer's sharded state refers to the model's bf16 tensors: build it before the swap
        "optimizer": engine.optimizer.sharded_state_dict(model_state, metadata=_OPTIMIZER_FORMAT),
        "train": {**train_state, "layout": layout(), "scheduler": engine.scheduler.state_dict()},
        "rng": _rng_object(_rng_state()),
    }
    state["model"] = _with_weights(engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX), masters)
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
    only metadata is read: ``metadata.json``, ``common.pt`` and the tensor index, whose entries say
    how many bytes of which file each tensor occupies.
    """
    ckpt_dir = Path(ckpt_dir)
    problem = None
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
    for name in ("metadata.json", "common.pt", ".metadata"):
        if not (ckpt_dir / name).is_file():
            raise CheckpointError(f"{ckpt_dir / name} is missing")
    try:
        with open(ckpt_dir / ".metadata", "rb") as handle:
            index = pickle.load(handle)
        torch.load(ckpt_dir / "common.pt", map_location="cpu", weights_only=False)
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
    """Restore model, optimizer, scheduler and RNG from ``ckpt_dir``; returns its ``train`` state.

    Raises CheckpointError when the checkpoint was saved with another tensor or pipeline split
    (its optimizer state cannot be resharded across those).
    """
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    saved, now = common["train"]["layout"], layout()
    for key, name in (("tensor", "model.tensor_model_parallel_size"), ("pipeline", "model.pipeline_model_parallel_size")):
        if saved[key] != now[key]:
            raise CheckpointError(
                f"{ckpt_dir} was saved with {name}={saved[key]}, this run has {now[key]}: its optimizer state "
                f"can be resharded across data and context parallelism only. Resume with {name}={saved[key]}, or "
                f"start a new run from its weights with model.init_from_hf={ckpt_dir}")
    gpt = engine.gpt
    for opt in _optimizers(engine.optimizer):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values"):  # as Megatron-LM does before a load:
            opt._init_optimizer_states_with_dummy_values()  # Adam state to load into (values replaced)
    model_state = engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX)
    state = {"optimizer": engine.optimizer.sharded_state_dict(model_state, is_loading=True,
                                                               metadata=_OPTIMIZER_FORMAT)}
    # the weights are read as the fp32 that was saved, then rounded into bf16 parameters exactly as
    # the optimizer rounds its masters after a step
    fp32 = {p.data_ptr(): torch.empty(p.shape, dtype=torch.float32, device=p.device)
            for p in gpt.parameters() if p.dtype != torch.float32}
    state["model"] = _with_weights(engine.gpt.sharded_state_dict(prefix=MODEL_PREFIX), fp32)
    if saved == now:  # per-rank RNG state means something only in the same layout
        state["rng"] = _rng_object(None)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    weights = {k[len(MODEL_PREFIX):]: v for k, v in loaded["model"].items() if k.startswith(MODEL_PREFIX)}
    missing, _ = gpt.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir} lacks model weights: {missing[:5]}")
    with torch.no_grad():  # fp32 runs: the masters are views of the parameters
        engine.optimizer.load_state_dict(loaded["optimizer"])
    _set_adam_step(engine.optimizer, int(loaded["train"]["step"]))
    engine.scheduler.load_state_dict(loaded["train"]["scheduler"])
    if "rng" in loaded:
        _set_rng_state(loaded["rng"])
    return loaded["train"]


def _set_adam_step(optimizer, step: int) -> None:
    """Set torch AdamW's per-parameter step count to ``step``.

    Megatron-Core 0.16.1's ``dp_reshardable`` load copies this count from the placeholder state
    it loads into rather than from the checkpoint (TE's and apex's FusedAdam keep it in the param
    groups and are unaffected). Every training step is one optimizer step here (a skipped step is
    an error), so the checkpoint's step is the count.
    """
    for opt in _optimizers(optimizer):
        for state in getattr(opt.optimizer, "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = torch.tensor(float(step), dtype=state["step"].dtype, device=state["step"].device)


def load_weights(gpt: torch.nn.Module, ckpt_dir: str | os.PathLike) -> None:
    """Load the fp32 weights of a checkpoint (training or weights-only, any parallel layout) into ``gpt``."""
    loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict(prefix=MODEL_PREFIX)}, str(ckpt_dir))
    weights = {k[len(MODEL_PREFIX):]: v for k, v in loaded["model"].items() if k.startswith(MODEL_PREFIX)}
    missing, _ = gpt.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise CheckpointError(f"{ckpt_dir} lacks model weights: {missing[:5]}")

