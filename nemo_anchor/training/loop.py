"""The training loop: packed windows -> Megatron GPT with AnchorAttention -> Megatron's engine.

One process or many under torchrun: tensor x pipeline x context x data parallel, on Megatron-Core's
DDP, distributed optimizer and schedules (:mod:`nemo_anchor.training.engine`). The loss of a step
is the mean over every loss token of the global batch, so every parallel layout reproduces the
single-process loss. Everything a run reads is checked before anything in ``output_dir`` is
written; a resumed run continues from the newest intact checkpoint, with the same model and data
(:mod:`nemo_anchor.training.resume`); one run writes into an ``output_dir`` at a time
(:class:`~nemo_anchor.run_lease.RunGuard`).
"""
from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_anchor.atomic import OutputError, atomic_file, check_not_an_input, write_faults_named, written_by
from nemo_anchor.data import PackedDataset, WindowSampler, collate_windows, load_tokenizer, rank_microbatches
from nemo_anchor.data.tokenizer import check_same_tokenizer, find_tokenizer
from nemo_anchor.model.vocab import padded_vocab_size
from nemo_anchor.parallel.context_parallel import batch_for_this_rank
from nemo_anchor.parallel.distributed import ParallelContext, initialize_parallel
from nemo_anchor.run_dir import RunDir, checkpoint_step, read_run_config
from nemo_anchor.run_lease import RunClaim, RunDirInUse, RunGuard
from nemo_anchor import checksums, launch
from nemo_anchor.training import checkpoint as ckpt
from nemo_anchor.training import checkpoint_saver
from nemo_anchor.training import fault_tolerance, memory, preemption, resume, throughput
from nemo_anchor.training.config import RunConfig, to_yaml
from nemo_anchor.training.engine import Engine, build_engine, parameters_gathered, run_microbatches, train_step
from nemo_anchor.training.metrics import MetricsLogger


class StepAbandoned(Exception):
    """A stop agreed between the micro-batches of a step: the step is left unfinished, and not counted."""


@dataclass
class TrainSummary:
    output_dir: str
    steps: int
    final_loss: float | None
    valid_loss: float | None
    checkpoint: str | None
    tokens_per_s: float
    stopped_by_signal: bool


