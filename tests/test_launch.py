"""The device is decided where a run starts, not where its recipe is built (NeMo 2 front door and ours).

A recipe built without CUDA must equal, serialized as NeMo-Run ships it, the recipe built where GPUs
are seen; the training process then fills what the devices decide (``nemo_anchor.launch``). There is
no GPU here: CUDA is pretended (``torch.cuda.is_available``/``device_count``, after the imports, as on
a GPU node), and so are Transformer Engine and its fused RoPE entry points; the objects built are
NeMo's and Megatron's own.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")

import nemo_run as run  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from nemo_run.core.serialization.yaml import YamlSerializer  # noqa: E402

from nemo_anchor import gpu, launch  # noqa: E402
from nemo_anchor.nemo import recipes  # noqa: E402
from nemo_anchor.nemo.config import AnchorSmolLM2Config135M  # noqa: E402
from nemo_anchor.nemo.strategy import AnchorMegatronStrategy, AnchorMixedPrecision  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FACTORIES = ["anchor_llama2_7b", "anchor_llama3_8b", "anchor_mistral_7b_v03", "anchor_qwen15_1p8b",
             "anchor_smollm2_135m", "anchor_llama", "anchor_mistral", "anchor_qwen2"]
FUSIONS = ("bias_activation_fusion", "cross_entropy_loss_fusion", "persist_layer_norm", "apply_rope_fusion")


@pytest.fixture
def gpu_node(monkeypatch):
    """A process that sees 8 GPUs and Transformer Engine (stand-ins)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (object(), None))
    # TransformerConfig checks that Megatron found TE's fused RoPE kernels when apply_rope_fusion is set
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)


def _serialized() -> dict[str, str]:
    return {name: YamlSerializer().serialize(getattr(recipes, name)()) for name in FACTORIES}


def test_recipes_built_without_cuda_equal_those_built_on_a_gpu_node(monkeypatch, gpu_node):
    with monkeypatch.context() as cpu_node:
        cpu_node.setattr(torch.cuda, "is_available", lambda: False)
        cpu_node.setattr(torch.cuda, "device_count", lambda: 0)
        cpu_node.setattr(gpu, "transformer_engine_pytorch", lambda: (None, "no TE"))
        built_on_cpu = _serialized()
    built_on_gpu = _serialized()
    for name in FACTORIES:
        assert built_on_cpu[name] == built_on_gpu[name], name
    smollm2 = built_on_cpu["anchor_smollm2_135m"]
    assert "accelerator: auto" in smollm2 and "AnchorMixedPrecision" in smollm2 and "bf16" not in smollm2
    assert "overlap_grad_reduce: null" in smollm2 and "fusion" not in smollm2


def test_cpu_process_trains_fp32_synchronously_and_unfused():
    plugin = AnchorMixedPrecision()
    assert plugin.dtype_config.fp32 and not plugin.dtype_config.bf16 and plugin.dtype_config.params_dtype == torch.float32
    strategy = AnchorMegatronStrategy()
    assert not strategy.async_save and not strategy.parallel_load  # Megatron's fully parallel load is CUDA-only
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=None, overlap_param_gather=None,
                                        use_distributed_optimizer=True)
    launch.resolve_ddp_config(ddp)
    assert not (ddp.overlap_grad_reduce or ddp.overlap_param_gather)
    config = AnchorSmolLM2Config135M(num_layers=2)
    assert not any(getattr(config, name) for name in FUSIONS) and config.use_cpu_initialization
    assert launch.backend() == "gloo"


