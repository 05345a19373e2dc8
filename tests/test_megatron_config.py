"""One model-config converter (nemo_anchor.convert.megatron_config): a NeMo 2 config, as NeMo's HF importer
builds it, reads back into what our own HF reading gives (the Bridge side: tests/bridge/test_megatron_config.py)."""
import pytest

pytest.importorskip("nemo.collections.llm")
transformers = pytest.importorskip("transformers")

from nemo_anchor.convert.hf_mapping import model_config_from_hf  # noqa: E402
from nemo_anchor.convert.megatron_config import model_config_from_megatron  # noqa: E402

SHAPE = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, torch_dtype="float32")
FIELDS = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
          "kv_channels", "vocab_size", "seq_length", "rope_scaling", "rope_scaling_factor",
          "original_max_position_embeddings", "norm_epsilon", "tie_embeddings", "qkv_bias")


@pytest.mark.parametrize("family, hf_class, extra", [
    ("Llama", transformers.LlamaConfig, dict(tie_word_embeddings=True, rms_norm_eps=1e-6)),
    ("Llama", transformers.LlamaConfig, dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192})),
    ("Llama", transformers.LlamaConfig, dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 512})),
    ("Mistral", transformers.MistralConfig, dict(head_dim=32)),
    ("Qwen2", transformers.Qwen2Config, dict()),
], ids=["llama-tied", "llama3.1-scaling", "yarn", "mistral-head-dim", "qwen2"])
def test_a_nemo_config_reads_back_into_what_the_hf_config_says(tmp_path, family, hf_class, extra):
    from nemo_anchor.nemo import models

    hf_class(**SHAPE, **extra).save_pretrained(tmp_path)
    importer = getattr(models, f"AnchorHF{family}Importer")(str(tmp_path))
    nemo_config = importer.config  # NeMo's config class, filled from config.json
    ours = model_config_from_hf(transformers.AutoConfig.from_pretrained(tmp_path))
    back = model_config_from_megatron(nemo_config, source="nemo")
    assert {k: getattr(back, k) for k in FIELDS} == {k: getattr(ours, k) for k in FIELDS}
    assert back.resolved_rotary_base() == pytest.approx(ours.resolved_rotary_base())


def test_a_nemo2_checkpoint_config_without_its_family_is_refused_naming_the_class():
    with pytest.raises(ValueError, match="model.yaml: unknown architecture 'nemo.collections.llm.GPTConfig'"):
        model_config_from_megatron({"_target_": "nemo.collections.llm.GPTConfig"}, source="model.yaml")
