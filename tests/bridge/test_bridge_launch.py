"""Megatron-Bridge's front door decides the device where ``pretrain()`` starts, not where the recipe is built.

A ``ConfigContainer`` recipe built without CUDA prints (``print_yaml``, what Bridge saves as
``run_config.yaml``) as the one built where GPUs are seen; ``nemo_anchor.launch.resolve_bridge_config``
and the provider's ``finalize()`` then fill the device choices in the training process. CUDA and
Transformer Engine are stand-ins here (patched after the imports, as on a GPU node).
"""
import contextlib
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

import nemo_anchor.bridge  # noqa: E402,F401
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from nemo_anchor import gpu, launch  # noqa: E402
from nemo_anchor.bridge.recipes import RECIPES, anchor_smollm2_135m  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FUSIONS = ("bias_activation_fusion", "cross_entropy_loss_fusion", "persist_layer_norm", "apply_rope_fusion")


@pytest.fixture
def gpu_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (object(), None))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)


def _printed(recipe) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        recipe().print_yaml()
    return out.getvalue()


def test_recipes_print_the_same_built_with_or_without_cuda(monkeypatch, gpu_node):
    with monkeypatch.context() as cpu_node:
        cpu_node.setattr(torch.cuda, "is_available", lambda: False)
        cpu_node.setattr(torch.cuda, "device_count", lambda: 0)
        cpu_node.setattr(gpu, "transformer_engine_pytorch", lambda: (None, "no TE"))
        built_on_cpu = {name: _printed(recipe) for name, recipe in RECIPES.items()}
    for name, recipe in RECIPES.items():
        assert _printed(recipe) == built_on_cpu[name], name
    smollm2 = built_on_cpu["anchor_smollm2_135m"]
    assert "distributed_backend: auto" in smollm2 and "mixed_precision: auto" in smollm2
    assert "use_cpu_initialization: false" in smollm2 and "overlap_grad_reduce: null" in smollm2


def _launched(save="/ckpt"):
    config = anchor_smollm2_135m()
    config.checkpoint.save = save
    return config


def test_the_cpu_process_trains_over_gloo_in_fp32_unfused():
    config = _launched()
    launch.resolve_bridge_config(config)
    config.model.finalize()
    assert config.dist.distributed_backend == "gloo" and config.mixed_precision is None
    assert not (config.ddp.overlap_grad_reduce or config.ddp.overlap_param_gather or config.checkpoint.async_save)
    assert not any(getattr(config.model, name) for name in FUSIONS) and config.model.use_cpu_initialization


def test_a_gpu_process_trains_over_nccl_in_bf16_overlapped_async_and_fused(gpu_node):
    config = _launched()
    launch.resolve_bridge_config(config)
    config.model.finalize()
    assert config.dist.distributed_backend == "nccl" and config.mixed_precision == "bf16_mixed"
    assert config.ddp.overlap_grad_reduce and config.checkpoint.async_save
    assert config.ddp.overlap_param_gather == config.ddp.use_distributed_optimizer  # its all-gather, where sharded
    assert all(getattr(config.model, name) for name in FUSIONS) and not config.model.use_cpu_initialization
    unsaved = _launched(save=None)
    launch.resolve_bridge_config(unsaved)
    assert not unsaved.checkpoint.async_save  # Bridge's async writer needs a save directory


def test_what_the_user_sets_wins(gpu_node):
    config = _launched()
    config.mixed_precision, config.dist.distributed_backend = None, "gloo"
    config.ddp.overlap_grad_reduce, config.checkpoint.async_save = False, False
    config.model.cross_entropy_loss_fusion = False
    launch.resolve_bridge_config(config)
    config.model.finalize()
    assert config.mixed_precision is None and config.dist.distributed_backend == "gloo"
    assert not (config.ddp.overlap_grad_reduce or config.checkpoint.async_save)
    assert not config.model.cross_entropy_loss_fusion and config.model.bias_activation_fusion
    yarn = _launched()
    yarn.model.position_embedding_type, yarn.model.yarn_rotary_scaling_factor = "yarn", 4.0
    yarn.model.finalize()
    assert not yarn.model.apply_rope_fusion and yarn.model.cross_entropy_loss_fusion  # the one RoPE rule


NOTHING_PATCHED = r'''
import importlib
import importlib.util
import pathlib
import sys
import torch
import nemo_anchor
from nemo_anchor.parallel import cpu_shims

# Transformer Engine is what a GPU node has where this machine needs the import stand-ins: their finder is
# taken from a separate copy of nemo_anchor/bridge/cpu.py, so that the package (which installs shims where it
# sees no CUDA) is first imported below, with the CUDA stand-in in place
spec = importlib.util.spec_from_file_location("stand_in_source", pathlib.Path(nemo_anchor.__file__).parent / "bridge" / "cpu.py")
stand_in_source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stand_in_source)
sys_path_finder = stand_in_source._StandInFinder()
sys.meta_path.insert(0, sys_path_finder)
from megatron.bridge.training import initialize, setup
sys.meta_path.remove(sys_path_finder)
original = setup.initialize_megatron
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 8

import nemo_anchor.bridge  # installs what Bridge needs here
bridge_cpu_shims = sys.modules["nemo_anchor.bridge.cpu"]
assert not bridge_cpu_shims.install_runtime_shims() and not cpu_shims._installed
assert setup.initialize_megatron is original and not bridge_cpu_shims._import_shims
modules = [importlib.import_module(name) for name in bridge_cpu_shims._CUDA_ASSUMING_MODULES]
modules += [importlib.import_module(f"megatron.core.{name}") for name in cpu_shims._CUDA_ASSUMING_MODULES]
assert all(module.torch is torch for module in modules), [m.__name__ for m in modules if m.torch is not torch]
print("untouched")
'''


def test_no_cpu_shim_acts_in_a_process_that_sees_cuda():
    done = subprocess.run([sys.executable, "-c", NOTHING_PATCHED], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0 and "untouched" in done.stdout, (done.stdout + done.stderr)[-3000:]
