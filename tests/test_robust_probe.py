"""`nemo-anchor probe` as a user runs it: lengths checked first, the --overwrite rule, data of another tokenizer."""
import json

import pytest

from nemo_anchor.cli import main
from nemo_anchor.data import PackOptions, pack

TEXT = "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow.\n" * 30


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_byte_llama):
    root = tmp_path_factory.mktemp("robust_probe")
    hf = root / "hf"
    tiny_byte_llama(hf, max_positions=64)
    text = root / "text.txt"
    text.write_text(TEXT)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()))
    pack([corpus], "train-bpe:300", root / "packed_bpe", PackOptions(seq_length=64))
    return {"hf": hf, "text": text, "bpe": root / "packed_bpe"}


def run_probe(inputs, output, *extra, data=None):
    return main(["probe", "--hf", str(inputs["hf"]), "--output", str(output), "--data", str(data or inputs["text"]),
                 "--num-sequences", "1", "--sequence-length", "16", "--shifts", "0", "4", "--reference-shift", "2",
                 "--variants", "fp32", *map(str, extra)])


@pytest.mark.parametrize("lengths, message", [
    (["-5", "0", "1"], "must be >= 2, got lengths [-5, 0, 1]"),
    (["99999"], "no D_logit length is at most 64"),
])
def test_bad_lengths_fail_before_anything_is_written(inputs, tmp_path, capsys, lengths, message):
    assert run_probe(inputs, tmp_path / "probe", "--lengths", *lengths) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_probe_results_follow_the_overwrite_rule(inputs, tmp_path, capsys):
    out = tmp_path / "probe"
    assert run_probe(inputs, out, "--lengths", "16", "32", "128") == 0
    assert "D_logit lengths [128] left out" in capsys.readouterr().out  # said, not silent
    assert sorted(p.name for p in out.iterdir()) == [".nemo-anchor-output.json", "figure1.png", "probe.json",
                                                     "probe_settings.json"]
    first = (out / "probe.json").read_bytes()
    assert run_probe(inputs, out, "--lengths", "16") == 2
    assert "already exists" in capsys.readouterr().err and (out / "probe.json").read_bytes() == first
    assert run_probe(inputs, out, "--lengths", "16", "--overwrite") == 0
    assert list(json.loads((out / "probe.json").read_text())["fp32"]["D_logit"]) == ["16"]
    (out / "paper_draft.tex").write_text("draft")
    assert run_probe(inputs, out, "--lengths", "16", "--overwrite") == 2
    assert str(out / "paper_draft.tex") in capsys.readouterr().err and (out / "paper_draft.tex").exists()


def test_output_inside_the_data_folder_is_refused(inputs, capsys):
    assert run_probe(inputs, inputs["bpe"] / "probe", data=inputs["bpe"]) == 2
    assert f"lies inside the input {inputs['bpe']}" in capsys.readouterr().err
    assert not (inputs["bpe"] / "probe").exists()


def test_data_of_another_tokenizer_is_refused(inputs, tmp_path, capsys):
    assert run_probe(inputs, tmp_path / "probe", "--lengths", "16", data=inputs["bpe"]) == 2
    err = capsys.readouterr().err
    assert "'bpe-300'" in err and str(inputs["hf"]) in err and not (tmp_path / "probe").exists()


def test_hf_folder_without_config_json(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "--hf", str(tmp_path), "--output", str(tmp_path / "p"), "--data", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{tmp_path} is not a Hugging Face model directory" in capsys.readouterr().err
