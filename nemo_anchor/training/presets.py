"""The paper's runs, one source for every front door: ``configs/paper/*.yaml`` with the activation
recompute ``nemo-anchor plan`` gives for the paper's hardware (8 GPUs of 80 GB).

Our trainer reads the YAML files; the NeMo recipes (``nemo_anchor.nemo.recipes``) and the Bridge
recipes (``nemo_anchor.bridge.recipes``) are built from :func:`paper_run`, so a layout or recompute
count is written once, and checked against the planner (``tests/test_memory_plan.py``).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from nemo_anchor.training import memory
from nemo_anchor.training.config import RunConfig, load_config

PAPER_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "paper"
PAPER_GPUS = 8
PAPER_GPU = "h100-80gb"


def paper_config(name: str) -> Path:
    """``configs/paper/<name>.yaml``; ValueError naming the choices when there is none."""
    path = PAPER_CONFIGS / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in PAPER_CONFIGS.glob("*.yaml"))
        raise ValueError(f"no paper config {name!r} in {PAPER_CONFIGS}: choose one of {names}")
    return path


def planned_run(run: RunConfig, gpus: int = PAPER_GPUS, gpu: str = PAPER_GPU) -> RunConfig:
    """``run`` with the fewest fully recomputed layers per pipeline stage that the memory planner fits on
    ``gpus`` x ``gpu`` in the run's own layout, or without recompute when it fits as it is.

    Raises:
        ValueError: not even recomputing every layer fits; names the planner's smallest change.
    """
    m, t = run.model, run.trainer
    layout = memory.Layout(gpus, m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size)
    options = dict(gpu_bytes=memory.gpu_memory(gpu)[0], micro_batch_size=t.micro_batch_size,
                   bf16=t.precision == "bf16", distributed_optimizer=t.distributed_optimizer)
    vocab = m.vocab_size
    plain = m if m.recompute != "full" else replace(m, recompute="none", recompute_num_layers=None)
    if memory.plan_memory(plain, vocab, layout, **options).fits:
        return replace(run, model=plain)
    layers = memory.fewest_recomputed_layers(m, vocab, layout, **options)
    if layers is None:
        fix = memory.suggest(m, vocab, layout, **options)
        raise ValueError(f"{m.seq_length}-token windows do not fit {gpus} x {gpu} in this layout even with every "
                         f"layer recomputed; nemo-anchor plan suggests: {fix}")
    return replace(run, model=replace(m, recompute="full", recompute_num_layers=layers))


def paper_run(name: str, overrides: tuple[str, ...] = ()) -> RunConfig:
    """The run of ``configs/paper/<name>.yaml`` (with ``key=value`` overrides) and the planner's recompute."""
    return planned_run(load_config(paper_config(name), overrides))
