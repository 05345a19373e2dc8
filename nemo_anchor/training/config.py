"""The one config manager: NeMo-style YAML sections as dataclasses, loaded with OmegaConf.

``load_config(path, overrides)`` merges the schema defaults, the YAML file and ``key=value``
overrides (OmegaConf dotlist syntax). Unknown keys and values of the wrong type are errors that
name the key; semantic checks (``validate``) name the key and the bad value too.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_anchor.attention.paradigms import get_attention_type
from nemo_anchor.data.sampler import DEFAULT_SEED
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.training.resume import check_allow_list


@dataclass
class DataConfig:
    path: str = "???"  # a packed dataset directory (nemo-anchor pack)
    valid_path: Optional[str] = None  # held-out packed dataset for evaluation
    shuffle: bool = True


@dataclass
class TrainerConfig:
    max_steps: int = 100
    global_batch_size: int = 8  # windows per optimizer step, summed over data-parallel ranks
    micro_batch_size: int = 1  # windows per forward pass on one rank
    precision: str = "bf16"  # bf16 (bf16 compute, fp32 master weights/grads/optimizer) | fp32
    distributed_optimizer: bool = True  # shard fp32 masters and Adam state over data x context ranks (ZeRO-1)
    seed: int = DEFAULT_SEED  # model initialisation and the window order
    log_every: int = 1
    eval_every: int = 0  # 0: evaluate at the end only
    eval_batches: int = 8
    num_threads: int = 0  # torch intra-op threads on the CPU; 0 keeps torch's default
    progress_bar: bool = True
    peak_tflops: Optional[float] = None  # per-device peak for MFU; default: the GPU's published bf16 peak, else measured
    # exit status after SIGTERM/SIGINT/SIGUSR1 and the checkpoint they save (75, EX_TEMPFAIL: run again to resume)
    preempt_exit_code: int = 75
    # longest wait of one collective for the other ranks (Megatron's distributed_timeout_minutes): a hung or frozen
    # rank makes the run end with status 1 this long after, so that it can be restarted (docs/cluster.md)
    distributed_timeout_minutes: float = 10.0


@dataclass
class OptimConfig:
    lr: float = 2e-5
    min_lr: float = 0.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear decay to min_lr after warmup (Megatron's scheduler)
    clip_grad: float = 1.0


@dataclass
class CheckpointConfig:
    save_every: int = 0  # 0: only at the end (and on SIGTERM)
    keep_last: int = 2
    resume: bool = True  # resume from output_dir's latest checkpoint when there is one
    # keys a resume may change on purpose (nemo_anchor.training.resume.ALLOWABLE), e.g. [optim.lr]; other
    # changes to the run are refused. CLI: nemo-anchor train --allow-change optim.lr,trainer.global_batch_size
    allow_change: List[str] = field(default_factory=list)
    # verify every checkpoint read (resume, model.init_from_hf) against its checksums.json first; false reads
    # a damaged checkpoint without a word
    verify: bool = True
    # Megatron's asynchronous save (the loop continues while the shards are written); unset: on where CUDA is
    # seen, the synchronous save elsewhere (Megatron's async writer synchronizes the CUDA device)
    async_save: Optional[bool] = None


@dataclass
class RunConfig:
    output_dir: str = "???"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> "RunConfig":
        def bad(key, value, why):
            raise ValueError(f"{key}={value!r}: {why}")

        self.model.validate()
        t, o = self.trainer, self.optim
        if t.precision not in ("bf16", "fp32"):
            bad("trainer.precision", t.precision, "choose bf16 or fp32")
        for key in ("max_steps", "global_batch_size", "micro_batch_size", "log_every"):
            if getattr(t, key) < 1:
                bad(f"trainer.{key}", getattr(t, key), "must be >= 1")
        if t.peak_tflops is not None and not t.peak_tflops > 0:
            bad("trainer.peak_tflops", t.peak_tflops, "must be a positive number of TFLOP/s per device (or null)")
        if not 1 <= t.preempt_exit_code <= 255:
            bad("trainer.preempt_exit_code", t.preempt_exit_code, "must be an exit status from 1 to 255")
        if not t.distributed_timeout_minutes > 0:
            bad("trainer.distributed_timeout_minutes", t.distributed_timeout_minutes,
                "must be a positive number of minutes (Megatron's default is 10)")
        if t.global_batch_size % t.micro_batch_size:
            bad("trainer.global_batch_size", t.global_batch_size,
                f"must be a multiple of trainer.micro_batch_size={t.micro_batch_size}")
        if o.schedule not in ("constant", "cosine", "linear"):
            bad("optim.schedule", o.schedule, "choose constant, cosine or linear")
        if o.warmup_steps < 0:
            bad("optim.warmup_steps", o.warmup_steps, "must be >= 0")
        if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
            bad("optim.lr", o.lr, f"need lr > 0 and 0 <= min_lr ({o.min_lr}) <= lr")
        if not 0 <= o.beta1 < 1 or not 0 <= o.beta2 < 1:
            bad("optim.beta1/beta2", (o.beta1, o.beta2), "must lie in [0, 1)")
        check_allow_list(self.checkpoint.allow_change)
        if self.checkpoint.keep_last < 1:
            bad("checkpoint.keep_last", self.checkpoint.keep_last, "must be >= 1")
        cp = self.model.context_parallel_size
        if self.model.seq_length % (2 * cp):
            bad("model.seq_length", self.model.seq_length,
                f"must be divisible by 2 x model.context_parallel_size = {2 * cp} (each window is cut into "
                f"2*cp chunks); pick a seq_length that is a multiple of {2 * cp}")
        self._validate_sequence_parallel(bad)
        return self

    def _validate_sequence_parallel(self, bad) -> None:
        """Sequence parallelism splits each rank's tokens of a micro-batch evenly over the tensor-parallel ranks."""
        m = self.model
        tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
        if tp > 1 and (m.seq_length // cp) % tp:
            bad("model.seq_length", m.seq_length,
                f"must be divisible by model.context_parallel_size x model.tensor_model_parallel_size = {cp * tp} "
                f"(sequence parallelism splits each context-parallel rank's tokens over the tensor-parallel ranks)")
        if tp > 2 and cp > 1 and get_attention_type(m.attention_type).rope_restarts != "window":
            bad("model.tensor_model_parallel_size", tp,
                f"at most 2 with model.context_parallel_size={cp} and attention_type={m.attention_type}: context "
                f"parallelism pads each document to a multiple of {2 * cp} tokens, so a rank's share is even but "
                f"not always divisible by {tp} for sequence parallelism")


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Schema defaults <- YAML file <- ``key=value`` overrides, validated."""
    try:
        merged = OmegaConf.structured(RunConfig)
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"config file not found: {path}")
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
        bad_overrides = [o for o in overrides if "=" not in o]
        if bad_overrides:
            raise ValueError(f"overrides must look like key=value, got {bad_overrides}")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ValueError(f"missing required config keys: {missing}")
        config: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        where = f" in {path}" if path else ""
        raise ValueError(f"invalid config{where}: {err.msg} (key: {err.full_key})") from None
    return config.validate()


def to_yaml(config: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
