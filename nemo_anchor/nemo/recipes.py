"""NeMo 2 recipes for AnchorAttention long-context continued pretraining (the paper's Table 1).

Each recipe is a ``run.Partial`` of ``llm.pretrain``, registered as a NeMo-Run factory::

    nemo llm pretrain --factory nemo_anchor.nemo.recipes.anchor_llama2_7b --yaml run.yaml

(the dotted path imports this module, which registers the factories). ``run.yaml`` overrides
any field, for example::

    data:
      path: /data/slimpajama-128k        # nemo-anchor pack --seq-length 131072 output
    model:
      config:
        attention_type: anchor           # full | intra_doc | intra_doc_reset | anchor
    resume:
      restore_config:
        path: /ckpt/llama2-7b-nemo       # `nemo llm import` of the HF model to continue from

A recipe is the same wherever it is built: the process that trains decides what its devices
decide (``nemo_anchor.nemo.strategy``, ``nemo_anchor.launch``): bf16, NCCL and Megatron's fusions
on GPUs, fp32 and gloo on a machine without CUDA (``nemo_anchor.nemo.cpu``); a value set in the
recipe or its YAML wins. ``anchor_smollm2_135m`` is the one small enough to train on a CPU.
Every run writes ``metrics.jsonl`` in its log directory (``AnchorMetricsCallback``). See
``configs/nemo/README.md``.
"""

from typing import Optional

import fiddle as fdl
import lightning.pytorch as pl
import nemo_run as run
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from nemo import lightning as nl
from nemo.collections import llm
from nemo.collections.llm.recipes.log.default import default_log, default_resume, tensorboard_logger

from nemo_anchor.model.config import paper_rotary_base
from nemo_anchor.nemo.config import PRESETS, AnchorLlamaConfig, AnchorMistralConfig, AnchorQwen2Config
from nemo_anchor.nemo.data import AnchorPackedDataModule
from nemo_anchor.nemo.metrics import AnchorMetricsCallback
from nemo_anchor.nemo.run_guard import AnchorNeMoLogger, AnchorPreemption, AnchorRunGuard
from nemo_anchor.nemo.models import AnchorLlamaModel, AnchorMistralModel, AnchorQwen2Model, model_class_for
from nemo_anchor.nemo.strategy import AnchorMegatronStrategy, AnchorMixedPrecision
from nemo_anchor.training import presets


def anchor_trainer(num_nodes: int = 1, num_gpus_per_node: int = 8, tensor_parallelism: int = 1,
                   context_parallelism: int = 8, max_steps: int = 2000) -> run.Config[nl.Trainer]:
    """Megatron strategy, no sampler of Lightning's, ``metrics.jsonl``. What the devices decide is left
    to the process that trains (``nemo_anchor.nemo.strategy``): with CUDA bf16 mixed precision (fp32
    master weights and grads), asynchronous saves, overlapped gradient reduction and parameter
    gather, NCCL; without CUDA fp32 on the CPU over gloo.

    Gradients are summed over data-parallel ranks (``average_in_collective=False``) and the
    configs' ``calculate_per_token_loss`` divides them by the global batch's loss tokens, so a
    multi-rank packed run equals one rank (gloo's AVG reduce-scatter sums, pytorch#162338).
    """
    strategy = run.Config(
        AnchorMegatronStrategy,
        tensor_model_parallel_size=tensor_parallelism,
        context_parallel_size=context_parallelism,
        sequence_parallel=tensor_parallelism > 1,
        gradient_as_bucket_view=True,
        ddp=run.Config(DistributedDataParallelConfig, grad_reduce_in_fp32=True, overlap_grad_reduce=None,
                       overlap_param_gather=None, average_in_collective=False, check_for_nan_in_grad=True),
    )
    return run.Config(
        nl.Trainer,
        accelerator="auto",  # Lightning's: the GPU where CUDA is, the CPU elsewhere
        devices=num_gpus_per_node,
        num_nodes=num_nodes,
        strategy=strategy,
        plugins=run.Config(AnchorMixedPrecision, autocast_enabled=False, grad_reduce_in_fp32=True),
        max_steps=max_steps,
        log_every_n_steps=1,
        val_check_interval=max_steps,
        check_val_every_n_epoch=None,  # val_check_interval counts steps, not a fraction of an epoch
        limit_val_batches=8,
        use_distributed_sampler=False,
        # the run guards of nemo-anchor train: lock, tokenizer, resume comparison; SIGTERM/SIGINT/SIGUSR1 -> save, 75
        callbacks=[run.Config(AnchorMetricsCallback), run.Config(AnchorRunGuard), run.Config(AnchorPreemption)],
    )


