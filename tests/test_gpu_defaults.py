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
    # Megatron-LM's Llama recipes: fused cross-entropy, bias-SwiGLU and persistent layer norm
    assert model.cross_entropy_loss_fusion and model.bias_activation_fusion and model.persist_layer_norm
    assert ddp.overlap_grad_reduce and ddp.overlap_param_gather and ddp.use_distributed_optimizer
    assert ddp.grad_reduce_in_fp32 and not ddp.average_in_collective  # a sum, divided by the loss tokens


def test_exactness_options_keep_the_unfused_paths(gpu_stack):
    with gpu_stack():
        fp32_rope, _ = megatron_configs(_run_config("model.rope_in_fp32=true"), CUDA)
        yarn, _ = megatron_configs(_run_config("model.rope_scaling=yarn", "model.rope_scaling_factor=4"), CUDA)
        _, replicated = megatron_configs(_run_config("trainer.distributed_optimizer=false"), CUDA)
    assert not fp32_rope.apply_rope_fusion and fp32_rope.gradient_accumulation_fusion
    assert not yarn.apply_rope_fusion  # Megatron's fused THD RoPE drops YaRN's mscale
    assert fp32_rope.cross_entropy_loss_fusion and yarn.cross_entropy_loss_fusion and yarn.bias_activation_fusion
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
    assert not (model.cross_entropy_loss_fusion or model.bias_activation_fusion or model.persist_layer_norm)
    assert not (ddp.overlap_grad_reduce or ddp.overlap_param_gather)


_OVERLAPPED_PRETRAIN = '''
import sys


def train(argv):
    from nemo_anchor.training.cli import main

    status = main(argv)
    if status:
        raise SystemExit(f"rank exited {status}")


# the GPU's DDP config (overlapped grad reduce and param gather) on two gloo ranks, forked once the trainer is
# imported (tests/forked_ranks.py); dist_checkpointing's spawn-context Manager re-imports this module, so the
# trainer is imported only here
if __name__ == "__main__":
    import torch

    from forked_ranks import run_ranks
    from nemo_anchor.training import engine

    gpu_configs = engine.megatron_configs
    engine.megatron_configs = lambda config, device: gpu_configs(config, torch.device("cuda"))
    run_ranks(2, train, sys.argv[1:])
'''


def test_overlapped_param_gather_trains_and_saves_what_the_straight_run_does(tmp_path):
    """Megatron's DDP with overlap_grad_reduce and overlap_param_gather, on 2 gloo processes: the
    losses are those of one process, and the checkpoint holds the updated weights (the optimizer
    step leaves each rank only its own shard updated until the next forward gathers the rest)."""
    import json
    import os
    import subprocess
    import sys

    import yaml
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from nemo_anchor.cli import main as cli

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * (i % 5 + 1)}) + "\n"
                              for i in range(24)))
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "64",
                "--output", str(tmp_path / "packed")]) == 0
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 64, "attention_backend": "cpu"},
        "data": {"path": str(tmp_path / "packed")},
        "trainer": {"max_steps": 2, "global_batch_size": 4, "precision": "fp32", "progress_bar": False},
        "optim": {"lr": 3e-3}}))
    script = tmp_path / "overlapped_pretrain.py"
    script.write_text(_OVERLAPPED_PRETRAIN)
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**{k: v for k, v in os.environ.items() if k not in launch}, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])}  # the script imports forked_ranks
    runs = {}
    for name in ("one process", "overlapped"):
        out = tmp_path / name.replace(" ", "_")
        arguments = ["--config", str(config), f"output_dir={out}"]
        if name == "one process":
            assert cli(["train", *arguments]) == 0
        else:
            proc = subprocess.run([sys.executable, str(script), *arguments], capture_output=True, text=True,
                                  timeout=600, env=env)
            assert proc.returncode == 0, proc.stderr[-3000:]
        losses = [json.loads(line).get("loss") for line in (out / "metrics.jsonl").read_text().splitlines()]
        dcp_to_torch_save(out / "checkpoints" / "iter_0000002", tmp_path / f"{out.name}.pt")
        state = torch.load(tmp_path / f"{out.name}.pt", weights_only=False)
        runs[name] = [loss for loss in losses if loss is not None], {k: v for k, v in state.items() if k.startswith("model.")}
    (single_losses, single_model), (losses, model) = runs["one process"], runs["overlapped"]
    assert losses == pytest.approx(single_losses, abs=1e-6)
    assert len(losses) == 2 and model.keys() == single_model.keys() and model
    for name, weight in model.items():
        torch.testing.assert_close(weight, single_model[name], atol=1e-6, rtol=1e-5, msg=name)
