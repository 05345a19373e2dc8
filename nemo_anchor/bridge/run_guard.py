"""Our trainer's run guards on Megatron-Bridge's ``pretrain()`` (``python -m nemo_anchor.bridge.pretrain``).

- One run per ``checkpoint.save`` (``nemo_anchor.run_lease.RunGuard``, the lock ``nemo-anchor train``
  takes on its output_dir), taken by the global rank 0 (``RANK``, or Slurm's ``SLURM_PROCID`` without
  torchrun) before anything is written there and held before every save: a run whose lease another run
  took over stops without saving. The stop signals are held back from before the lock is taken until
  Bridge's exit-signal handler is installed (:mod:`nemo_anchor.bridge.preemption`).
- The data's tokenizer (pack's ``tokenizer/``) is the one of the weights the run starts from (the
  ``hf_reference/`` that ``import_hf`` keeps beside a checkpoint), checked before the first step.
- A resume (``checkpoint.load`` with a saved iteration) is compared with the run as
  ``nemo-anchor train`` compares it (``nemo_anchor.training.resume``): the model, the data by
  content (the packed dataset's fingerprint), batch and optimizer settings are recorded in
  ``checkpoint.save/run_guard.json`` after each checkpoint is saved (so it describes the checkpoint a
  resume loads), and a changed key is refused naming it and
  both values unless ``--allow-change`` lists it; an allowed LR-schedule key sets Bridge's
  ``scheduler.override_opt_param_scheduler`` (Megatron-LM's ``--override-opt-param-scheduler``).
  ``optim.lr``, ``optim.min_lr`` and ``optim.weight_decay`` stay refused even when allowed:
  Megatron-Core cannot load the optimizer state under new ones (the refusal says so).
- Preemption: Bridge's own exit-signal save, on SIGTERM, SIGINT and SIGUSR1 as in every door, ends the run
  with ``nemo-anchor train``'s line and status 75, so the same command resumes (:mod:`nemo_anchor.bridge.preemption`).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

from megatron.bridge.training.callbacks import Callback, CallbackContext

from nemo_anchor.atomic import atomic_file
from nemo_anchor.launch import global_rank
from nemo_anchor.bridge.convert import HF_REFERENCE
from nemo_anchor.data.tokenizer import check_same_tokenizer, find_tokenizer, load_tokenizer
from nemo_anchor.run_dir import RunDir
from nemo_anchor.run_lease import RunClaim, RunGuard
from nemo_anchor.training import resume
from nemo_anchor.training.preemption import hold_stop_signals, release_stop_signals

RECORD_FILE = "run_guard.json"


def run_record(config) -> dict[str, Any]:
    """What defines a Bridge run (``nemo_anchor.training.resume.run_record``, under ``nemo-anchor train``'s keys)."""
    optim, train = config.optimizer, config.train
    return resume.run_record(
        config.model, data_path=config.dataset.path, valid_path=config.dataset.valid_path,
        global_batch_size=train.global_batch_size, micro_batch_size=train.micro_batch_size,
        max_steps=train.train_iters, default_architecture="llama",
        optim={"lr": optim.lr, "min_lr": optim.min_lr, "weight_decay": optim.weight_decay,
               "clip_grad": optim.clip_grad, "beta1": optim.adam_beta1, "beta2": optim.adam_beta2,
               "eps": optim.adam_eps, "warmup_steps": config.scheduler.lr_warmup_iters,
               "schedule": config.scheduler.lr_decay_style})


def _resumes(config) -> bool:
    load = config.checkpoint.load
    return bool(load) and any(Path(load).glob("iter_*"))


def _check_tokenizer(config, windows) -> None:
    start = config.checkpoint.load if _resumes(config) else config.checkpoint.pretrained_checkpoint
    key = "checkpoint.load" if _resumes(config) else "checkpoint.pretrained_checkpoint"
    found = find_tokenizer(Path(start) / HF_REFERENCE) if start else None
    if found is not None:
        check_same_tokenizer(windows.tokenizer, f"dataset.path={config.dataset.path}", load_tokenizer(found),
                             f"{key}={start}")


def check(config, allow_change: list[str]) -> dict:
    """Refuse a run that would train on other tokens or change a resumed run; returns the record to keep."""
    resume.check_allow_list(allow_change)
    windows = config.dataset.open()
    _check_tokenizer(config, windows)
    record = run_record(config)
    saved_file = Path(config.checkpoint.load or config.checkpoint.save) / RECORD_FILE
    if _resumes(config) and saved_file.is_file():
        saved = _read_record(saved_file)
        changed = resume.compare(
            Path(config.checkpoint.load), saved["config"], record["config"], allow_change, saved["data"],
            record["data"], allow_hint="pass --allow-change {key}",
            restart_hint="save into a new checkpoint.save (checkpoint.pretrained_checkpoint={checkpoint} "
                         "starts from its weights)")
        keyed = [key for key in ("optim.lr", "optim.min_lr", "optim.weight_decay") if key in changed]
        if keyed:  # allowed, or compare would have refused them
            raise resume.ResumeRefused(
                f"cannot resume {config.checkpoint.load} with {keyed[0]}={changed[keyed[0]][1]!r} (was "
                f"{changed[keyed[0]][0]!r}): Megatron-Core's optimizer finds its saved state by each parameter group's "
                f"lr, min_lr and weight decay (megatron/core/optimizer/optimizer.py:640) and cannot load it under new "
                f"ones; resume with {keyed[0]}={changed[keyed[0]][0]!r}, or change it with nemo-anchor train or NeMo")
        if resume.overrides_schedule(changed, allow_change):
            config.scheduler.override_opt_param_scheduler = True
            config.scheduler.use_checkpoint_opt_param_scheduler = False
        if changed:
            print("resuming " + ", ".join(f"{key}: {before!r} -> {after!r}"
                                          for key, (before, after) in changed.items()), flush=True)
    return record


def _read_record(path: Path) -> dict:
    """A ``run_guard.json``, read as untrusted input: ValueError naming the file and the field."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); it records the run its checkpoints continue") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise ValueError(f"{path}: field config is missing or not an object")
    return saved


class _LeaseHeld(Callback):
    """Before any save of a step (Bridge saves after ``on_train_step_end``), every rank learns whether rank 0 still
    holds the lease on ``checkpoint.save``: a run whose lease another run took over stops without writing."""

    def __init__(self, guard: RunGuard):
        self.guard = guard

    def on_train_step_end(self, context: CallbackContext) -> None:
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.guard.stop_if_lost(device, context.state.train_state.step + 1)


class _RecordWithCheckpoint(Callback):
    """``run_guard.json`` is written after each checkpoint Bridge saves (``on_checkpoint_save`` fires once it is
    published; with asynchronous saves, when it is finalized), so it describes the checkpoint a resume loads: a
    resume with an allowed change that stops before its first save leaves the record of the checkpoint it had."""

    def __init__(self, record: dict, save: str):
        self.record, self.save = record, save

    def on_checkpoint_save(self, context: CallbackContext) -> None:
        if global_rank() == 0:
            with atomic_file(Path(self.save) / RECORD_FILE) as staging:
                staging.write_text(json.dumps({**self.record, "step": context.state.train_state.step}, indent=1))


# the guard of each claimed checkpoint.save, for the run's checkpoint manager (nemo_anchor.bridge.preemption), which
# Bridge builds from the config's class name
_GUARDS: dict[Path, RunGuard] = {}


def guard_of(save: str) -> RunGuard | None:
    """The guard of the run claiming ``save`` in this process, or None (a Bridge run without our door)."""
    return _GUARDS.get(Path(save).resolve())


@contextlib.contextmanager
def claimed(config) -> Iterator[RunGuard]:
    """One run writes into ``checkpoint.save`` (the lock, taken by the global rank 0 before anything is written
    there, with the stop signals held back until Bridge's handler is in); yields the guard for :func:`checked`."""
    if not config.checkpoint.save:
        raise ValueError("checkpoint.save is not set: give the run's output directory")
    hold_stop_signals()  # released once training starts (nemo_anchor.bridge.preemption), or after the release here
    guard = RunGuard(None, config.checkpoint.save)
    try:
        if global_rank() == 0:
            guard.claim = RunClaim(RunDir(config.checkpoint.save))
        _GUARDS[Path(config.checkpoint.save).resolve()] = guard
        yield guard
    finally:
        _GUARDS.pop(Path(config.checkpoint.save).resolve(), None)
        guard.release(failed=False)  # Bridge's iter_* are not our checkpoints/: nothing is removed
        release_stop_signals()


@contextlib.contextmanager
def checked(config, allow_change: list[str], guard: RunGuard) -> Iterator[list[Callback]]:
    """``with claimed(config) as guard, checked(config, allow, guard) as callbacks: pretrain(config, step,
    callbacks=[..., *callbacks])``: the checks, the lease held before every save, and the record for the next
    resume written with each checkpoint."""
    record = check(config, allow_change)
    yield [_LeaseHeld(guard), _RecordWithCheckpoint(record, config.checkpoint.save)]
