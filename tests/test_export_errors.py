"""Bad input to export/import: clear errors that name the problem, and nothing half-written left behind."""
import json

import pytest
import torch
import transformers

from nemo_anchor.cli import main
from nemo_anchor.convert.megatron_state import build_model
from nemo_anchor.data import byte_tokenizer
from nemo_anchor.export.hf import export_hf, import_hf
from nemo_anchor.export.inference import load_checkpoint
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.training.init_from_hf import init_model_from_hf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    config = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer().save(path)
    return path


@pytest.fixture(scope="module")
def ours_dir(hf_dir, tmp_path_factory):
    return import_hf(hf_dir, tmp_path_factory.mktemp("ours") / "run")


def no_staging_left(parent):
    return not [p.name for p in parent.iterdir() if p.name.endswith(("nemo-anchor-staging", "nemo-anchor-retired"))]


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint under"):
        export_hf(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_staging_left(tmp_path)


def test_cli_reports_errors_on_one_line(tmp_path, capsys):
    assert main(["export-hf", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-anchor export-hf: error: ") and "nowhere" in err and "Traceback" not in err
    assert main(["import-hf", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2


def test_corrupt_checkpoint(ours_dir, tmp_path):
    import shutil

    broken = tmp_path / "run"
    shutil.copytree(ours_dir, broken)
    shard = next((broken / "checkpoints" / "iter_0000000").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{shard} has 100 bytes, checksums.json recorded"):
        export_hf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_staging_left(tmp_path)
    from nemo_anchor.checksums import verification

    with verification(False), pytest.raises(ValueError, match="corrupt or unreadable"):  # --no-verify: the reader's
        export_hf(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_staging_left(tmp_path)


def test_unknown_architecture(tmp_path):
    gpt2 = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        import_hf(tmp_path / "gpt2", tmp_path / "out")
    assert not (tmp_path / "out").exists() and no_staging_left(tmp_path)


def test_unsupported_hf_features_are_named(tmp_path):
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                        sliding_window=16)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path / "swa")
    with pytest.raises(ValueError, match="sliding_window=16"):
        load_checkpoint(tmp_path / "swa")


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope_scaling,named", [
    ({**LLAMA3, "low_freq_factor": 2.0}, "rope_scaling.low_freq_factor=2.0"),
    ({**LLAMA3, "original_max_position_embeddings": 4096}, "rope_scaling.original_max_position_embeddings=4096"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0}, "rope_scaling.beta_fast=16.0"),
], ids=["llama3-low-freq", "llama3-original-length", "dynamic", "yarn-beta"])
def test_rope_scaling_megatron_cannot_do_is_named(rope_scaling, named):
    from nemo_anchor.convert.hf_mapping import model_config_from_hf

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match=f"config.json: {named} is not supported"):
        model_config_from_hf(config)


def test_nemo_llama31_config_is_refused_not_misread(tmp_path):
    (tmp_path / "nemo" / "weights").mkdir(parents=True)
    (tmp_path / "nemo" / "context").mkdir()
    (tmp_path / "nemo" / "context" / "model.yaml").write_text(
        "config:\n  _target_: nemo.collections.llm.gpt.model.llama.Llama31Config8B\n")
    with pytest.raises(ValueError, match="Llama31Config8B'? is not supported: its Llama 3.1/3.2 RoPE scaling"):
        load_checkpoint(tmp_path / "nemo")


def test_llama3_scaling_needs_its_original_length():
    with pytest.raises(ValueError, match="model.original_max_position_embeddings=4096: must be 8192"):
        ModelConfig(rope_scaling="llama3", rope_scaling_factor=8.0, original_max_position_embeddings=4096)


def test_weights_that_do_not_match_the_config(ours_dir, tmp_path):
    import shutil

    edited = tmp_path / "run"
    shutil.copytree(ours_dir, edited)
    ckpt_config = edited / "checkpoints" / "iter_0000000" / "config.yaml"
    ckpt_config.write_text(ckpt_config.read_text().replace("ffn_hidden_size: 48", "ffn_hidden_size: 64"))
    with pytest.raises(ValueError, match=f"{ckpt_config} is corrupt"):  # the edit is caught by its checksum first
        export_hf(edited, tmp_path / "out")
    from nemo_anchor.checksums import verification

    with verification(False), pytest.raises(ValueError, match=r"linear_fc1.weight has shape \(96, 32\) in the "
                                            r"weights, but the model config \(2 x ffn_hidden_size=2 x 64\) makes "
                                            r"it \(128, 32\)"):
        export_hf(edited, tmp_path / "out")


def test_init_from_hf_into_a_differently_shaped_model(hf_dir):
    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=2, num_query_groups=2)
    with pytest.raises(ValueError, match="num_query_groups=1 but the model being trained has num_query_groups=2"):
        init_model_from_hf(build_model(cfg, 259), hf_dir)


def test_existing_output_is_kept_unless_overwrite(ours_dir, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="already exists"):
        export_hf(ours_dir, out)
    with pytest.raises(ValueError, match="not written by nemo-anchor"):  # --overwrite replaces only its own outputs
        export_hf(ours_dir, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "user data"
    (out / "keep.txt").unlink()
    export_hf(ours_dir, out)  # an empty folder counts as absent
    export_hf(ours_dir, out, overwrite=True)
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert no_staging_left(tmp_path)


def test_inference_input_is_checked(ours_dir):
    model = load_checkpoint(ours_dir)
    with pytest.raises(ValueError, match=r"\[B, T\] int64"):
        model(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 259\)"):
        model(torch.full((1, 3), 259))
