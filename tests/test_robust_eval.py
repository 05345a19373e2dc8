"""`nemo-anchor eval` as a user runs it: the --overwrite rule, data of another tokenizer, bad ids, bad --hf."""
import json
import os

import numpy as np
import pytest

from nemo_anchor.cli import main
from nemo_anchor.data import PackOptions, pack

TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n" * 40


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_byte_llama):
    """A tiny byte-tokenizer Llama, a text file, and packed datasets of the same and of another tokenizer."""
    root = tmp_path_factory.mktemp("robust_eval")
    hf = root / "hf"
    tiny_byte_llama(hf, max_positions=64)
    text = root / "text.txt"
    text.write_text(TEXT)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()))
    pack([corpus], "byte", root / "packed_byte", PackOptions(seq_length=32))
    pack([corpus], "train-bpe:300", root / "packed_bpe", PackOptions(seq_length=32))
    return {"hf": hf, "text": text, "byte": root / "packed_byte", "bpe": root / "packed_bpe"}


def run_eval(inputs, output, *extra, data=None):
    return main(["eval", "--hf", str(inputs["hf"]), "--output", str(output), "--tasks", "none", "--dtype", "fp32",
                 "--perplexity-data", str(data or inputs["text"]), "--perplexity-length", "16",
                 "--perplexity-windows", "2", "--perplexity-buckets", "2", *extra])


def test_tasks_none_and_the_overwrite_rule(inputs, tmp_path, capsys):
    out = tmp_path / "eval"
    old = os.umask(0o022)
    try:
        assert run_eval(inputs, out) == 0  # --tasks none, as its help offers: perplexity only
    finally:
        os.umask(old)
    report = json.loads((out / "eval.json").read_text())
    assert report["mean"]["ruler"] == {} and len(report["mean"]["perplexity"]["nll"]) == 2
    assert out.stat().st_mode & 0o777 == 0o755 and {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    first = (out / "eval.json").read_bytes()
    assert run_eval(inputs, out) == 2  # earlier results are not silently replaced
    assert "already exists" in capsys.readouterr().err and (out / "eval.json").read_bytes() == first
    assert run_eval(inputs, out, "--overwrite") == 0
    (out / "notes.md").write_text("my notes")
    assert run_eval(inputs, out, "--overwrite") == 2
    assert str(out / "notes.md") in capsys.readouterr().err and (out / "notes.md").read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]


def test_output_over_the_model_is_refused(inputs, capsys):
    before = sorted(p.name for p in inputs["hf"].iterdir())
    assert run_eval(inputs, inputs["hf"], "--overwrite") == 2
    assert f"is the input {inputs['hf']}" in capsys.readouterr().err
    assert sorted(p.name for p in inputs["hf"].iterdir()) == before


def test_perplexity_data_of_another_tokenizer_is_refused(inputs, tmp_path, capsys):
    assert run_eval(inputs, tmp_path / "eval", data=inputs["bpe"]) == 2
    err = capsys.readouterr().err
    assert f"packed dataset {inputs['bpe']}" in err and "'bpe-300'" in err and str(inputs["hf"]) in err
    assert not (tmp_path / "eval").exists()
    assert run_eval(inputs, tmp_path / "eval", data=inputs["byte"]) == 0  # the model's own tokenizer: accepted


def test_token_ids_outside_the_vocabulary_are_named(inputs, tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for item in inputs["byte"].rglob("*"):
        target = corrupt / item.relative_to(inputs["byte"])
        target.mkdir(exist_ok=True) if item.is_dir() else target.write_bytes(item.read_bytes())
    tokens = np.memmap(corrupt / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[5] = 4000
    tokens.flush()
    assert run_eval(inputs, tmp_path / "eval", data=corrupt) == 2
    err = capsys.readouterr().err
    assert str(corrupt) in err and "4000" in err and "259" in err and "Traceback" not in err


def test_hf_folder_without_config_json(inputs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--hf", str(tmp_path), "--output", str(tmp_path / "eval"), "--perplexity-data",
              str(inputs["text"])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a Hugging Face model directory" in err and "config.json" in err
    assert "iter_NNNNNNN" not in err


def test_nothing_to_evaluate_is_one_line(inputs, tmp_path, capsys):
    assert main(["eval", "--hf", str(inputs["hf"]), "--output", str(tmp_path / "eval"), "--tasks", "none"]) == 2
    assert capsys.readouterr().err.strip() == "nemo-anchor eval: error: nothing to evaluate: no tasks and no " \
                                              "perplexity data"
