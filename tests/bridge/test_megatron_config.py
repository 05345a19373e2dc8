"""One model-config converter (nemo_anchor.convert.megatron_config) reads a Bridge provider back into the
``model:`` section it was built from (.venv-bridge; the NeMo 2 side is tests/test_megatron_config.py).

Skipped where Megatron-Bridge is not installed (the NeMo 2 environment).
"""
import importlib.util

import pytest

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

from nemo_anchor.bridge import AnchorGPTModelProvider  # noqa: E402
from nemo_anchor.convert.megatron_config import model_config_from_megatron  # noqa: E402
from nemo_anchor.model.config import ModelConfig  # noqa: E402

SHAPE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)
# what the provider carries of a model: section (the parallel layout and the kernel choice are the run's)
FIELDS = ("architecture", "attention_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
          "num_query_groups", "kv_channels", "seq_length", "rope_scaling", "rope_scaling_factor",
          "original_max_position_embeddings", "rope_in_fp32", "norm_epsilon", "init_method_std", "tie_embeddings",
          "qkv_bias", "recompute", "recompute_num_layers", "pipeline_model_parallel_size")


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(architecture="qwen2", head_dim=32, rope_in_fp32=True, attention_type="intra_doc", tie_embeddings=True),
    dict(rope_scaling="yarn", rope_scaling_factor=4.0, original_max_position_embeddings=512, seq_length=2048),
    dict(rope_scaling="llama3", rope_scaling_factor=8.0, original_max_position_embeddings=8192, rotary_base="500000"),
    dict(recompute="full", recompute_num_layers=1, pipeline_model_parallel_size=2, norm_epsilon=1e-6,
         init_method_std=0.01, attention_type="full"),
], ids=["llama", "qwen2-head-dim", "yarn", "llama3", "recompute-pipeline"])
def test_a_provider_reads_back_into_the_model_section_it_was_built_from(overrides):
    cfg = ModelConfig(**{**SHAPE, **overrides})
    provider = AnchorGPTModelProvider.from_model_config(cfg, 259)
    back = model_config_from_megatron(provider, default_architecture=cfg.architecture)
    assert {k: getattr(back, k) for k in FIELDS} == {k: getattr(cfg, k) for k in FIELDS}
    assert back.resolved_rotary_base() == cfg.resolved_rotary_base() and back.vocab_size == 259


def test_ntk_reads_back_as_the_base_it_folds_into():
    cfg = ModelConfig(**SHAPE, rope_scaling="ntk", rope_scaling_factor=4.0, original_max_position_embeddings=256)
    back = model_config_from_megatron(AnchorGPTModelProvider.from_model_config(cfg, 259), default_architecture="llama")
    assert back.rope_scaling == "none" and back.resolved_rotary_base() == pytest.approx(cfg.resolved_rotary_base())


def test_a_provider_of_another_shape_is_refused_naming_the_field():
    provider = AnchorGPTModelProvider.from_model_config(ModelConfig(**SHAPE), 259)
    provider.normalization = "LayerNorm"
    with pytest.raises(ValueError, match=r"provider: config.normalization='LayerNorm' is not supported \(expected 'RMSNorm'\)"):
        model_config_from_megatron(provider, source="provider", default_architecture="llama")
