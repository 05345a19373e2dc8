"""Megatron-LM's GPU defaults in the configs our trainer builds: on with CUDA and Transformer Engine, off on the CPU.

There is no GPU here: Transformer Engine, apex's extension and TE's fused RoPE entry points are
stand-ins, and CUDA is pretended only while the configs are built; the configs themselves are
Megatron's own ``TransformerConfig`` and ``DistributedDataParallelConfig``.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from nemo_anchor import gpu
from nemo_anchor.training.config import load_config
from nemo_anchor.training.engine import megatron_configs

CUDA = torch.device("cuda")


def _run_config(*overrides):
    return load_config(None, ["output_dir=x", "data.path=y", *overrides])


@pytest.fixture
def gpu_stack(monkeypatch):
    """Transformer Engine, apex's extension and TE's fused RoPE importable (stand-ins); CUDA on request."""
    monkeypatch.setattr(gpu, "transformer_engine_pytorch", lambda: (object(), None))
    monkeypatch.setattr(gpu, "apex_gradient_accumulation", lambda: (object(), None))
    # TransformerConfig checks that Megatron found TE's fused RoPE kernels when apply_rope_fusion is set
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)

    @contextlib.contextmanager
    def cuda():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            yield

    return cuda


def test_gpu_run_gets_megatron_lms_fusions_and_overlaps(gpu_stack):
    with gpu_stack():
        model, ddp = megatron_configs(_run_config(), CUDA)
    assert isinstance(model, TransformerConfig) and isinstance(ddp, DistributedDataParallelConfig)
    assert model.gradient_accumulation_fusion and model.apply_rope_fusion
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and ddp.use_distributed_optimizer
    assert ddp.grad_reduce_in_fp32 and not ddp.average_in_collective  # a sum, divided by the loss tokens


def test_exactness_options_keep_the_unfused_paths(gpu_stack):
    with gpu_stack():
        fp32_rope, _ = megatron_configs(_run_config("model.rope_in_fp32=true"), CUDA)
        yarn, _ = megatron_configs(_run_config("model.rope_scaling=yarn", "model.rope_scaling_factor=4"), CUDA)
        _, replicated = megatron_configs(_run_config("trainer.distributed_optimizer=false"), CUDA)
    assert not fp32_rope.apply_rope_fusion and fp32_rope.gradient_accumulation_fusion
    assert not yarn.apply_rope_fusion  # Megatron's fused THD RoPE drops YaRN's mscale
    assert replicated.overlap_grad_reduce and not replicated.overlap_param_gather


def test_without_apex_or_cuda_nothing_is_fused(gpu_stack, monkeypatch):
    model, ddp = megatron_configs(_run_config(), torch.device("cpu"))  # TE importable, no CUDA
    assert not (model.gradient_accumulation_fusion or model.apply_rope_fusion)
    assert not (ddp.overlap_grad_reduce or ddp.overlap_param_gather)
    monkeypatch.setattr(gpu, "apex_gradient_accumulation", lambda: (None, "`import fused_weight_gradient_mlp_cuda` failed"))
    with gpu_stack():
        model, _ = megatron_configs(_run_config(), CUDA)
    assert model.apply_rope_fusion and not model.gradient_accumulation_fusion  # Megatron's output layer needs apex


def test_this_machine_builds_the_cpu_configs():
    model, ddp = megatron_configs(_run_config(), torch.device("cpu"))
    assert not (model.gradient_accumulation_fusion or model.apply_rope_fusion)
    assert not (ddp.overlap_grad_reduce or ddp.overlap_param_gather)
