"""Training checkpoints with Megatron ``dist_checkpointing``: what one holds, and reading it (saving and publishing:
:mod:`nemo_anchor.training.checkpoint_saver`). Every rank writes and reads its own shards.

One checkpoint directory (layout: :mod:`nemo_anchor.run_dir`) holds

- ``model.*``: the model's own ``sharded_state_dict()`` (its parameters in their dtype, sharded
  as the model is, one replica written);
- ``optimizer.*``: the optimizer state in model space (:mod:`nemo_anchor.training.optimizer_state`):
  Adam's moments and, for bf16 parameters, their fp32 masters (``optimizer.state.fp32_param.*``),
  each rank writing the slice it owns. Any tensor x pipeline x context x data layout can resume
  it, and exports and new runs (``model.init_from_hf``) read full-precision weights from it;
- ``train``: step, scheduler and sampler state, whether the save was on the ``save_every`` schedule
  (:data:`SCHEDULED`) (small, replicated); ``rng``: each rank's RNG state;
- ``checksums.json``: every other file's size and digest (:mod:`nemo_anchor.checksums`).

Every read of a checkpoint verifies it first (:func:`~nemo_anchor.checksums.verified_checkpoint`,
:func:`pick_resumable`): a missing, truncated or corrupt file is named; given a run folder, the newest intact
checkpoint is used and the damaged ones named; a checkpoint without ``CHECKSUMS`` is said to be not verified.
Only an explicit ``--no-verify`` / ``checkpoint.verify=false`` skips this
(:func:`~nemo_anchor.checksums.verification`). A checkpoint left with :data:`PENDING` (saved on a stop by an
earlier version, or whose writer reported no digests) is digested as the next start finds it
(:func:`complete_pending`), its manifest marked so.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from nemo_anchor.checksums import (AFTER_THE_FACT, READ_BACK, CheckpointError, broadcast_from_first, file_digests,
                                   gather_from_all, newest_intact, process_count, process_rank, say_once, verifying,
                                   write_manifest)
from nemo_anchor.convert.megatron_state import MASTER_PREFIX
from nemo_anchor.run_dir import RunDir
from nemo_anchor.training import optimizer_state

MODEL_PREFIX = "model."
PENDING = "checksums.pending.json"  # {file: bytes} of a checkpoint saved on a stop without digests
SCHEDULED = "scheduled"  # train state: saved on the save_every schedule (False: a signal's, the last step's)


def layout() -> dict:
    """The parallel layout a checkpoint is saved with (recorded, and compared on resume)."""
    return {"tensor": parallel_state.get_tensor_model_parallel_world_size(),
            "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
            "context": parallel_state.get_context_parallel_world_size(),
            "data": parallel_state.get_data_parallel_world_size(),
            "world": process_count()}


def rng_object(state) -> ShardedObject:
    """This rank's RNG ``state`` as the checkpoint's ``rng`` entry (None: the one to load)."""
    return ShardedObject("rng_state", state, (process_count(),), (process_rank(),), replica_id=0)


def rng_state() -> dict:
    """This rank's RNG states (torch, Megatron's tracker, CUDA): what a checkpoint saves."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def complete_pending(ckpt_dir: Path, report: Callable[[str], None] = say_once) -> str | None:
    """Compute and record the digests of a checkpoint a stop saved without them (:data:`PENDING`), before it is
    used; returns what is wrong with it (None: recorded). Collective; called with the run's lease held.

    They are recorded only when every file the save wrote is there with the size recorded at the save and every
    rank could read its share; then ``CHECKSUMS`` (marked :data:`~nemo_anchor.checksums.AFTER_THE_FACT`: it proves
    only that the files did not change from now on) replaces :data:`PENDING`. Otherwise it stays pending, and is
    not used."""
    problem, sizes = None, None
    if process_rank() == 0:
        try:
            sizes = json.loads((ckpt_dir / PENDING).read_text())
            if not isinstance(sizes, dict) or not sizes or \
                    not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes.values()):
                raise ValueError("not a {file: bytes} object")
            problem = next((f"{ckpt_dir / name} is missing" if not (ckpt_dir / name).is_file() else
                            f"{ckpt_dir / name} has {(ckpt_dir / name).stat().st_size} bytes, {PENDING} recorded "
                            f"{size} at the save" for name, size in sorted(sizes.items())
                            if not (ckpt_dir / name).is_file() or (ckpt_dir / name).stat().st_size != size), None)
        except (OSError, ValueError) as err:
            problem = f"{ckpt_dir / PENDING} is unreadable ({err})"
    problem, sizes = broadcast_from_first((problem, sizes))
    if problem is None:
        started = time.perf_counter()
        try:
            mine, failed = file_digests(ckpt_dir, sorted(sizes)[process_rank()::process_count()]), None
        except OSError as err:
            mine, failed = {}, f"cannot read {err.filename or ckpt_dir}: {err.strerror or err}"
        every, failures = zip(*gather_from_all((mine, failed)))
        problem = next((f for f in failures if f), None)
        sums = {name: value for part in every for name, value in part.items()}
        if problem is None:
            problem = next((f"{ckpt_dir / name} has {value[0]} bytes now, {PENDING} recorded {sizes[name]}"
                            for name, value in sorted(sums.items()) if value[0] != sizes[name]), None)
        if problem is None and process_rank() == 0:
            write_manifest(ckpt_dir, sums, AFTER_THE_FACT)
            (ckpt_dir / PENDING).unlink()
            report(f"recorded the checksums of {ckpt_dir.name}, pending since its save on a stop "
                   f"({time.perf_counter() - started:.1f} s)")
        if dist.is_initialized():
            dist.barrier()
    return problem


