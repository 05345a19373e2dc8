"""`nemo-anchor import-hf` as a user runs it: the source is never lost, bad sources are named in one line."""
import json
import os

import pytest

from nemo_anchor.cli import main
from tiny_runs import pack_texts, train_tiny  # tests/tiny_runs.py


@pytest.fixture(scope="module")
def hf(tmp_path_factory, tiny_byte_llama):
    path = tmp_path_factory.mktemp("robust_import") / "hf"
    tiny_byte_llama(path, max_positions=32)
    return path


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_output_that_is_the_source_is_refused(hf, capsys):
    before = snapshot(hf)
    assert main(["import-hf", str(hf), str(hf), "--overwrite"]) == 2
    assert f"output {hf} is the input {hf}" in capsys.readouterr().err
    assert main(["import-hf", str(hf), str(hf.parent), "--overwrite"]) == 2
    assert "contains the input" in capsys.readouterr().err
    assert snapshot(hf) == before


def test_import_writes_user_permissions_and_overwrite_keeps_training_output(hf, tmp_path, capsys):
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        assert main(["import-hf", str(hf), str(out)]) == 0
    finally:
        os.umask(old)
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_dir()} | {out.stat().st_mode & 0o777} == {0o755}
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {0o644}
    assert main(["import-hf", str(hf), str(out), "--overwrite"]) == 0  # its own output, untouched since
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # as training into it would
    assert main(["import-hf", str(hf), str(out), "--overwrite"]) == 2
    assert f"{out / 'metrics.jsonl'}" in capsys.readouterr().err
    assert (out / "metrics.jsonl").is_file() and (out / "checkpoints" / "iter_0000000").is_dir()


def test_folder_without_config_json_is_not_a_hugging_face_model(tmp_path, capsys):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(["import-hf", str(tmp_path / "weights"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'weights'} is not a Hugging Face model directory" in err and "config.json" in err
    assert "iter_NNNNNNN" not in err and not (tmp_path / "out").exists()


def test_truncated_weights_file_is_named(hf, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in hf.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["import-hf", str(broken), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nemo-anchor import-hf: error: {weights}:") and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


@pytest.mark.parametrize("config, field", [
    ({"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 259, "activation_function": "x",
      "rope_scaling": {"type": "dynamic", "factor": 2.0}, "custom_thing": [1, 2]}, "model_type"),
    ({"model_type": "no-such-family", "hidden_size": 16, "extra": {"nested": True}}, "no-such-family"),
])
def test_unsupported_configs_are_one_line_naming_config_json(tmp_path, capsys, config, field):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"nemo-anchor import-hf: error: {source / 'config.json'}")
    assert field in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_training_into_an_import_with_the_other_tie_setting_names_model_tie_embeddings(tmp_path, tiny_byte_llama,
                                                                                        tied, capsys):
    """An untied import trained tied would drop lm_head; a tied one trained untied has no output layer to load."""
    assert main(["import-hf", str(tiny_byte_llama(tmp_path / "hf", tie_word_embeddings=tied)), str(tmp_path / "run")]) \
        == 0
    capsys.readouterr()
    before = snapshot(tmp_path / "run")
    assert train_tiny(tmp_path / "run", pack_texts(tmp_path), f"model.tie_embeddings={not tied}") == 2
    err = capsys.readouterr().err
    fault = "is not used by" if not tied else "which the model being trained"
    assert f"{fault}" in err and f"(model.tie_embeddings={not tied})" in err and "output_layer.weight" in err, err
    assert len(err.strip().splitlines()) == 1 and snapshot(tmp_path / "run") == before
