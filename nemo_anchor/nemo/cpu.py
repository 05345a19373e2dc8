"""NeMo 2.7.3 on a machine without CUDA: the one place that teaches ``llm.pretrain`` to run on the CPU.

:func:`install` is called when ``nemo_anchor.nemo`` configs or recipes are imported. With CUDA it
does nothing. Without CUDA it installs the project's Megatron CPU shims
(``nemo_anchor.parallel.cpu_shims``), points NeMo's CUDA-assuming modules at the same shims, and
wraps the few NeMo functions that cannot run on the CPU, each with the narrowest wrapper:

- ``nemo/lightning/megatron_parallel.py:617`` opens ``torch.cuda.Stream()`` around DDP setup, and
  ``:142``/``:348`` move batches and losses to ``torch.cuda.current_device()``;
- ``nemo/lightning/pytorch/strategies/megatron_strategy.py:801-888`` and
  ``nemo/lightning/pytorch/plugins/data_sampler.py:192,212`` log step values through
  ``torch.tensor(x, pin_memory=True).to("cuda")``;
- ``ckpt_async_save=True`` (``megatron_strategy.py:289``, NeMo's default and the recipes' with CUDA) writes through
  NeMo's async checkpoint queue and tensorstore: saves are synchronous on the CPU;
- ``nemo/lightning/io/pl.py:495`` (``_fix_tensors_device``) asserts CUDA is initialised when a
  checkpoint is restored: loaded tensors stay on the CPU.
- resuming: without TE or apex, megatron-core 0.16.1's distributed optimizer falls back to
  ``torch.optim.AdamW``, whose state is empty until the first step, and its ``state_dict``
  (``megatron/core/optimizer/distrib_optimizer.py:642``) asserts on that empty state when NeMo
  builds the state to load into (``megatron_strategy.py:1171``). The state is created first, as
  Megatron-LM does before a load (``_init_optimizer_states_with_dummy_values``). Loading it into
  fp32 parameters (``distrib_optimizer.py:940``) writes in place into views of leaf parameters, so
  it runs without autograd; and the ``dp_reshardable`` load takes AdamW's step count from the
  placeholder state, so the count is set to the restored global step (one optimizer step each).

Training itself also needs the CPU accelerator (Lightning then uses gloo), fp32 and
``use_cpu_initialization=True``: the training process picks them when it sees no CUDA
(``nemo_anchor.launch``, through the recipes' ``accelerator="auto"`` and
``nemo_anchor.nemo.strategy``, and ``AnchorConfigMixin``). NeMo 2.7.3's call of megatron-core
0.16's optimizer factory is a version mismatch, not a CPU matter: ``nemo_anchor.nemo.compat``.
"""
from __future__ import annotations

import functools

import torch

from nemo_anchor.parallel.cpu_shims import install_cpu_shims, route_cuda_to_cpu

_installed = False


def on_cpu() -> bool:
    """Whether NeMo runs on the CPU here (no CUDA device)."""
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch NeMo for the CPU once, when CUDA is absent; returns whether NeMo runs on the CPU."""
    global _installed
    if not on_cpu():
        return False
    if not _installed:
        install_cpu_shims()
        from nemo.lightning import megatron_parallel
        from nemo.lightning.pytorch.plugins import data_sampler
        from nemo.lightning.pytorch.strategies import megatron_strategy
        from nemo.utils import logging

        route_cuda_to_cpu(module.__name__ for module in (megatron_parallel, megatron_strategy, data_sampler))
        _save_checkpoints_synchronously(megatron_strategy.MegatronStrategy)
        _create_optimizer_state_before_a_load(megatron_strategy.MegatronStrategy)
        _load_optimizer_state_into_fp32_parameters(megatron_strategy.MegatronStrategy)
        _restore_checkpoints_on_the_cpu()
        _installed = True
        logging.info("nemo_anchor: no CUDA device, NeMo runs on the CPU (gloo, synchronous checkpoints, "
                     "Megatron CPU shims)")
    return True


def _save_checkpoints_synchronously(strategy_class) -> None:
    original = strategy_class.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        if on_cpu():
            kwargs["ckpt_async_save"] = False  # the async path needs CUDA and tensorstore
        original(self, *args, **kwargs)

    strategy_class.__init__ = __init__


def _megatron_optimizers(strategy) -> list:
    """The Megatron-Core optimizers (each of a chain) behind a strategy's NeMo optimizers."""
    optimizers = strategy.lightning_module.optimizers(use_pl_optimizer=False)
    found = []
    for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
        mcore = getattr(optimizer, "mcore_optimizer", optimizer)
        found.extend(getattr(mcore, "chained_optimizers", [mcore]))
    return found


def _create_optimizer_state_before_a_load(strategy_class) -> None:
    original = strategy_class.optimizer_sharded_state_dict

    @functools.wraps(original)
    def optimizer_sharded_state_dict(self, is_loading=False, **kwargs):
        if is_loading:
            for optimizer in _megatron_optimizers(self):
                if hasattr(optimizer, "_init_optimizer_states_with_dummy_values") and not optimizer.optimizer.state:
                    optimizer._init_optimizer_states_with_dummy_values()  # values are replaced by the load
        return original(self, is_loading=is_loading, **kwargs)

    strategy_class.optimizer_sharded_state_dict = optimizer_sharded_state_dict


def _load_optimizer_state_into_fp32_parameters(strategy_class) -> None:
    original = strategy_class.load_optimizer_state_dict

    @functools.wraps(original)
    def load_optimizer_state_dict(self, *args, **kwargs):
        with torch.no_grad():
            original(self, *args, **kwargs)
        for optimizer in _megatron_optimizers(self):
            for state in getattr(optimizer.optimizer, "state", {}).values():
                if torch.is_tensor(state.get("step")):  # one tensor each: AdamW increments them in place
                    state["step"] = torch.tensor(float(self.trainer.global_step), dtype=state["step"].dtype)

    strategy_class.load_optimizer_state_dict = load_optimizer_state_dict


def _restore_checkpoints_on_the_cpu() -> None:
    from nemo.lightning.io import pl

    pl._fix_tensors_device = lambda checkpoint: checkpoint  # tensors load on the CPU, where they stay