def anchor_optimizer(lr: float = 2e-5) -> run.Config[nl.MegatronOptimizerModule]:
    """The paper's AdamW: weight decay 0.1, betas (0.9, 0.95), constant learning rate 2e-5 (no
    scheduler), clipping at 1; the precision plugin sets its bf16 where the run is bf16."""
    return run.Config(
        nl.MegatronOptimizerModule,
        config=run.Config(OptimizerConfig, optimizer="adam", lr=lr, weight_decay=0.1, adam_beta1=0.9,
                          adam_beta2=0.95, clip_grad=1.0, use_distributed_optimizer=True),
    )


def anchor_log(dir: Optional[str], name: str) -> run.Config[nl.NeMoLogger]:
    """NeMo's default logger (as :class:`~nemo_anchor.nemo.run_guard.AnchorNeMoLogger`); its last checkpoint keeps the optimizer state (a resume continues the
    run exactly), and the checkpoint name needs no validation loss (the runs have none by default)."""
    log = default_log(dir=dir, name=name, tensorboard_logger=tensorboard_logger(name=name))
    fdl.update_callable(log, AnchorNeMoLogger)  # the run's lock before NeMo writes into its directory
    log.ckpt.filename = "{step}-{consumed_samples}"
    log.ckpt.save_optim_on_train_end = True
    return log


