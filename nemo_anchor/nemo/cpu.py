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

Training itself also needs the CPU accelerator (Lightning then uses gloo), fp32 and
``use_cpu_initialization=True``: the training process picks them when it sees no CUDA
(``nemo_anchor.launch``, through the recipes' ``accelerator="auto"`` and
``nemo_anchor.nemo.strategy``, and ``AnchorConfigMixin``). Neither is a CPU matter: NeMo 2.7.3's call of
megatron-core 0.16's optimizer factory is a version mismatch (``nemo_anchor.nemo.compat``), and resuming
the distributed optimizer over torch's Adam, which megatron-core runs wherever Apex's and TE's Adam are
missing, is ``AnchorMegatronStrategy``'s (``nemo_anchor.training.optimizer_state``).
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


def _restore_checkpoints_on_the_cpu() -> None:
    from nemo.lightning.io import pl

    pl._fix_tensors_device = lambda checkpoint: checkpoint  # tensors load on the CPU, where they stay
