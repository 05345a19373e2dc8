"""Nothing lost across commands, nothing imported that the weights do not hold.

- ``--overwrite`` replaces only an output of the same subcommand (an HF export never replaces a
  packed dataset, nor the reverse); ``train`` never writes into one of its inputs or into another
  command's output;
- every import (``import-hf``, ``model.init_from_hf``, ``eval``/``probe`` of an HF directory) takes
  exactly the tensors its config describes: a config that disagrees with its weights is refused,
  naming the tensor, both shapes and the config key, where transformers would initialise or drop
  weights without a word.
"""
import json
import re
import shutil

import pytest
import torch
import yaml

from nemo_anchor.cli import main
from nemo_anchor.evaluation.models import load_model


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_byte_llama):
    """A packed dataset, an HF model (2 layers) and its import-hf run directory and export-hf export."""
    root = tmp_path_factory.mktemp("robust_outputs")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * (5 + i)}) + "\n" for i in range(20)))
    assert main(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "32",
                 "--output", str(root / "packed")]) == 0
    tiny_byte_llama(root / "hf", max_positions=32)
    two_layers(root / "hf")
    assert main(["import-hf", str(root / "hf"), str(root / "run")]) == 0
    assert main(["export-hf", str(root / "run"), str(root / "export")]) == 0
    return root


def two_layers(path):
    """Rewrite the 1-layer tiny model at ``path`` as a 2-layer one (the weights of a real 2-layer model)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    config.num_hidden_layers = 2
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_overwrite_does_not_replace_a_packed_dataset(outputs, capsys):
    before = snapshot(outputs / "packed")
    assert main(["export-hf", str(outputs / "run"), str(outputs / "packed"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"--overwrite refused: {outputs / 'packed'} was written by `nemo-anchor pack`" in err
    assert snapshot(outputs / "packed") == before


def test_pack_overwrite_does_not_replace_an_hf_export(outputs, capsys):
    before = snapshot(outputs / "export")
    assert main(["pack", "--input", str(outputs / "corpus.jsonl"), "--tokenizer", "byte", "--seq-length", "32",
                 "--output", str(outputs / "export"), "--overwrite"]) == 2
    assert "was written by `nemo-anchor export-hf`" in capsys.readouterr().err
    assert snapshot(outputs / "export") == before
    assert main(["import-hf", str(outputs / "hf"), str(outputs / "export"), "--overwrite"]) == 2
    assert "was written by `nemo-anchor export-hf`" in capsys.readouterr().err
    assert snapshot(outputs / "export") == before


@pytest.mark.parametrize("where, message", [
    ("packed", "is the input"),
    ("packed/run", "lies inside the input"),
    (".", "contains the input"),
    ("export", "holds the output of `nemo-anchor export-hf`"),
])
def test_train_never_writes_into_an_input_or_another_commands_output(outputs, tmp_path, capsys, where, message):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(outputs / where), "data": {"path": str(outputs / "packed")},
        "model": {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": 32}}))
    before = snapshot(outputs)
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("nemo-anchor train: error:") == 1
    assert snapshot(outputs) == before


def miswritten(outputs, tmp_path, key, value):
    """A copy of the 2-layer HF model whose config.json says ``key=value``."""
    bad = tmp_path / f"hf_{key}"
    shutil.copytree(outputs / "hf", bad)
    config = json.loads((bad / "config.json").read_text())
    config[key] = value
    (bad / "config.json").write_text(json.dumps(config))
    return bad


MISMATCHES = [  # config.json says key=value for the weights of a 2-layer, hidden 16, vocab 259 model
    ("num_hidden_layers", 3, r"lack tensor model\.layers\.2\.\S+ of shape \([\d, ]+\), which .*"
                             r"\(num_hidden_layers=3\)"),
    ("num_hidden_layers", 1, r"tensor model\.layers\.1\.\S+ of shape .* is not used by .*\(num_hidden_layers=1\)"),
    ("hidden_size", 32, r"tensor model\.embed_tokens\.weight has shape \(259, 16\) in the weights, but .*"
                        r"\(hidden_size=32\) makes it \(259, 32\)"),
    ("vocab_size", 300, r"tensor model\.embed_tokens\.weight has shape \(259, 16\) in the weights, but .*"
                        r"\(vocab_size=300\) makes it \(300, 16\)"),
    ("tie_word_embeddings", True, r"tensor lm_head\.weight of shape \(259, 16\) .* not used by .*"
                                  r"\(tie_word_embeddings=True\)"),
]


@pytest.mark.parametrize("key, value, message", MISMATCHES)
def test_import_hf_refuses_a_config_that_disagrees_with_its_weights(outputs, tmp_path, capsys, key, value, message):
    bad = miswritten(outputs, tmp_path, key, value)
    assert main(["import-hf", str(bad), str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("key, value, message", MISMATCHES[:3])
def test_eval_of_an_hf_directory_refuses_what_transformers_would_initialise_or_drop(outputs, tmp_path, key, value,
                                                                                     message):
    with pytest.raises(ValueError, match=message):
        load_model(miswritten(outputs, tmp_path, key, value), dtype=torch.float32)


def test_init_from_hf_refuses_a_config_that_disagrees_with_its_weights(outputs, tmp_path, capsys):
    bad = miswritten(outputs, tmp_path, "num_hidden_layers", 3)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "data": {"path": str(outputs / "packed")},
        "model": {"num_layers": 3, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": 32, "init_from_hf": str(bad)},
        "trainer": {"max_steps": 1, "global_batch_size": 1, "precision": "fp32", "progress_bar": False}}))
    assert main(["train", "--config", str(config)]) == 2
    assert "lack tensor model.layers.2." in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # the fresh run's folder is removed with the failure
