"""What Megatron-Bridge 0.6 needs, beyond :mod:`nemo_anchor.parallel.cpu_shims`, to run without CUDA.

Installed only when ``torch.cuda.is_available()`` is False; GPU runs use Bridge untouched. Each
shim answers one CUDA assumption of Bridge (file:line in megatron-bridge 0.6.2) without changing
the arithmetic:

Importing (:func:`install_import_shims`, before ``import megatron.bridge``):

- ``peft/lora_layers.py:20`` imports Transformer Engine unconditionally (reached from
  ``megatron/bridge/__init__.py``); TE's torch extension has no CPU build. That one module gets
  a stand-in ``transformer_engine`` while it executes, so Megatron-Core still sees no TE.
- ``training/pretrain.py:19`` imports ``nvidia_resiliency_ext.inprocess.CallWrapper`` for a type
  annotation. The only nvrx on PyPI (0.4.1) breaks ``import megatron.core`` (``nvrx.py:44``
  wants 0.6), so it stays absent and that module gets a stand-in while it executes.
- ``peft/utils.py:67`` looks up ``FP8GlobalStateManager`` in megatron-core's TE extension, which has it only
  when TE is installed; Bridge's ``safe_import_from`` logs the ``AttributeError`` and its traceback at INFO
  (``utils/import_utils.py:333``; twice once the root logger has a handler: its logger has one of its own), so
  every run began with a traceback. Bridge takes the name as absent, as it is: without TE, records of a name
  missing from that extension are not logged (any other is, and an import that fails otherwise still raises).

Running (:func:`install_runtime_shims`, once ``megatron.bridge`` imports):

- ``training/setup.py:253`` never passes ``initialize_megatron(allow_no_cuda=True)``
  (``initialize.py:91`` asserts CUDA).
- ``initialize.py:147`` runs ``compile_helpers()``, whose ``make`` has no Makefile in the
  megatron-core wheel (``megatron/core/datasets/utils.py:30`` exits); the wheel's prebuilt
  ``helpers_cpp`` is used when it imports.
- ``initialize.py:886`` warms up CUDA JIT kernels: skipped.
- ``initialize.py:869`` seeds Megatron's model-parallel RNG tracker only when a GPU is counted;
  here it is seeded with the CPU tracker of ``cpu_shims``.
- ``setup.py:276``, ``train.py``, ``eval.py``, ``utils/train_utils.py:551`` (and the other
  flag and norm tensors there), ``data/loaders.py:406``, ``checkpointing.py:491`` (CUDA RNG
  state) and megatron-core's ``training/models/dist_utils.py:303`` allocate on, stream on or read
  the RNG of CUDA: they see the CPU as their CUDA device (``cpu_shims``).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import re
import sys
import types

import torch

from nemo_anchor.parallel.cpu_shims import install_cpu_shims, route_cuda_to_cpu

# module -> the absent modules it imports unconditionally without needing them
_STAND_INS = {
    "megatron.bridge.peft.lora_layers": ("transformer_engine", "transformer_engine.pytorch"),
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"),
}
_CUDA_ASSUMING_MODULES = ("megatron.bridge.training.setup", "megatron.bridge.training.train",
                          "megatron.bridge.training.eval", "megatron.bridge.training.utils.train_utils",
                          "megatron.bridge.data.loaders", "megatron.bridge.training.checkpointing",
                          "megatron.training.models.dist_utils")
_import_shims = False
_runtime_shims = False


class _Placeholder(type):
    """A class standing in for any name of an absent package: defining code works, ``isinstance`` is False."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _LoaderWithStandIns(importlib.abc.Loader):
    """Executes a module with stand-ins for the absent ``names`` in ``sys.modules``, then removes them."""

    def __init__(self, loader, names: tuple[str, ...]):
        self.loader, self.names = loader, names

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        absent = importlib.util.find_spec(self.names[0]) is None
        if not absent:
            return self.loader.exec_module(module)
        for name in self.names:
            sys.modules[name] = _StandInModule(name)
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, sys.modules[name])
        try:
            self.loader.exec_module(module)
        finally:
            for name in self.names:
                sys.modules.pop(name, None)


class _NoTransformerEngineNames(logging.Filter):
    """Drops Bridge's record of a name missing from megatron-core's TE extension (TE absent)."""

    MISSING = re.compile(r"Import of \w+ from megatron\.core\.extensions\.transformer_engine failed with:")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.MISSING.match(record.getMessage())


class _StandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _STAND_INS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None:
            spec.loader = _LoaderWithStandIns(spec.loader, _STAND_INS[fullname])
        return spec


def install_import_shims() -> bool:
    """Before ``import megatron.bridge``: megatron-core's CPU shims and the stand-ins; returns whether active."""
    global _import_shims
    if torch.cuda.is_available():
        return False
    if not _import_shims:
        sys.meta_path.insert(0, _StandInFinder())
        if importlib.util.find_spec("transformer_engine") is None:
            logging.getLogger("megatron.bridge.utils.import_utils").addFilter(_NoTransformerEngineNames())
        _import_shims = True
    install_cpu_shims()
    return True


def install_runtime_shims() -> bool:
    """Once ``megatron.bridge`` imports: the shims for conversion and ``pretrain()``; returns whether active."""
    global _runtime_shims
    if not install_import_shims():
        return False
    if _runtime_shims:
        return True
    from megatron.bridge.training import initialize, setup

    setup.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    initialize.compile_helpers = functools.partial(_prebuilt_helpers_or, initialize.compile_helpers)
    initialize._warmup_jit_function = lambda *args, **kwargs: None
    initialize._set_random_seed = _seeding_the_cpu_tracker(initialize._set_random_seed)
    route_cuda_to_cpu(_CUDA_ASSUMING_MODULES)
    _runtime_shims = True
    return True


def _prebuilt_helpers_or(compile_helpers) -> None:
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        compile_helpers()


def _seeding_the_cpu_tracker(set_random_seed):
    @functools.wraps(set_random_seed)
    def seeded(seed_, data_parallel_random_init=False, *args, pg_collection, **kwargs):
        set_random_seed(seed_, data_parallel_random_init, *args, pg_collection=pg_collection, **kwargs)
        # the seed Bridge derives (initialize.py:859-866), given to the tracker it skipped without a GPU
        rank = torch.distributed.get_rank()
        seed = seed_ + 100 * torch.distributed.get_group_rank(pg_collection.pp, rank)
        if data_parallel_random_init:
            seed += 10 * torch.distributed.get_group_rank(pg_collection.dp, rank)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    return seeded
