"""Megatron-Bridge ``ConfigContainer`` recipes for AnchorAttention.

Every recipe is one of our run configs (``nemo-anchor train`` YAML: the same model, data, optimizer
and schedule) turned into Bridge's configuration by :func:`from_run_config`:

- ``anchor_smollm2_135m``: SmolLM2-135M as in ``configs/ablation/smollm2.yaml``, on a CPU or one GPU.
- the paper's presets, one per ``configs/paper/*.yaml`` (``llama3_8b_128k``, ``llama2_7b_64k``, ...).
- ``llama3_context_extension_64k`` / ``_128k``: an HF Llama 3.x extended to 64K / 128K windows.

A run starts from ``checkpoint.pretrained_checkpoint``, an :func:`nemo_anchor.bridge.import_hf`
output; Bridge's own schedule convention applies (step k uses the rate the schedule gives at k - 1).
"""
from __future__ import annotations

import bisect
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedInitConfig, LoggerConfig,
                                             OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig,
                                             TrainingConfig, ValidationConfig)
from megatron.core.distributed import DistributedDataParallelConfig

from nemo_anchor import launch
from nemo_anchor.bridge.data import AnchorPackedDatasetProvider
from nemo_anchor.bridge.provider import AnchorGPTModelProvider
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.training import memory, presets
from nemo_anchor.training.config import OptimConfig, RunConfig, TrainerConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLAMA3_ORIGINAL_WINDOW = 8192


def from_run_config(run: RunConfig, vocab_size: int | None = None) -> ConfigContainer:
    """Bridge's configuration of the run ``nemo-anchor train`` would make of ``run``.

    What the devices decide is left to the training process (``nemo_anchor.launch.resolve_bridge_config``,
    which ``nemo_anchor.bridge.pretrain`` runs): the process-group backend, the DDP overlaps, async
    saves, the model's fusions and CPU initialisation, and with ``trainer.precision="auto"`` (this
    module's recipes only) bf16 on GPUs and fp32 on the CPU.
    """
    m, t, o = run.model, run.trainer, run.optim
    bf16 = t.precision == "bf16"
    mixed_precision = launch.AUTO if t.precision == launch.AUTO else "bf16_mixed" if bf16 else None
    distributed_optimizer = t.distributed_optimizer
    vocab_size = vocab_size or m.vocab_size
    return ConfigContainer(
        model=AnchorGPTModelProvider.from_model_config(m, vocab_size, bf16=bf16),
        train=TrainingConfig(train_iters=t.max_steps, global_batch_size=t.global_batch_size,
                             micro_batch_size=t.micro_batch_size),
        validation=ValidationConfig(eval_iters=t.eval_batches if run.data.valid_path else 0,
                                    eval_interval=t.eval_every or None),
        optimizer=OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                                  adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
                                  bf16=bf16, params_dtype=torch.float32,
                                  use_distributed_optimizer=distributed_optimizer),
        scheduler=SchedulerConfig(lr_decay_style=o.schedule, lr_warmup_iters=o.warmup_steps,
                                  lr_decay_iters=max(t.max_steps, o.warmup_steps + 1),
                                  start_weight_decay=o.weight_decay, end_weight_decay=o.weight_decay,
                                  weight_decay_incr_style="constant",
                                  # the config decides the schedule on resume, as in nemo-anchor train, so a run
                                  # may be extended (train.train_iters=3, then 6)
                                  override_opt_param_scheduler=True),
        ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer,
                                          overlap_grad_reduce=None, overlap_param_gather=None),
        dataset=AnchorPackedDatasetProvider(path=None if run.data.path == "???" else run.data.path,
                                            valid_path=run.data.valid_path, seed=t.seed, shuffle=run.data.shuffle),
        logger=LoggerConfig(log_interval=t.log_every),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=vocab_size),
        checkpoint=CheckpointConfig(save=None, save_interval=run.checkpoint.save_every or t.max_steps,
                                    most_recent_k=run.checkpoint.keep_last, ckpt_format="torch_dist", async_save=None),
        rng=RNGConfig(seed=t.seed),
        dist=DistributedInitConfig(distributed_backend=launch.AUTO),
        mixed_precision=mixed_precision,
    )


def _paper(path: Path) -> Callable[[], ConfigContainer]:
    def recipe() -> ConfigContainer:
        return from_run_config(presets.paper_run(path.stem))

    recipe.__doc__ = f"The run of {path.relative_to(CONFIGS.parent)}, with the planner's recompute (nemo_anchor.training.presets)."
    return recipe