def has_pending_checksums(ckpt_dir: Path) -> bool:
    return (ckpt_dir / PENDING).is_file()


def record_checksums(ckpt_dir: str | os.PathLike) -> None:
    """Write ``CHECKSUMS`` for a checkpoint written outside
    :class:`~nemo_anchor.training.checkpoint_saver.CheckpointSaver` (``import-hf``'s weights).

    Collective: each rank reads its share of the files, rank 0 writes the manifest."""
    ckpt_dir = Path(ckpt_dir)
    names = broadcast_from_first(sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file())
                                 if process_rank() == 0 else None)
    every = gather_from_all(file_digests(ckpt_dir, names[process_rank()::process_count()]))
    if process_rank() == 0:
        write_manifest(ckpt_dir, {name: value for part in every for name, value in part.items()}, READ_BACK)


def has_training_state(ckpt_dir: str | os.PathLike) -> bool:
    """False for a weights-only checkpoint (``import-hf`` output): start from it, do not resume it."""
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir)) or {}
    return "train" in common


def pick_resumable(run: RunDir, report: Callable[[str], None] = say_once) -> Path | None:
    """The newest intact checkpoint of ``run`` with training state; None when it has none (a fresh run) or the
    newest intact one holds weights only (``import-hf`` output: started from, not resumed).

    A damaged checkpoint is reported (``report(message)``, naming the bad file) and the next older one
    tried (:func:`verified_checkpoint`'s verification). The checksums a stop left pending are computed and
    recorded first (:func:`complete_pending`); one that cannot be is damaged. Collective; called with the
    run's lease held.

    Raises:
        CheckpointError: the run has checkpoints and none is intact; nothing has been changed.
    """
    candidates = broadcast_from_first(run.list_checkpoints() if process_rank() == 0 else None)
    if not candidates:
        return None
    if not verifying():
        found = candidates[-1]
    else:
        pending = broadcast_from_first([c for c in candidates if has_pending_checksums(c)] if process_rank() == 0
                                       else None)
        unusable = {candidate: complete_pending(candidate, report) for candidate in reversed(pending)}
        found, damaged = None, []
        for candidate in reversed(candidates):
            if candidate in unusable:  # its checksums were just computed from its files: read once, not twice
                found, problems = (candidate, []) if unusable[candidate] is None else (None, [unusable[candidate]])
            else:
                found, problems = newest_intact([candidate], report)
            if found is not None:
                break
            damaged += problems
            report(f"warning: cannot resume from {candidate.name}: {problems[0]}; trying the previous checkpoint")
        if found is None:
            raise CheckpointError(
                f"cannot resume {run.root}: none of its checkpoints is intact ({'; '.join(damaged)}); nothing was "
                f"changed. Restore a checkpoint from a copy, train into a new output_dir, or resume unverified with "
                f"checkpoint.verify=false")
    return found if broadcast_from_first(has_training_state(found) if process_rank() == 0 else None) else None


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
        state["rng"] = rng_object(None)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    _load_model_weights(engine.gpt, loaded["model"], ckpt_dir)
    optimizer_state.finish_load(engine.optimizer, loaded["optimizer"], targets)
    engine.scheduler.load_state_dict(loaded["train"]["scheduler"])
    if "rng" in loaded:
        set_rng_state(loaded["rng"])
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