def anchor_pretrain_recipe(
    preset: str = "llama2_7b",
    data_path: Optional[str] = None,
    dir: Optional[str] = None,
    name: str = "anchor",
    attention_type: str = "anchor",
    seq_length: int = 131_072,
    num_nodes: int = 1,
    num_gpus_per_node: int = 8,
    tensor_parallelism: int = 1,
    context_parallelism: int = 8,
    max_steps: int = 2000,
    global_batch_size: int = 8,
    micro_batch_size: int = 1,
    lr: float = 2e-5,
    rotary_base: Optional[float] = None,
    recompute_num_layers: Optional[int] = None,
    restore_path: Optional[str] = None,
) -> run.Partial:
    """``llm.pretrain`` of a paper preset (``nemo_anchor.nemo.config.PRESETS``) on packed windows.

    The RoPE base follows the paper's schedule for ``seq_length`` (5M at 64K, 10M at 128K).
    ``data_path`` is a ``nemo-anchor pack`` directory packed at ``seq_length``.
    ``recompute_num_layers``: full activation recompute (block method) of that many layers per
    GPU; the paper presets below pass what ``nemo-anchor plan`` gives for their ``configs/paper`` file.
    ``restore_path``: the weights to start from (``nemo llm import`` / ``llm.import_ckpt`` output);
    the same as ``resume.restore_config.path``.
    """
    rotary_base = paper_rotary_base(seq_length) if rotary_base is None else rotary_base
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {sorted(PRESETS)}")
    config_class = PRESETS[preset]
    recompute = ({} if not recompute_num_layers else
                 dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=recompute_num_layers))
    # the fusions (cross-entropy, bias-SwiGLU, RoPE, persistent norm) are decided where the model is
    # built: on with CUDA and TE, off on the CPU (nemo_anchor.launch)
    model = run.Config(model_class_for(config_class), config=run.Config(
        config_class, attention_type=attention_type, seq_length=seq_length, rotary_base=rotary_base,
        calculate_per_token_loss=True, **recompute))
    data = run.Config(AnchorPackedDataModule, path=data_path, seq_length=seq_length,
                      micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
    resume = default_resume()
    if restore_path is not None:
        resume.restore_config = run.Config(nl.RestoreConfig, path=restore_path)
    return run.Partial(
        llm.pretrain,
        model=model,
        trainer=anchor_trainer(num_nodes, num_gpus_per_node, tensor_parallelism, context_parallelism, max_steps),
        data=data,
        log=anchor_log(dir, name),
        optim=anchor_optimizer(lr),
        resume=resume,
    )


def paper_recipe(config: str, preset: str, name: str, data_path: Optional[str], restore_path: Optional[str],
                 seq_length: Optional[int] = None) -> run.Partial:
    """The run of ``configs/paper/<config>.yaml`` (its window, layout, batch, steps, rate, attention type) with
    the recompute ``nemo-anchor plan`` gives for 8x 80 GB (:func:`nemo_anchor.training.presets.paper_run`), on
    NeMo's ``preset`` model; ``seq_length`` other than the file's is planned again."""
    overrides = () if seq_length is None else (f"model.seq_length={seq_length}",)
    paper = presets.paper_run(config, overrides)
    m, t = paper.model, paper.trainer
    if m.pipeline_model_parallel_size != 1:
        raise ValueError(f"configs/paper/{config}.yaml: model.pipeline_model_parallel_size="
                         f"{m.pipeline_model_parallel_size}: the NeMo recipes run tensor x context x data parallel")
    return anchor_pretrain_recipe(
        preset, data_path=data_path, name=name, attention_type=m.attention_type, seq_length=m.seq_length,
        num_gpus_per_node=presets.PAPER_GPUS, tensor_parallelism=m.tensor_model_parallel_size,
        context_parallelism=m.context_parallel_size, max_steps=t.max_steps, global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size, lr=paper.optim.lr,
        recompute_num_layers=m.recompute_num_layers if m.recompute == "full" else None, restore_path=restore_path)


@run.cli.factory(target=llm.pretrain, name="anchor_llama2_7b")
def anchor_llama2_7b(data_path: Optional[str] = None, seq_length: int = 131_072,
                     restore_path: Optional[str] = None) -> run.Partial:
    """Llama-2-7B, the paper's main model: ``configs/paper/llama2-7b-128k.yaml`` (``-64k`` at 65536 tokens)."""
    config = "llama2-7b-64k" if seq_length <= 65_536 else "llama2-7b-128k"
    return paper_recipe(config, "llama2_7b", "anchor_llama2_7b", data_path, restore_path, seq_length)


@run.cli.factory(target=llm.pretrain, name="anchor_llama3_8b")
def anchor_llama3_8b(data_path: Optional[str] = None, seq_length: int = 131_072,
                     restore_path: Optional[str] = None) -> run.Partial:
    """Llama-3-8B: ``configs/paper/llama3-8b-128k.yaml``."""
    return paper_recipe("llama3-8b-128k", "llama3_8b", "anchor_llama3_8b", data_path, restore_path, seq_length)


@run.cli.factory(target=llm.pretrain, name="anchor_mistral_7b_v03")
def anchor_mistral_7b_v03(data_path: Optional[str] = None, seq_length: int = 131_072,
                          restore_path: Optional[str] = None) -> run.Partial:
    """Mistral-7B-v0.3: ``configs/paper/mistral-7b-v0.3-128k.yaml``."""
    return paper_recipe("mistral-7b-v0.3-128k", "mistral_7b_v0.3", "anchor_mistral_7b_v03", data_path, restore_path,
                        seq_length)


@run.cli.factory(target=llm.pretrain, name="anchor_qwen15_1p8b")
def anchor_qwen15_1p8b(data_path: Optional[str] = None, seq_length: int = 131_072,
                       restore_path: Optional[str] = None) -> run.Partial:
    """Qwen-1.5-1.8B: ``configs/paper/qwen1.5-1.8b-128k.yaml``. No BOS token; pack with a tokenizer whose anchor
    is EOS (Section 5.3)."""
    return paper_recipe("qwen1.5-1.8b-128k", "qwen1.5_1.8b", "anchor_qwen15_1p8b", data_path, restore_path,
                        seq_length)


@run.cli.factory(target=llm.pretrain, name="anchor_smollm2_135m")
def anchor_smollm2_135m(data_path: Optional[str] = None, seq_length: int = 8192,
                        restore_path: Optional[str] = None) -> run.Partial:
    """SmolLM2-135M continued with AnchorAttention: one GPU or a CPU (no model or context parallelism).

    ``restore_path``: SmolLM2 imported into NeMo (``nemo llm import
    model=nemo_anchor.nemo.recipes.anchor_llama source=hf://DIR output_path=OUT``) to continue
    from it. The RoPE base stays SmolLM2's 1e5 at its own 8K window.
    """
    return anchor_pretrain_recipe("smollm2_135m", data_path=data_path, seq_length=seq_length, name="anchor_smollm2_135m",
                                  num_gpus_per_node=1, context_parallelism=1, global_batch_size=8,
                                  rotary_base=100_000.0, lr=2e-5, restore_path=restore_path)


# Model factories for `nemo llm import model=... source=hf://DIR`: the HF config decides the shape.
@run.cli.factory(name="anchor_llama")
def anchor_llama() -> run.Config[pl.LightningModule]:
    """An ``AnchorLlamaModel`` (Llama, SmolLM2) to import a Hugging Face model into."""
    return run.Config(AnchorLlamaModel, config=run.Config(AnchorLlamaConfig))


@run.cli.factory(name="anchor_mistral")
def anchor_mistral() -> run.Config[pl.LightningModule]:
    """An ``AnchorMistralModel`` to import a Hugging Face model into."""
    return run.Config(AnchorMistralModel, config=run.Config(AnchorMistralConfig))


@run.cli.factory(name="anchor_qwen2")
def anchor_qwen2() -> run.Config[pl.LightningModule]:
    """An ``AnchorQwen2Model`` to import a Hugging Face model into."""
    return run.Config(AnchorQwen2Model, config=run.Config(AnchorQwen2Config))