def anchor_smollm2_135m() -> ConfigContainer:
    """SmolLM2-135M (Llama-shaped: 30 layers, hidden 576, 9 query / 3 KV heads, tied embeddings, vocabulary
    49152, RoPE base 1e5) continued at 4096 tokens, as ``configs/ablation/smollm2.yaml``: bf16 on a GPU, fp32
    on a CPU (decided where it trains). Start from ``checkpoint.pretrained_checkpoint=<import_hf of prepare_smollm2()>``."""
    model = ModelConfig(architecture="llama", num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                        num_attention_heads=9, num_query_groups=3, tie_embeddings=True, vocab_size=49152,
                        seq_length=4096, rotary_base="100000")
    run = RunConfig(model=model, trainer=TrainerConfig(max_steps=8, global_batch_size=1, micro_batch_size=1,
                                                       precision=launch.AUTO),
                    optim=OptimConfig(lr=1e-4, min_lr=1e-4))
    return from_run_config(run)


def fit_layout(model: ModelConfig, vocab_size: int, gpus: int, gpu: str | float = presets.PAPER_GPU, *,
               micro_batch_size: int = 1) -> ModelConfig:
    """``model`` with the fewest tensor-parallel ranks (up to 8), then the smallest context-parallel size, then
    the fewest recomputed layers, that ``nemo-anchor plan`` says fit ``gpus`` GPUs ``gpu`` (a card name or nominal
    GB, as ``nemo-anchor plan --gpu-memory``; ValueError when none does)."""
    gpu_bytes = memory.gpu_memory(gpu)[0]

    def fits(candidate: ModelConfig) -> bool:
        layout = memory.Layout(gpus, tensor=candidate.tensor_model_parallel_size,
                               context=candidate.context_parallel_size)
        return memory.plan_memory(candidate, vocab_size, layout, gpu_bytes=gpu_bytes,
                                  micro_batch_size=micro_batch_size).fits

    for tp, cp in ((tp, cp) for tp in (1, 2, 4, 8) for cp in (1, 2, 4, 8, 16, 32, 64)
                   if tp * cp <= gpus and gpus % (tp * cp) == 0 and model.seq_length % (2 * cp) == 0):
        try:
            plain = replace(model, tensor_model_parallel_size=tp, context_parallel_size=cp, recompute="none",
                            recompute_num_layers=None)
        except ValueError:  # the heads do not split over these ranks
            continue
        if fits(plain):
            return plain
        recomputing = [replace(plain, recompute="full", recompute_num_layers=n) for n in range(1, model.num_layers + 1)]
        if fits(recomputing[-1]):  # memory falls with every recomputed layer: the first that fits
            return recomputing[bisect.bisect_left(recomputing, True, key=fits)]
    raise ValueError(f"no context-parallel size up to {gpus} (tensor parallel up to 8) with full recompute fits "
                     f"{model.seq_length}-token windows on {gpus} x {gpu}: add GPUs")


def llama3_context_extension(seq_length: int = 131_072, rope: str = "paper", gpus: int = presets.PAPER_GPUS,
                             gpu: str | float = presets.PAPER_GPU) -> ConfigContainer:
    """Continued pretraining of an HF Llama 3.x (8B shape) to ``seq_length`` with AnchorAttention.

    ``rope``: ``paper`` (the paper's base schedule: 5M at 64K, 10M at 128K) or ``llama3.1`` (base
    500K with Llama 3.1's frequency scaling, factor ``seq_length / 8192``). Tensor and context parallelism and
    recompute come from the memory planner for ``gpus`` x ``gpu`` (a card name or nominal GB). Start from
    ``checkpoint.pretrained_checkpoint=<import_hf output of the HF model>``.
    """
    run = load_config(presets.paper_config("llama3-8b-128k"), ("model.init_from_hf=null",))
    if rope == "paper":
        model = replace(run.model, seq_length=seq_length, rotary_base="auto", rope_scaling="none")
    elif rope == "llama3.1":
        model = replace(run.model, seq_length=seq_length, rotary_base="500000", rope_scaling="llama3",
                        rope_scaling_factor=seq_length / LLAMA3_ORIGINAL_WINDOW,
                        original_max_position_embeddings=LLAMA3_ORIGINAL_WINDOW)
    else:
        raise ValueError(f"rope={rope!r}: choose 'paper' or 'llama3.1'")
    model = fit_layout(model, model.vocab_size, gpus, gpu, micro_batch_size=run.trainer.micro_batch_size)
    return from_run_config(replace(run, model=model))


RECIPES: dict[str, Callable[[], ConfigContainer]] = {
    "anchor_smollm2_135m": anchor_smollm2_135m,
    **{path.stem.replace("-", "_").replace(".", "p"): _paper(path) for path in sorted(presets.PAPER_CONFIGS.glob("*.yaml"))},
    "llama3_context_extension_64k": lambda: llama3_context_extension(65_536),
    "llama3_context_extension_128k": lambda: llama3_context_extension(131_072),
}


def get_recipe(name: str) -> ConfigContainer:
    if name not in RECIPES:
        raise ValueError(f"--recipe {name!r}: choose one of {sorted(RECIPES)}")
    return RECIPES[name]()
