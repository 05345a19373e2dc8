"""NeMo's Megatron strategy and precision plugin with the device choices left to the training process.

The recipes (``nemo_anchor.nemo.recipes``) are built where the user types, often a login node
without GPUs, and run where NeMo-Run sends them. These classes take ``None`` for what the devices
decide and fill it when NeMo builds them, in the training process (``nemo_anchor.launch``):
asynchronous checkpoint saves and overlapped gradient reduction / parameter all-gather with CUDA,
bf16 mixed precision with CUDA and fp32 without, and Megatron's fully parallel checkpoint load
(CUDA only: megatron/core/dist_checkpointing/exchange_utils.py:98-110). A value set in the recipe or
its YAML is kept.

The strategy also resumes Megatron-Core's distributed optimizer over torch's Adam (no Apex or TE Adam,
on any device) exactly, through :mod:`nemo_anchor.training.optimizer_state` as the other front doors do.
"""
import inspect
from pathlib import Path
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from nemo import lightning as nl
from nemo.lightning.pytorch.plugins.mixed_precision import MegatronMixedPrecision
from nemo.utils import logging

from nemo_anchor import launch
from nemo_anchor.nemo.run_guard import guard_of
from nemo_anchor.training import optimizer_state
from nemo_anchor.training.preemption import signals_deferred, start_checkpoint_writer_queue


class AnchorMegatronStrategy(nl.MegatronStrategy):
    """``nl.MegatronStrategy``; ``ckpt_async_save``, ``ckpt_parallel_load`` and the DDP config's
    ``overlap_grad_reduce`` / ``overlap_param_gather`` None are decided by this process's devices."""

    def __init__(self, *args, ckpt_async_save: Optional[bool] = None, ckpt_parallel_load: Optional[bool] = None,
                 **kwargs):
        # built by the training process (the recipe's accelerator "auto" chose nothing): its devices first, said once
        logging.info(f"nemo-anchor: {launch.devices()}")
        super().__init__(*args, ckpt_async_save=launch.async_save() if ckpt_async_save is None else ckpt_async_save,
                         ckpt_parallel_load=launch.cuda() if ckpt_parallel_load is None else ckpt_parallel_load,
                         **kwargs)

    def setup(self, trainer) -> None:
        """NeMo's, then, for training, Megatron's checkpoint writer's results queue started before any signal can
        come: started by the first save, which may be a stop's, it would re-import all of NeMo within the grace
        period (:func:`nemo_anchor.training.preemption.start_checkpoint_writer_queue`)."""
        super().setup(trainer)
        if trainer.training:
            start_checkpoint_writer_queue()

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        """NeMo's save, fenced by the run's lease and with the stop signals held back.

        The lease holder reads the lease file before the save writes anything, and every rank agrees (the save is
        collective): a refused save writes nothing, and a run whose lease was taken over stops there
        (``RunDirInUse``), at its final save too. The signals are held so that the processes Megatron's writer
        starts (its Manager, its writers) survive a signal sent to the whole process group and the preemption save
        after it still works (:func:`nemo_anchor.training.preemption.signals_deferred`)."""
        guard, device = guard_of(self.trainer), self.lightning_module.device
        if guard is not None and not guard.fence_everywhere(f"save {Path(filepath).name}", device):
            guard.stop_if_lost(device, self.trainer.global_step)
            return  # the lease could not be read: this save is skipped, the next one asks again
        with signals_deferred():
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath) -> None:
        """NeMo's removal of an older checkpoint (ModelCheckpoint's top-k), fenced by the run's lease: a run that no
        longer holds it removes nothing from the folder, which is another run's now."""
        guard = guard_of(self.trainer)
        if guard is not None and not guard.fence(f"remove {Path(filepath).name}"):
            return
        super().remove_checkpoint(filepath)

    def optimizer_sharded_state_dict(self, is_loading: bool = False, **kwargs):
        """NeMo's, with torch Adam's state created before a load builds what it loads into
        (NeMo calls this from ``megatron_strategy.py:1171``; :func:`optimizer_state.create_state_for_load`)."""
        if is_loading:
            for optimizer in self._megatron_optimizers():
                optimizer_state.create_state_for_load(optimizer)
        return super().optimizer_sharded_state_dict(is_loading=is_loading, **kwargs)

    def load_optimizer_state_dict(self, *args, **kwargs) -> None:
        """NeMo's, without autograd (fp32 parameters are their own masters: the load writes in place into views
        of leaf parameters, ``distrib_optimizer.py:940`` in megatron-core 0.16.1), then each parameter its own
        Adam step, at the restored global step (:func:`optimizer_state.give_each_parameter_its_adam_step`)."""
        with torch.no_grad():
            super().load_optimizer_state_dict(*args, **kwargs)
        if optimizer_state.torch_adam():
            for optimizer in self._megatron_optimizers():
                optimizer_state.give_each_parameter_its_adam_step(optimizer, self.trainer.global_step)

    def _megatron_optimizers(self) -> list:
        """The Megatron-Core optimizers (each may be a chain) behind this strategy's NeMo optimizers."""
        optimizers = self.lightning_module.optimizers(use_pl_optimizer=False)
        return [getattr(optimizer, "mcore_optimizer", optimizer)
                for optimizer in (optimizers if isinstance(optimizers, list) else [optimizers])]

    def connect(self, model) -> None:
        super().connect(model)  # gives the DDP config the optimizer's use_distributed_optimizer
        if isinstance(self.ddp_config, DistributedDataParallelConfig):
            launch.resolve_ddp_config(self.ddp_config)


class AnchorMixedPrecision(MegatronMixedPrecision):
    """``MegatronMixedPrecision``; ``precision=None``: bf16 mixed precision (bf16 parameters and
    compute, fp32 master weights and gradient reduction) with CUDA, fp32 without."""

    def __init__(self, precision: Optional[str] = None, params_dtype: Optional[torch.dtype] = None,
                 pipeline_dtype: Optional[torch.dtype] = None, **kwargs):
        precision = launch.mixed_precision() if precision is None else precision
        dtype = torch.bfloat16 if precision in ("bf16", "bf16-mixed") else torch.float32  # as NeMo's bf16_mixed()
        super().__init__(precision, params_dtype=params_dtype or dtype, pipeline_dtype=pipeline_dtype or dtype, **kwargs)


def _signature_of(parent, decided_here: tuple[str, ...]) -> inspect.Signature:
    """``parent``'s signature with the ``decided_here`` arguments defaulting to None.

    NeMo records how every strategy and plugin was built by binding the arguments to the class's ``__init__``
    signature (``nemo/lightning/io/mixin.py:580``) and saves that in each checkpoint's context; with a bare
    ``**kwargs`` it would record a dict holding Megatron's DDP config, which cannot be serialized. So the
    subclasses present their parent's named arguments."""
    signature = inspect.signature(parent)
    return signature.replace(parameters=[p.replace(default=None) if p.name in decided_here else p
                                         for p in signature.parameters.values()])


AnchorMegatronStrategy.__init__.__signature__ = _signature_of(nl.MegatronStrategy.__init__,
                                                              ("ckpt_async_save", "ckpt_parallel_load"))
AnchorMixedPrecision.__init__.__signature__ = _signature_of(MegatronMixedPrecision.__init__,
                                                            ("precision", "params_dtype", "pipeline_dtype"))
