"""NeMo 2.7.3 with megatron-core 0.16 (the pinned pair), on any machine: its optimizer factory call.

``nemo/lightning/_strategy_lib.py:712`` calls megatron-core's ``get_megatron_optimizer`` with
``no_weight_decay_cond``/``scale_lr_cond``/``lr_mult``, which megatron-core 0.16 no longer takes (it
has ``config_overrides``): ``llm.pretrain`` fails at its first step on GPUs and CPUs alike.
:func:`install` adapts the call only when the installed megatron-core lacks those arguments (NeMo's
own containers pair NeMo with a megatron-core that takes them, and get nothing from here).
"""
from __future__ import annotations

import contextlib
import functools
import inspect


def install() -> bool:
    """Adapt NeMo's optimizer setup to this megatron-core once; returns whether it was needed."""
    from megatron.core import optimizer as mcore_optimizer
    from nemo.lightning.pytorch.optim import megatron as nemo_optim

    if "no_weight_decay_cond" in inspect.signature(mcore_optimizer.get_megatron_optimizer).parameters:
        return False  # a megatron-core that NeMo's call matches
    setup = nemo_optim.setup_megatron_optimizer
    if getattr(setup, "_anchor_adapted", False):
        return True

    @functools.wraps(setup)
    def setup_megatron_optimizer(*args, **kwargs):
        with _get_megatron_optimizer_taking_nemo_arguments(mcore_optimizer):
            return setup(*args, **kwargs)

    setup_megatron_optimizer._anchor_adapted = True
    nemo_optim.setup_megatron_optimizer = setup_megatron_optimizer
    return True


@contextlib.contextmanager
def _get_megatron_optimizer_taking_nemo_arguments(mcore_optimizer):
    """``get_megatron_optimizer`` accepting NeMo 2.7.3's old keyword arguments at their defaults."""
    original = mcore_optimizer.get_megatron_optimizer

    def get_megatron_optimizer(config, model_chunks, no_weight_decay_cond=None, scale_lr_cond=None,
                               lr_mult=1.0, **kwargs):
        if no_weight_decay_cond is not None or scale_lr_cond is not None or lr_mult != 1.0:
            raise NotImplementedError(
                "MegatronOptimizerModule(no_weight_decay_cond=, scale_lr_cond=, lr_mult=) has no equivalent in "
                "this megatron-core's get_megatron_optimizer (it takes config_overrides): leave them at their defaults")
        return original(config, model_chunks, **kwargs)

    mcore_optimizer.get_megatron_optimizer = get_megatron_optimizer
    try:
        yield
    finally:
        mcore_optimizer.get_megatron_optimizer = original
