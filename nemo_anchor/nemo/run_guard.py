"""Our trainer's run guards on NeMo's ``llm.pretrain``, as Lightning callbacks in every recipe.

- :class:`AnchorRunGuard`: one run per log directory (``nemo_anchor.run_lease.RunGuard``, the lock
  ``nemo-anchor train`` takes on its output_dir), held before every save: a run whose lease another
  run took over stops without saving; data packed with the model's tokenizer, checked
  before the first step; and a resume (NeMo's ``AutoResume`` in the same ``log.log_dir``) that may
  not change the run, compared by ``nemo_anchor.training.resume`` as ``nemo-anchor train`` compares
  it: the model, data (by content: the packed dataset's fingerprint), optimizer and batch settings
  (``nemo_anchor.training.resume.run_record``, the record Bridge's door keeps too) are saved in every
  checkpoint (the callback's state) and a changed key is refused naming it and
  both values. ``allow_change`` is ``nemo-anchor train --allow-change``: the same keys
  (``optim.lr``, ``trainer.global_batch_size``, ``optim.clip_grad``...), set in a recipe as
  ``recipe.trainer.callbacks[1].allow_change = ["optim.lr"]``, or on NeMo-Run's command line as
  ``'trainer.callbacks[1].allow_change=["optim.lr"]'``.
- :class:`AnchorNeMoLogger`: NeMo's logger, taking that lock on the log directory before NeMo writes into
  it (its log files, and ``task.json`` with ``"w"``), so a refused run leaves the holder's files as they
  were; the guard then holds the same claim. The stop signals are held back from before the lock is taken
  until :class:`AnchorPreemption` installs its handler.
- :class:`AnchorPreemption`: NeMo's ``PreemptionCallback`` on SIGTERM, SIGINT and SIGUSR1 (Slurm's
  ``--signal=USR1@120``): the step in progress finishes, the last checkpoint is saved and the
  process exits with ``nemo-anchor train``'s status 75, so the same command resumes; rank 0's last line names the
  signal, the checkpoint and what comes next (NeMo-Run's Slurm script requeues the job while its ``retries`` last).
  NeMo's own ``PreemptionCallback`` (``PreemptionPlugin`` adds it) beside it is refused.

Our names for NeMo's settings (what the comparison and the messages use)::

    model.*                    the model config, as nemo_anchor.model.config.ModelConfig names it
    data.path, data.valid_path AnchorPackedDataModule's (data.path compared by fingerprint)
    trainer.*                  global_batch_size, micro_batch_size (the data module's), max_steps, precision
    optim.*                    lr, min_lr, weight_decay, clip_grad, beta1, beta2, eps (OptimizerConfig's), schedule
"""

import contextlib
import os
import time
from pathlib import Path
from typing import Any, List, Optional

import lightning.pytorch as pl
import torch
from nemo import lightning as nl
from nemo.lightning.ckpt_utils import ckpt_to_dir
from nemo.lightning.pytorch.callbacks import PreemptionCallback
from nemo.utils import AppState

from nemo_anchor.data.tokenizer import check_same_tokenizer, load_tokenizer
from nemo_anchor.convert.sources import check_nemo2_weights, nemo2_tokenizer_dir
from nemo_anchor.run_dir import LOCK_FILE, RunDir
from nemo_anchor.run_lease import RunClaim, RunGuard
from nemo_anchor.training import resume
from nemo_anchor.training.preemption import (EXIT_INTERRUPTED, RUN_AGAIN, STOP_SIGNALS, StopRequest,
                                             hold_stop_signals, release_stop_signals, stop_line)