class Trainer:
    """One training run in ``config.output_dir``; ``fit()`` trains to ``trainer.max_steps``.

    Start-up reads and checks everything before writing: the output is none of the inputs, the data
    and tokenizers agree, and a resumed checkpoint's config allows the new one
    (:mod:`nemo_anchor.training.resume`). Then rank 0 takes the output_dir's lock
    (:class:`~nemo_anchor.run_lease.RunGuard`), held until ``fit()`` returns; a fresh run that fails, or is
    stopped, before its first checkpoint leaves no folder behind. The stop signals are held back from before the
    lock is taken until ``fit()`` installs its handler, which then acts on them.
    """

    def __init__(self, config: RunConfig):
        self.config = config
        self.run = RunDir(config.output_dir)
        m, t = config.model, config.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        launch.cuda()  # a GPU job that sees no GPU stops first, before the inputs are read (CudaExpected)
        self._check_output_dir()
        self.dataset, self.valid, vocab_size = self._open_data()
        self.ctx: ParallelContext = initialize_parallel(
            m.context_parallel_size, seed=t.seed, tensor_parallel_size=m.tensor_model_parallel_size,
            pipeline_parallel_size=m.pipeline_model_parallel_size, timeout_minutes=t.distributed_timeout_minutes)
        per_round = t.micro_batch_size * self.ctx.data_parallel_size
        if t.global_batch_size % per_round:
            raise ValueError(
                f"trainer.global_batch_size={t.global_batch_size} must be a multiple of trainer.micro_batch_size x "
                f"data-parallel size = {t.micro_batch_size} x {self.ctx.data_parallel_size}")
        self.config.model.vocab_size = vocab_size
        self.data_record = resume.data_record(config.data.path)
        # the stop flag is agreed between micro-batches on the CPU, so that asking never waits for the device
        self._stop_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=t.distributed_timeout_minutes)) \
            if dist.get_backend() != "gloo" else None
        preemption.hold_stop_signals()  # released in fit(), once its handler is in, or after a failure's clean-up
        try:
            self._guard = self._claim_output_dir()
        except BaseException:
            preemption.release_stop_signals()
            raise
        try:
            with checksums.verification(config.checkpoint.verify):  # the resumed checkpoint, model.init_from_hf's
                self._start()
        except BaseException:
            self._release(failed=True)
            raise

    def _start(self) -> None:
        config, t = self.config, self.config.trainer
        self.saver = checkpoint_saver.CheckpointSaver(self.run, config.checkpoint.keep_last,
                                                      config.checkpoint.save_every, asynchronous=self._async_save(),
                                                      fence=self._guard.fence)
        preemption.start_checkpoint_writer_queue()  # now, not in the first save, which may be a stop's
        if self.ctx.is_main:  # the lease holder: no other run writes into checkpoints/
            for leftover in self.saver.remove_leftovers():
                self._say(f"removing {leftover}, left by a save or a deletion that did not finish")
        resume_from = ckpt.pick_resumable(self.run, self._say) if config.checkpoint.resume else None
        schedule_from_config = resume_from is not None and self._check_resume(resume_from)
        start_from = None if resume_from else self._starting_weights()
        torch.manual_seed(t.seed)
        self.engine: Engine = build_engine(config, self.ctx, config.model.vocab_size, self._initializer(start_from))
        self.sampler = WindowSampler(len(self.dataset), seed=t.seed, shuffle=config.data.shuffle)
        self.step = 0
        self.resumed_from = None
        if resume_from is not None:  # before anything is written: a checkpoint that does not fit fails here
            with self._schedule_kept(schedule_from_config):
                state = ckpt.load_checkpoint(resume_from, self.engine)
            try:
                self.sampler.load_state_dict(state["sampler"])
            except ValueError as err:
                raise resume.ResumeRefused(f"cannot resume {resume_from} on data.path={config.data.path}: {err}") \
                    from None
            self.step = int(state["step"])
            self.resumed_from = resume_from
        self.config_yaml = to_yaml(self.config)
        self._prepare_output_dir()
        if self.ctx.device.type == "cuda":
            self._warn_if_over_gpu_memory()
        self.peak_tflops, peak_source = throughput.resolve_peak_tflops(t.peak_tflops, self.ctx.device, t.precision)
        self._say(f"MFU against {self.peak_tflops:.4g} TFLOP/s per device ({peak_source})")

    # ----------------------------------------------------------------- setup
    def _say(self, message: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(message, flush=True)

    def _check_output_dir(self) -> None:
        """An output is never one of the run's inputs, nor another command's output (a packed dataset...)."""
        cfg = self.config
        check_not_an_input(cfg.output_dir, [cfg.data.path, cfg.data.valid_path, cfg.model.init_from_hf])
        kind = written_by(cfg.output_dir)
        if kind is not None and kind != "import-hf":  # import-hf writes a run directory to train in
            raise OutputError(f"output_dir {self.run.root} holds the output of `nemo-anchor {kind}`, not a training "
                              f"run: choose another output_dir")

    def _async_save(self) -> bool:
        """checkpoint.async_save, decided from the devices this process sees when unset."""
        wanted = self.config.checkpoint.async_save
        available = checkpoint_saver.async_save_available(self.ctx.device)
        if wanted and not available:
            raise ValueError("checkpoint.async_save=true needs CUDA (Megatron's asynchronous writer synchronizes "
                             "the device): leave it unset, or set it false")
        return available if wanted is None else wanted

    def _claim_output_dir(self) -> RunGuard:
        """Rank 0 takes the output_dir's lock; every rank learns whether it got it."""
        claim, refusal = None, [None]
        if self.ctx.is_main:
            try:
                with write_faults_named(self.run.root):  # a read-only or full disk names the run folder
                    claim = RunClaim(self.run)
            except ValueError as err:  # RunDirInUse, OutputError, a bad NEMO_ANCHOR_LEASE_* variable
                refusal[0] = str(err)
            except OSError as err:
                refusal[0] = f"cannot write {self.run.root}: {err.strerror or err}"
        dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            raise RunDirInUse(refusal[0])
        return RunGuard(claim, self.run.root)

    def _release(self, *, failed: bool) -> None:
        self._guard.release(failed=failed)
        preemption.release_stop_signals()  # a signal held back until now, with no handler, ends the process

    def _check_resume(self, checkpoint: Path) -> bool:
        """Refuse a resume that changes the run; report what changes; True when the new LR schedule applies."""
        from omegaconf import OmegaConf

        allow = list(self.config.checkpoint.allow_change)
        saved = OmegaConf.to_container(read_run_config(checkpoint))
        new = OmegaConf.to_container(OmegaConf.structured(self.config))
        changed = resume.compare(checkpoint, saved, new, allow, _saved_data_record(checkpoint),
                                 self.data_record)
        changed.pop("output_dir", None)
        if changed:
            self._say(f"resuming {checkpoint.name} with " + ", ".join(f"{key}: {before!r} -> {after!r}"
                                                                     for key, (before, after) in changed.items()))
        override = resume.overrides_schedule(changed, allow)
        if "trainer.max_steps" in changed and not override and self.config.optim.schedule != "constant":
            self._say("note: the learning rate keeps the checkpoint's schedule (decay over its steps); pass "
                      "--allow-change trainer.max_steps to decay over the new trainer.max_steps")
        return override

    @contextlib.contextmanager
    def _schedule_kept(self, from_config: bool):
        """While a checkpoint loads: with ``from_config``, the LR schedule stays the new config's, as Megatron-LM's
        --override-opt-param-scheduler keeps it (the scheduler's values, and the param groups' max_lr/min_lr,
        which the optimizer's state would bring back)."""
        if not from_config:
            yield
            return
        scheduler, groups = self.engine.scheduler, self.engine.optimizer.param_groups
        scheduler.override_opt_param_scheduler, scheduler.use_checkpoint_opt_param_scheduler = True, False
        bounds = [{key: group[key] for key in ("max_lr", "min_lr") if key in group} for group in groups]
        yield
        for group, kept in zip(self.engine.optimizer.param_groups, bounds):
            group.update(kept)
        scheduler.step(0)  # this step's lr and weight decay from the new schedule

    def _open_data(self) -> tuple[PackedDataset, PackedDataset | None, int]:
        """Open and check every dataset the run reads; returns (train, valid or None, vocabulary size)."""
        cfg = self.config
        train = PackedDataset(cfg.data.path)
        if train.seq_length != cfg.model.seq_length:
            raise ValueError(f"model.seq_length={cfg.model.seq_length} but the packed dataset {cfg.data.path} has "
                             f"windows of {train.seq_length} tokens: repack or set model.seq_length")
        valid = PackedDataset(cfg.data.valid_path) if cfg.data.valid_path else None
        if valid is not None and valid.seq_length != train.seq_length:
            raise ValueError(f"data.valid_path={cfg.data.valid_path} has windows of {valid.seq_length} tokens, "
                             f"data.path has {train.seq_length}: pack both with the same --seq-length")
        for dataset, key in ((train, "data.path"), (valid, "data.valid_path")):
            recorded = dataset.metadata.get("vocab_size") if dataset is not None else None
            if recorded is not None and recorded != dataset.tokenizer.vocab_size:
                raise ValueError(f"{key}={dataset.path}: metadata.json says vocab_size={recorded} but its tokenizer/ "
                                 f"has {dataset.tokenizer.vocab_size} tokens: the dataset is inconsistent; repack it")
        vocab_size = cfg.model.vocab_size or train.tokenizer.vocab_size  # a tensor-parallel layout pads it
        self._check_tokenizers(train, valid)
        for dataset in (train, valid) if valid is not None else (train,):
            dataset.check_token_ids(vocab_size)
        return train, valid, vocab_size

    def _check_tokenizers(self, train: PackedDataset, valid: PackedDataset | None) -> None:
        """Every dataset, the run's saved tokenizer and model.init_from_hf's tokenizer must be the same one."""
        source = f"data.path={self.config.data.path}"
        if valid is not None:
            check_same_tokenizer(valid.tokenizer, f"data.valid_path={self.config.data.valid_path}", train.tokenizer,
                                 source)
        starts = [(self.run.tokenizer, f"output_dir={self.run.root} (its tokenizer/)")]
        init_from = self.config.model.init_from_hf
        if init_from:
            starts.append((Path(init_from), f"model.init_from_hf={init_from}"))
        for path, name in starts:
            found = find_tokenizer(path)
            if found is not None:
                check_same_tokenizer(train.tokenizer, source, load_tokenizer(found), name)

    def _starting_weights(self) -> Path | None:
        """Where a fresh run's weights come from: model.init_from_hf, or a weights-only checkpoint in output_dir."""
        if self.config.model.init_from_hf:
            return Path(self.config.model.init_from_hf)
        saved = self.run.list_checkpoints()
        return saved[-1] if saved else None

    def _initializer(self, source: Path | None):
        if source is None:
            return None

        def initialize(gpt: torch.nn.Module) -> None:
            from nemo_anchor.training.init_from_hf import init_model_from_hf

            init_model_from_hf(gpt, source)

        return initialize

    def _prepare_output_dir(self) -> None:
        if self.ctx.is_main:
            self.run.root.mkdir(parents=True, exist_ok=True)
            with atomic_file(self.run.config) as staging:  # a read-only run folder is named, not a temp file
                staging.write_text(self.config_yaml)
            if not self.run.tokenizer.exists():
                staging = self.run.root / ".tokenizer.tmp"
                shutil.rmtree(staging, ignore_errors=True)
                self.dataset.tokenizer.save(staging)
                staging.replace(self.run.tokenizer)
        dist.barrier()

    # ----------------------------------------------------------------- steps
    def _load(self, dataset: PackedDataset, indices: list[int], weights: list[float] | None = None) -> dict:
        """Collate windows, keep this context-parallel rank's share, move to the device."""
        batch = collate_windows([dataset[i] for i in indices])
        if weights is not None:  # padding windows of an uneven evaluation split count for nothing
            batch["loss_mask"] = batch["loss_mask"] * torch.tensor(weights, dtype=batch["loss_mask"].dtype)[:, None]
        return batch_for_this_rank(batch, self.config.model.attention_type, self.ctx.device)

    def train_step(self, stop: preemption.StopRequest | None = None) -> dict:
        """One optimizer step. With ``stop``, the ranks agree on its flag between micro-batches; when set, the step
        is abandoned (:class:`StepAbandoned`) and the run is as the previous step left it, to be saved."""
        t = self.config.trainer
        before = self.sampler.consumed, ckpt.rng_state()
        windows = self.sampler.next_global_batch(t.global_batch_size)
        try:
            batches, unreadable = [self._load(self.dataset, micro) for micro in
                                   rank_microbatches(windows, t.micro_batch_size, self.ctx.data_parallel_rank,
                                                     self.ctx.data_parallel_size)], None
        except ValueError as err:  # a corrupt window: every rank stops, not only the one that read it
            batches, unreadable = None, str(err)
        if self._agree(unreadable is not None)[0]:
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, unreadable)
            raise ValueError(next(message for message in messages if message is not None))
        try:
            record = train_step(self.engine, self.config, batches, self._stop_check(stop))
        except StepAbandoned:
            self.sampler.consumed = before[0]  # the windows of this step are the next step's again
            ckpt.set_rng_state(before[1])
            raise
        self.step += 1
        flops = throughput.global_batch_flops(self.config.model, self.config.model.vocab_size, self.dataset, windows)
        return {**record, "tokens": t.global_batch_size * self.config.model.seq_length, "flops": flops}

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the first ``trainer.eval_batches`` windows of ``data.valid_path``."""
        if self.valid is None:
            return None
        count = min(len(self.valid), self.config.trainer.eval_batches)
        dp, rank = self.ctx.data_parallel_size, self.ctx.data_parallel_rank
        per_rank = -(-count // dp)
        slots = [rank + i * dp for i in range(per_rank)]  # equal work on every rank: extra slots weigh 0
        batches = [self._load(self.valid, [min(s, count - 1)], [1.0 if s < count else 0.0]) for s in slots]
        self.engine.model.eval()
        with parameters_gathered(self.engine):
            totals = run_microbatches(self.engine, self.config, batches, forward_only=True)
        self.engine.model.train()
        return float(totals[0] / totals[1]) if totals[1] > 0 else None

    def _stop_check(self, stop: preemption.StopRequest | None):
        """What runs between micro-batches: every rank learns whether any was asked to stop, and all leave the
        step at the same micro-batch. Pipeline stages run their micro-batches at different times (1F1B), so
        there a stop waits for the step's end."""
        if stop is None or self.ctx.sizes.pipeline > 1:
            return None

        def check() -> None:
            flag = torch.tensor([int(stop.requested)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_group)
            if flag.item():
                raise StepAbandoned

        return check

    def save(self, *, read_back: bool = True) -> Path:
        """Start saving this step's checkpoint (:class:`~nemo_anchor.training.checkpoint_saver.CheckpointSaver`);
        returns the directory it is published as, which ``self.saver.finish()`` waits for. ``read_back=False`` (a
        stop): written and published before it returns, nothing read back (digested as it was written)."""
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "data": self.data_record}
        # signals deferred: the writer processes Megatron starts and keeps must survive a group SIGTERM
        with parameters_gathered(self.engine), preemption.signals_deferred():
            return self.saver.save(self.step, self.engine, state, self.config_yaml, read_back=read_back)

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainSummary:
        """Train to ``trainer.max_steps``, or to the step every rank reached when SIGTERM, SIGINT or SIGUSR1 came
        (:mod:`~nemo_anchor.training.preemption`: saved, then ``stopped_by_signal``); the output_dir's lease is
        released at the end (a fresh run stopped before its first step removes its folder)."""
        try:
            summary = self._fit()
            self.saver.close(wait_for_deletions=not summary.stopped_by_signal, report=self._say)
        except BaseException:
            self._release(failed=True)
            raise
        self._release(failed=summary.checkpoint is None)
        return summary

    def _fit(self) -> TrainSummary:
        t, c = self.config.trainer, self.config.checkpoint
        logger = MetricsLogger(self.run, total_steps=t.max_steps, start_step=self.step,
                               enabled=self.ctx.is_main, progress_bar=t.progress_bar)
        if self.resumed_from is not None:
            logger.write(f"resumed from {self.resumed_from} at step {self.step}")
        self.engine.model.train()
        last, stopped = None, False
        saved = self.resumed_from if self.resumed_from is not None else None
        started, tokens_seen = time.perf_counter(), 0
        heartbeat = fault_tolerance.Heartbeat()  # ft_launcher's hang detection sees each completed step
        with preemption.StopRequest() as stop, contextlib.closing(heartbeat):
            preemption.release_stop_signals()  # a signal held back since the lock was taken arrives here
            if self._agree(stop.requested)[0]:  # before the first step: nothing trained, nothing to save
                logger.write(f"stop requested ({stop.signal_name or 'by another rank'}) before the first step: "
                             f"nothing saved; run the same command again to " + ("resume" if saved else "start"))
                stopped = True
            while not stopped and self.step < t.max_steps:
                step_start = time.perf_counter()
                try:
                    last = self.train_step(stop)
                except StepAbandoned:  # stopped between micro-batches: the last completed step is saved
                    saved = self._stop_now(saved, stop, logger)
                    stopped = True
                    break
                heartbeat.beat()
                self.saver.poll()  # a checkpoint written and checksummed meanwhile is published
                elapsed = time.perf_counter() - step_start
                flops = last.pop("flops")
                first_step = tokens_seen == 0
                tokens_seen += last["tokens"]
                if self.step % t.log_every == 0 or self.step == t.max_steps:
                    logger.log_train_step(self.step, last, seconds=elapsed, flops=flops, devices=self.ctx.world_size,
                                          peak_tflops=self.peak_tflops)
                if first_step:  # Adam's state exists from the first step on
                    logger.log_memory(self.step, self._state_bytes_per_rank())
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                    valid_loss = self.evaluate()
                    if valid_loss is not None:
                        logger.log_eval(self.step, {"valid_loss": valid_loss})
                stop_now, lease_lost = self._agree(stop.requested, self._guard.lost_here())
                if lease_lost:  # another run writes into output_dir now: this one must not write another byte
                    raise RunDirInUse(self._guard.lost_message(self.step))
                if stop_now:
                    saved = self._stop_now(saved, stop, logger, agreed=True)
                    stopped = True
                    break
                if c.save_every and self.step % c.save_every == 0:
                    saved = self.save()
        if not stopped and (saved is None or checkpoint_step(saved) != self.step):
            saved = self.save()
        self.saver.finish()  # the last checkpoint is published before the run reports it
        valid_loss = None if stopped else self.evaluate()
        if valid_loss is not None:
            logger.log_eval(self.step, {"valid_loss": valid_loss})
        wall = time.perf_counter() - started
        summary = TrainSummary(str(self.run.root), self.step, last["loss"] if last else None, valid_loss,
                               str(saved) if saved else None, tokens_seen / wall if wall > 0 else 0.0, stopped)
        logger.close()
        return summary

    def _stop_now(self, saved: Path | None, stop: preemption.StopRequest, logger: MetricsLogger, *,
                  agreed: bool = False) -> Path:
        """Save the step reached for a stop, within the grace period: written once, nothing read back, no wait for
        the checksums of an earlier save; returns the checkpoint."""
        stopped_at = time.perf_counter()
        if not agreed and self._agree(self._guard.lost_here())[0]:
            raise RunDirInUse(self._guard.lost_message(self.step))
        if saved is None or checkpoint_step(saved) != self.step:
            saved = self.save(read_back=False)
        else:  # this step's checkpoint is the resumed one, or the one in flight
            self.saver.finish(read_back=False)
        # pending when this save (or the abandoned pass of the one in flight) left them; an earlier save's finished
        # pass, or the resume, recorded them
        checksums_when = "when the run resumes" if (saved / ckpt.PENDING).is_file() else "already"
        logger.write(preemption.stop_line(
            stop.signal_name, saved, self.step,
            f" in {time.perf_counter() - stopped_at:.1f} s (its checksums are recorded {checksums_when})"))
        return saved

    def _state_bytes_per_rank(self) -> dict[str, list[int]]:
        measured = memory.state_bytes(self.engine)
        mine = torch.tensor([measured.weights, measured.gradients, measured.optimizer], device=self.ctx.device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return {key: [int(rank[i]) for rank in every]
                for i, key in enumerate(("weights_bytes", "gradients_bytes", "optimizer_bytes"))}

    def _warn_if_over_gpu_memory(self) -> None:
        """On GPUs, the planner's estimate against the device before the first step."""
        m, t = self.config.model, self.config.trainer
        layout = memory.Layout(self.ctx.world_size, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                               m.context_parallel_size)
        options = dict(gpu_bytes=torch.cuda.get_device_properties(self.ctx.device).total_memory,
                       micro_batch_size=t.micro_batch_size, bf16=t.precision == "bf16",
                       distributed_optimizer=t.distributed_optimizer)
        vocab = padded_vocab_size(m.vocab_size, layout.tensor)
        plan = memory.plan_memory(m, vocab, layout, **options)
        if not plan.fits:
            fix = memory.suggest(m, vocab, layout, **options)
            self._say(f"warning: nemo-anchor plan estimates {plan.total / memory.GIB:.1f} GiB per GPU, more than "
                      f"the {plan.gpu_bytes / memory.GIB:.1f} GiB of this one" + (f"; try {fix}" if fix else ""))

    def _agree(self, *flags: bool) -> list[bool]:
        """Each flag, set on every rank when any rank set it (one all-reduce): every rank stops at the same step."""
        value = torch.tensor([int(flag) for flag in flags], device=self.ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return [bool(v) for v in value.tolist()]


def _saved_data_record(checkpoint: Path) -> dict | str | None:
    """What a checkpoint's training state records of its data: :func:`~nemo_anchor.training.resume.data_record`
    (a fingerprint string in checkpoints saved before it; None before either)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(checkpoint)) or {}
    return common.get("train", {}).get("data")


def train(config: RunConfig) -> TrainSummary:
    return Trainer(config).fit()
