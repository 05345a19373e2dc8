"""Like for like, and said: each process logs once which attention kernel runs and why, and warns where
``auto`` would run anchor and full on different kernel families (Hopper without FlashAttention-3:
FlashAttention-2 for anchor, cuDNN for full). CUDA is stood in by a tensor that says it is on CUDA, a
patched compute capability and device name, and the backends' availability checks."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_key, fa3, fa4, flash, functional, te, torch_varlen
from nemo_anchor.model import core_attention
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.gpt import build_gpt_model, packed_forward
from nemo_anchor.parallel.distributed import initialize_parallel

LOGGER = "nemo_anchor.attention.functional"


class _OnCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


def _cuda_query():
    return torch.Tensor._make_subclass(_OnCuda, torch.zeros(8, 4, 128, dtype=torch.bfloat16))


@pytest.fixture
def h100(monkeypatch):
    """A Hopper GPU where every backend can run unless a test takes it away."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    for backend in (fa3, fa4, flash, torch_varlen, te):
        monkeypatch.setattr(backend, "unavailable_reason", lambda q, needs_grad: None)

    def without(backend, reason):
        monkeypatch.setattr(backend, "unavailable_reason", lambda q, needs_grad: reason)
    return without


def _records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_hopper_without_flash_attention_3_says_so_and_warns(h100, caplog):
    h100(fa3, "`import flash_attn_interface` failed: ModuleNotFoundError")
    h100(fa4, "`import flash_attn.cute` failed: ModuleNotFoundError")
    q = _cuda_query()
    assert functional.backend_choice("auto", q, True, "anchor")[0] == "torch_varlen"
    assert functional.backend_choice("auto", q, True, "full")[0] == "te"
    assert functional.kernel_family("torch_varlen") == functional.kernel_family("flash") == "FlashAttention-2"
    assert functional.common_backend(q, True) == "torch_varlen"

    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        functional.log_backend_choice("auto", "anchor", q, True)
    [info] = _records(caplog, logging.INFO)
    assert info.startswith("nemo_anchor attention: anchor runs on torch_varlen (FlashAttention-2) on NVIDIA H100")
    assert "not fa3: `import flash_attn_interface` failed" in info and "not te: its public attention" in info
    [warning] = _records(caplog, logging.WARNING)
    assert "anchor on FlashAttention-2 and full on cuDNN fused attention" in warning
    assert "to torch_varlen in both runs" in warning


def test_hopper_with_flash_attention_3_runs_both_on_it_without_a_warning(h100, caplog):
    q = _cuda_query()
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        functional.log_backend_choice("auto", "full", q, True)
    [info] = _records(caplog, logging.INFO)
    assert "full runs on fa3 (FlashAttention-3)" in info and "auto's first that runs here" in info
    assert not _records(caplog, logging.WARNING)


def test_a_named_backend_is_said_and_not_warned_about(h100, caplog):
    h100(fa3, "not installed")
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        functional.log_backend_choice("flash", "full", _cuda_query(), True)
    assert _records(caplog, logging.INFO)[0].endswith("full runs on flash (FlashAttention-2) on NVIDIA H100 80GB "
                                                      "HBM3, bfloat16, head_dim 128: asked for by name")
    assert not _records(caplog, logging.WARNING)


@pytest.fixture(scope="module")
def model():
    initialize_parallel()
    torch.manual_seed(0)
    return build_gpt_model(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                       num_query_groups=2, seq_length=32), 97)


def _batch():
    return dict(tokens=torch.randint(0, 97, (1, 32)), labels=torch.randint(0, 97, (1, 32)),
                position_ids=torch.arange(32)[None], loss_mask=torch.ones(1, 32),
                cu_seqlens=torch.tensor([0, 10, 32], dtype=torch.int32), cu_windows=torch.tensor([0, 32], dtype=torch.int32))


def test_a_model_logs_its_kernel_once_per_process(model, monkeypatch, caplog):
    """Two layers, forward and backward, twice: one line, from the first layer's first forward."""
    monkeypatch.setattr(core_attention, "_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        for _ in range(2):
            packed_forward(model, _batch()).sum().backward()
    [info] = _records(caplog, logging.INFO)
    assert info.startswith("nemo_anchor attention: anchor runs on cpu (torch's CPU flash attention) on cpu, float32")


def test_only_rank_zero_logs(model, monkeypatch, caplog):
    monkeypatch.setattr(core_attention, "_LOGGED", set())
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        packed_forward(model, _batch())
    assert not _records(caplog, logging.INFO)


def test_the_log_line_names_the_anchor_merge_path_and_why(h100, caplog, monkeypatch):
    """Where the Triton merge cannot run, the first forward's line says the torch fallback runs, and why."""
    monkeypatch.setattr(gpu, "anchor_key_triton", lambda: (None, "`import triton` failed: ModuleNotFoundError"))
    monkeypatch.delenv("NEMO_ANCHOR_ANCHOR_PATH", raising=False)
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        functional.log_backend_choice("fa3", "anchor", _cuda_query(), True, deterministic=True)
    [info] = _records(caplog, logging.INFO)
    assert ("anchor runs on fa3 (FlashAttention-3) on NVIDIA H100 80GB HBM3, bfloat16, head_dim 128; anchor merge: "
            "torch fallback (`import triton` failed: ModuleNotFoundError); deterministic backward: asked for by name"
            ) in info
    compiled = types.SimpleNamespace(runs_on=lambda device: device.type == "cuda", INTERPRETED=False)
    monkeypatch.setattr(gpu, "anchor_key_triton", lambda: (compiled, None))
    assert anchor_key.merge_path(torch.device("cuda")) == (compiled, "triton")
    assert anchor_key.merge_path(torch.device("cpu"))[1] == ("torch fallback (cpu tensors; the Triton path needs a GPU "
                                                             "or TRITON_INTERPRET=1)")
    assert functional.anchor_handling("fa3", "full", torch.device("cuda")) is None  # no anchor to merge


def test_a_cuda_fallback_warns_once_with_its_cost(monkeypatch, caplog):
    monkeypatch.setattr(gpu, "anchor_key_triton", lambda: (None, "`import triton` failed: ModuleNotFoundError"))
    monkeypatch.setattr(anchor_key, "_WARNED", set())
    q = types.SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True, numel=lambda: 131072 * 32 * 128)
    with caplog.at_level(logging.INFO, logger="nemo_anchor"):
        assert anchor_key._kernels(q) is None and anchor_key._kernels(q) is None
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "torch fallback (`import triton` failed: ModuleNotFoundError) on CUDA" in warning
    assert "2.00 GiB each here" in warning and "[gpu] extra" in warning