def run_record(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What defines a NeMo run (``nemo_anchor.training.resume.run_record``, under ``nemo-anchor train``'s keys)."""
    data = trainer.datamodule
    optim = getattr(pl_module, "optim", None)
    optim_config = getattr(optim, "config", None)
    scheduler = getattr(optim, "lr_scheduler", None)
    optim_keys = {"lr": "lr", "min_lr": "min_lr", "weight_decay": "weight_decay", "clip_grad": "clip_grad",
                  "beta1": "adam_beta1", "beta2": "adam_beta2", "eps": "adam_eps"}
    return resume.run_record(
        pl_module.config, data_path=data.path, valid_path=data.valid_path, global_batch_size=data.global_batch_size,
        micro_batch_size=data.micro_batch_size, max_steps=trainer.max_steps,
        optim={**{ours: getattr(optim_config, theirs, None) for ours, theirs in optim_keys.items()},
               "schedule": "constant" if scheduler is None else type(scheduler).__name__})


# the claims taken by AnchorNeMoLogger, by log directory, until the run's AnchorRunGuard adopts them
_CLAIMS: dict[Path, RunClaim] = {}


def _claim(log_dir) -> RunClaim:
    """The claim on ``log_dir``: the one the logger took, or a new one (a recipe with NeMo's own logger)."""
    path = Path(log_dir).resolve()
    return _CLAIMS.pop(path, None) or RunClaim(RunDir(path))


class AnchorNeMoLogger(nl.NeMoLogger):
    """NeMo's ``NeMoLogger``, with the run's lock on its log directory taken before NeMo writes there.

    NeMo's ``setup`` creates the directory, opens its log files there (every rank) and, given a task
    config, writes ``task.json`` with ``"w"``. Here global rank 0 claims the directory first, so a run
    refused while another holds it stops with the holder's files as they were. The directory is the one
    NeMo's ``setup`` picks (nemo/lightning/nemo_logger.py:100-150): ``explicit_log_dir``, else
    ``log_dir/name/version``; a run NeMo gives a new date-time version to needs no claim until the guard's.
    """

    def setup(self, trainer, resume_if_exists: bool = False, task_config=None):
        directory = self._reused_directory(resume_if_exists)
        if directory is not None:
            hold_stop_signals()  # until AnchorPreemption's handler is in: a signal meanwhile waits for it
        if directory is not None and trainer.global_rank == 0 and directory not in _CLAIMS:
            try:
                _CLAIMS[directory] = RunClaim(RunDir(directory))
            except BaseException:
                release_stop_signals()
                raise
        app_state = super().setup(trainer, resume_if_exists=resume_if_exists, task_config=task_config)
        if directory is not None and Path(app_state.log_dir).resolve() != directory:
            raise RuntimeError(f"NeMoLogger chose {app_state.log_dir}, not {directory}: this NeMo picks its log "
                               f"directory differently from nemo_anchor.nemo.run_guard.AnchorNeMoLogger")
        # NeMo's checkpoint callback moves the files it found here into run_N/ (model_checkpoint.py:154-167):
        # the lock (and its .break) stays where other runs look for it
        app_state.files_to_move = [f for f in app_state.files_to_move if not Path(f).name.startswith(LOCK_FILE)]
        return app_state

    def _reused_directory(self, resume_if_exists: bool) -> Optional[Path]:
        """The directory NeMo will log into when another run could hold it too, or None (a new date-time version)."""
        from nemo.constants import NEMO_ENV_VARNAME_VERSION

        if self.explicit_log_dir:
            return Path(self.explicit_log_dir).resolve()
        version = self.version or os.environ.get(NEMO_ENV_VARNAME_VERSION)
        if not version and not resume_if_exists and self.use_datetime_version:
            return None
        root = Path(self.log_dir) if self.log_dir is not None else Path.cwd() / "nemo_experiments"
        return (root / str(self.name or "default") / (str(version) if version else "")).resolve()


def _checkpoint_dir(path) -> Path:
    """NeMo's checkpoint directory (``trainer.ckpt_path`` names its ``weights/``)."""
    path = Path(str(path))
    return path.parent if path.name == "weights" else path


class AnchorRunGuard(pl.Callback):
    """The lock, the tokenizer check and the resume comparison of ``nemo-anchor train`` (see the module).

    Args:
        allow_change: keys that may change on resume (``nemo-anchor train --allow-change``); an LR-schedule
            key takes the new optimizer settings (lr, min_lr, weight decay) on the resumed run, as ours does.
    """

    def __init__(self, allow_change: Optional[List[str]] = None):  # List: what NeMo-Run's command line parses
        self.allow_change = list(allow_change or [])
        resume.check_allow_list(self.allow_change)
        self._guard: Optional[RunGuard] = None
        self._record: dict = {}
        self._changed: dict = {}

    # ---------------------------------------------------------------- before anything is restored or trained
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Runs before NeMo's checkpoint callback moves the log directory's files and before a restore."""
        if stage != "fit" or self._guard is not None:
            return
        hold_stop_signals()  # first: until AnchorPreemption's handler is in, a signal waits for it
        # then the lock: while another run holds the directory, nothing else is looked at
        self._guard = RunGuard(_claim(AppState().log_dir) if trainer.is_global_zero else None, AppState().log_dir)
        data = trainer.datamodule
        self._check_start(trainer, pl_module, data)
        if pl_module.config.vocab_size:
            data.train_dataset.dataset.check_token_ids(pl_module.config.vocab_size)
        self._record = run_record(trainer, pl_module)
        self._checkpoint = trainer.ckpt_path

    def _check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, data) -> None:
        """The data's tokenizer (pack's ``tokenizer/``) is the one the starting weights were trained with, and
        weights restored into the model (``resume.restore_config``) are the tensors its config describes."""
        from nemo_anchor.convert.megatron_config import model_config_from_megatron

        dataset = data.train_dataset.dataset  # the packed windows behind the stream
        restore = getattr(trainer.strategy, "restore_config", None)
        if trainer.ckpt_path:
            start, name = _checkpoint_dir(trainer.ckpt_path), f"the checkpoint {_checkpoint_dir(trainer.ckpt_path)}"
        elif restore is not None:
            start, name = Path(restore.path), f"resume.restore_config.path={restore.path}"
            if restore.load_model_state:
                check_nemo2_weights(start, model_config_from_megatron(pl_module.config))
        else:
            return
        found = nemo2_tokenizer_dir(start)
        if found is not None:
            check_same_tokenizer(dataset.tokenizer, f"data.path={data.path}", load_tokenizer(found), name)

    # ---------------------------------------------------------------- saved with, and compared on, every checkpoint
    def state_dict(self) -> dict:
        return dict(self._record)

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning restores a resumed run's callbacks before its first step: a run that changes is refused here."""
        checkpoint = _checkpoint_dir(self._checkpoint)
        self._changed = resume.compare(
            checkpoint, state_dict["config"], self._record["config"], self.allow_change, state_dict.get("data"),
            self._record["data"], allow_hint="add {key} to the recipe's AnchorRunGuard(allow_change=[...])",
            restart_hint="train into a new log.log_dir (resume.restore_config.path={checkpoint} starts from its weights)")
        if resume.overrides_schedule(self._changed, self.allow_change) and \
                self._record["config"]["optim"]["schedule"] != "constant":
            raise resume.ResumeRefused(f"cannot resume {checkpoint} with a new learning-rate schedule: NeMo's "
                                       f"{self._record['config']['optim']['schedule']} keeps its own state; allow "
                                       f"schedule changes only for runs without optim.lr_scheduler")
        if self._changed:
            print("resuming " + ", ".join(f"{key}: {before!r} -> {after!r}"
                                          for key, (before, after) in self._changed.items()), flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """An allowed change of lr, min_lr or weight decay takes effect (the optimizer state restored the old ones);
        each parameter group keeps its own multiplier, as Megatron's ``override_opt_param_scheduler`` does."""
        if not any(isinstance(callback, AnchorPreemption) for callback in trainer.callbacks):
            release_stop_signals()  # no handler of ours takes the signals held since setup: their defaults do
        if not resume.overrides_schedule(self._changed, self.allow_change):
            return
        scaled = {"optim.lr": ("lr", "max_lr"), "optim.min_lr": ("min_lr",), "optim.weight_decay": ("weight_decay",)}
        for key, fields in scaled.items():
            if key not in self._changed:
                continue
            before, after = self._changed[key]
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    for field in fields:
                        if field in group:
                            group[field] = after if not before else group[field] * after / before

    # ---------------------------------------------------------------- the lock: held before every save, then released
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        """Before any save of this step (Lightning runs checkpoint callbacks last, and this guard comes before
        AnchorPreemption in the recipes), every rank learns whether rank 0 still holds the lease: a run whose
        lease another run took over stops without writing."""
        self._guard.stop_if_lost(pl_module.device, trainer.global_step)

    @property
    def guard(self) -> Optional[RunGuard]:
        """This run's guard, from ``setup`` until the run ends (None outside a training run)."""
        return self._guard

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._release()

    def _release(self) -> None:
        if self._guard is not None:
            self._guard.release(failed=False)  # NeMo's log directory is NeMo's: only the lock goes
            self._guard = None
        release_stop_signals()  # a run that ends before its stop handler was installed


def guard_of(trainer: pl.Trainer) -> Optional[RunGuard]:
    """The run guard of ``trainer``'s :class:`AnchorRunGuard` (None without one, or outside a training run): what
    :class:`~nemo_anchor.nemo.strategy.AnchorMegatronStrategy` fences its saves and removals with."""
    return next((callback.guard for callback in trainer.callbacks if isinstance(callback, AnchorRunGuard)), None)


class AnchorPreemption(PreemptionCallback):
    """NeMo's ``PreemptionCallback`` for SIGTERM, SIGINT and SIGUSR1, exiting with status 75 after the save.

    NeMo's listens to one signal on rank 0 and reads the flag on ``torch.cuda.current_device()``; every rank
    records the signal here (torchrun and Slurm signal each worker) and the ranks agree on the CPU or GPU
    the module runs on, so any rank's signal stops all of them at the same step.
    """

    def __init__(self, exit_code: int = EXIT_INTERRUPTED):
        super().__init__(sig=STOP_SIGNALS[0])
        self.exit_code = exit_code
        self._device = torch.device("cpu")
        self._stop = StopRequest()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse NeMo's own ``PreemptionCallback`` beside this one; hold the signals back until
        :meth:`on_train_start`: the data loader's workers, started in between, inherit
        the block and never see them (torch's workers die of SIGTERM, torch/utils/data/_utils/worker.py:269, and the
        main process, still saving, then fails on the dead worker; NeMo rebuilds the loader without a
        ``worker_init_fn``, nemo/lightning/data.py:224). Slurm, Kubernetes and torchrun signal the whole group."""
        others = [type(c).__name__ for c in trainer.callbacks
                  if isinstance(c, PreemptionCallback) and not isinstance(c, AnchorPreemption)]
        if others:  # its handler would replace ours for its signal; it exits 0 (not requeued) and reads a CUDA flag
            raise ValueError(f"trainer.callbacks has NeMo's {others[0]} (nemo.lightning.run.plugins.PreemptionPlugin "
                             f"adds it) beside the recipe's AnchorPreemption, which saves on SIGTERM, SIGINT and "
                             f"SIGUSR1 already: drop the plugin and set the executor's signal (signal=\"USR1@120\")")
        if stage == "fit":
            hold_stop_signals()  # held already when AnchorNeMoLogger or AnchorRunGuard took the lock

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """As NeMo's, the handlers go in here, after Lightning's (which would end the run with SIGTERMException
        without a save, lightning/pytorch/loops/training_epoch_loop.py:310); then a signal held meanwhile arrives."""
        self._device = pl_module.device
        super().on_train_start(trainer, pl_module)
        release_stop_signals()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        release_stop_signals()

    @contextlib.contextmanager
    def _preemption_handler(self):  # overrides nemo/lightning/pytorch/callbacks/preemption.py:78 (one signal)
        with self._stop:
            yield

    @property
    def interrupted(self) -> bool:
        if not self.preemption_supported:
            return self._stop.requested
        flag = torch.tensor([int(self._stop.requested)], device=self._device, dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        started = time.perf_counter()
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        except SystemExit:  # NeMo's exits 0 after the save: a scheduler would take the run for finished
            if trainer.is_global_zero:
                print(stop_line(self._stop.signal_name, ckpt_to_dir(trainer.checkpoint_callback.last_model_path),
                                trainer.global_step, f" in {time.perf_counter() - started:.1f} s", what_comes_next()),
                      flush=True)
            if self.preemption_supported:  # srun ends the other tasks once one exits 75: none goes before that line
                torch.distributed.barrier()
            raise SystemExit(self.exit_code) from None


def what_comes_next() -> str:
    """What follows a stop's exit: NeMo-Run's Slurm batch script requeues a job that exits non-zero while the
    executor's ``retries`` (the script's ``TORCHX_MAX_RETRIES``) exceed the job's ``SLURM_RESTART_COUNT``
    (nemo_run/core/execution/templates/slurm.sh.j2); elsewhere the same command resumes."""
    job, retries = os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHX_MAX_RETRIES", "")
    if not job or not retries.isdigit():
        return RUN_AGAIN
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if int(retries) > restarts:
        return (f"NeMo-Run's batch script requeues job {job} (restart {restarts + 1} of retries={retries}), which "
                f"resumes from it")
    return (f"job {job} is not requeued (NeMo-Run's executor has retries={retries}, restarts so far {restarts}): "
            f"{RUN_AGAIN}")
