"""Every device choice of a Bridge run is left unset by the recipe and decided by the training process, from the
one list and rule of ``nemo_anchor.launch`` that the other front doors use (.venv-bridge).

CUDA, Transformer Engine and apex's weight-gradient extension are stand-ins here (patched after the imports,
as on a GPU node); Megatron-Core's Adam is torch's, as wherever Apex's and TE's are missing.
"""
import contextlib
import importlib.util
import io

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

import nemo_anchor.bridge  # noqa: E402,F401
from megatron.bridge.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils  # noqa: E402
from megatron.core.optimizer import distrib_optimizer  # noqa: E402

from nemo_anchor import gpu, launch  # noqa: E402
from nemo_anchor.bridge.provider import AnchorGPTModelProvider  # noqa: E402
from nemo_anchor.bridge.recipes import anchor_smollm2_135m  # noqa: E402


@pytest.fixture
def gpu_node(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (object(), None))
    monkeypatch.setattr(gpu, "apex_gradient_accumulation", lambda: (object(), None))
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)
    return monkeypatch


def _launched():
    config = anchor_smollm2_135m()
    config.checkpoint.save = "/ckpt"
    launch.resolve_bridge_config(config)
    config.model.finalize()
    return config


def test_every_fusion_is_unset_in_the_recipe_and_on_in_a_gpu_process(gpu_node):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        anchor_smollm2_135m().print_yaml()
    for name in launch.FUSIONS:  # a knob added to the one list is covered here
        assert f"{name}: null" in out.getvalue(), name
    model = _launched().model
    assert all(getattr(model, name) is True for name in launch.FUSIONS) and not model.use_cpu_initialization


def test_weight_gradient_accumulation_is_fused_only_with_apexs_extension(gpu_node):
    gpu_node.setattr(gpu, "apex_gradient_accumulation", lambda: (None, "`import fused_weight_gradient_mlp_cuda` failed"))
    model = _launched().model
    assert not model.gradient_accumulation_fusion and model.apply_rope_fusion and model.persist_layer_norm


def test_the_cpu_process_fuses_nothing():
    model = _launched().model
    assert not any(getattr(model, name) for name in launch.FUSIONS) and model.use_cpu_initialization


def test_a_provider_made_on_a_gpu_node_brings_none_of_its_device_choices():
    made_there = GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                                  gradient_accumulation_fusion=True, bias_activation_fusion=True,
                                  cross_entropy_loss_fusion=True, masked_softmax_fusion=True)
    ours = AnchorGPTModelProvider.from_provider(made_there)
    assert all(getattr(ours, name) is None for name in launch.FUSIONS)
    assert not ours.masked_softmax_fusion  # AnchorCoreAttention computes its own softmax


def test_the_distributed_optimizer_stays_on_with_cuda_over_torchs_adam(gpu_node):
    assert not distrib_optimizer.HAVE_APEX_OR_TE  # as on a GPU without Apex or TE: torch's Adam
    config = _launched()
    assert config.optimizer.use_distributed_optimizer and config.ddp.use_distributed_optimizer
    assert config.ddp.overlap_param_gather