def test_gpu_process_trains_bf16_asynchronously_overlapped_and_fused(gpu_node):
    plugin = AnchorMixedPrecision()
    assert plugin.dtype_config.bf16 and plugin.dtype_config.params_dtype == torch.bfloat16
    assert plugin.precision == "bf16-mixed"
    strategy = AnchorMegatronStrategy()
    assert strategy.async_save and strategy.parallel_load  # the CPU shim that forces synchronous saves is inert here
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=None, overlap_param_gather=None,
                                        use_distributed_optimizer=True)
    launch.resolve_ddp_config(ddp)
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather
    config = AnchorSmolLM2Config135M(num_layers=2)
    assert all(getattr(config, name) for name in FUSIONS) and not config.use_cpu_initialization
    assert launch.backend() == "nccl"
    # the one RoPE rule: the fused kernel only where it computes what the model asks for
    assert not AnchorSmolLM2Config135M(num_layers=2, rope_in_fp32=True).apply_rope_fusion
    yarn = AnchorSmolLM2Config135M(num_layers=2, position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0)
    assert not yarn.apply_rope_fusion and yarn.cross_entropy_loss_fusion
    with pytest.raises(ValueError, match="apply_rope_fusion"):
        AnchorSmolLM2Config135M(num_layers=2, position_embedding_type="yarn", apply_rope_fusion=True)


def test_what_the_user_sets_wins(gpu_node, monkeypatch):
    assert AnchorMixedPrecision(precision="32").dtype_config.fp32
    assert not AnchorMegatronStrategy(ckpt_async_save=False).async_save
    assert not AnchorMegatronStrategy(ckpt_parallel_load=False).parallel_load
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=False, overlap_param_gather=None,
                                        use_distributed_optimizer=False)
    launch.resolve_ddp_config(ddp)
    assert not ddp.overlap_grad_reduce and not ddp.overlap_param_gather  # no distributed optimizer: nothing to gather
    config = AnchorSmolLM2Config135M(num_layers=2, cross_entropy_loss_fusion=False, bias_activation_fusion=False)
    assert not (config.cross_entropy_loss_fusion or config.bias_activation_fusion) and config.persist_layer_norm
    # a recipe's explicit setting reaches the objects the training process builds
    recipe = recipes.anchor_smollm2_135m()
    recipe.trainer.plugins.precision = "32"
    recipe.trainer.strategy.ckpt_async_save = False
    import fiddle as fdl

    assert fdl.build(recipe.trainer.plugins).dtype_config.fp32
    assert not fdl.build(recipe.trainer.strategy).async_save
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert AnchorMixedPrecision(precision="bf16-mixed").dtype_config.bf16  # the CPU's bf16 when asked


NOTHING_PATCHED = r'''
import torch
import nemo.lightning  # what probes CUDA at import time sees this machine, as on a GPU node before the launch
from megatron.core.optimizer import get_megatron_optimizer
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 8

import importlib
from nemo.lightning import megatron_parallel
from nemo.lightning.io import pl
from nemo.lightning.pytorch.plugins import data_sampler
from nemo.lightning.pytorch.strategies import megatron_strategy
fix_tensors_device = pl._fix_tensors_device

from nemo_anchor.nemo import cpu, recipes  # installs what NeMo needs here
from nemo_anchor.parallel import cpu_shims

assert not cpu.install() and not cpu._installed and not cpu_shims._installed
modules = [megatron_parallel, megatron_strategy, data_sampler]
modules += [importlib.import_module(f"megatron.core.{name}") for name in cpu_shims._CUDA_ASSUMING_MODULES]
assert all(module.torch is torch for module in modules), [m.__name__ for m in modules if m.torch is not torch]
strategy = megatron_strategy.MegatronStrategy
for name in ("__init__", "optimizer_sharded_state_dict", "load_optimizer_state_dict"):
    assert not hasattr(getattr(strategy, name), "__wrapped__"), name
assert pl._fix_tensors_device is fix_tensors_device
# the one adapter that stays is a version matter: NeMo 2.7.3's call against this megatron-core's signature
import inspect
from nemo.lightning.pytorch.optim import megatron as nemo_optim
from nemo_anchor.nemo import compat
mismatch = "no_weight_decay_cond" not in inspect.signature(get_megatron_optimizer).parameters
assert compat.install() == mismatch == getattr(nemo_optim.setup_megatron_optimizer, "_anchor_adapted", False)
print("untouched")
'''


def test_no_cpu_shim_acts_in_a_process_that_sees_cuda():
    """nemo_anchor.nemo.cpu and the Megatron CPU shims leave NeMo and Megatron as they are where CUDA is seen."""
    done = subprocess.run([sys.executable, "-c", NOTHING_PATCHED], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0 and "untouched" in done.stdout, (done.stdout + done.stderr)[-3000:]
