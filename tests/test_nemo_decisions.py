"""NeMo's configs take every device choice from the one list and rule of ``nemo_anchor.launch`` (as Bridge's
provider and our trainer do), ``gradient_accumulation_fusion`` included; CUDA, TE and apex are stand-ins."""
import pytest
import torch

pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")

from megatron.core.models.common.embeddings import rope_utils  # noqa: E402

from nemo_anchor import gpu, launch  # noqa: E402
from nemo_anchor.nemo.config import AnchorSmolLM2Config135M  # noqa: E402


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


def test_a_gpu_process_fuses_what_megatron_lms_recipes_fuse(gpu_node):
    config = AnchorSmolLM2Config135M(num_layers=2)
    assert all(getattr(config, name) is True for name in launch.FUSIONS) and not config.use_cpu_initialization
    gpu_node.setattr(gpu, "apex_gradient_accumulation", lambda: (None, "`import fused_weight_gradient_mlp_cuda` failed"))
    assert not AnchorSmolLM2Config135M(num_layers=2).gradient_accumulation_fusion


def test_the_cpu_process_fuses_nothing_whatever_was_asked():
    config = AnchorSmolLM2Config135M(num_layers=2, gradient_accumulation_fusion=True, bias_activation_fusion=True)
    assert not any(getattr(config, name) for name in launch.FUSIONS) and config.use_cpu_initialization
