"""`nemo-anchor train` meeting data it cannot use: refused in one line naming what is wrong, before anything is
written (a corrupt token file: when its window is read; the fresh run's folder is then removed)."""
import json
import re
import shutil

import numpy as np
import pytest

from nemo_anchor.data import PackedDataset
from tiny_runs import pack_texts, train_tiny  # tests/tiny_runs.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("robust_train")
    pack_texts(root)
    pack_texts(root, tokenizer="train-bpe:300", name="bpe")
    return root


def train(tmp_path, data_path, *overrides):
    return train_tiny(tmp_path / "run", data_path, *overrides, max_steps=1)


def refusal(capsys) -> str:
    """The one line a refused run prints."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("nemo-anchor train: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_validation_data_of_another_tokenizer_is_refused(data, tmp_path, capsys):
    assert train(tmp_path, data / "byte", f"data.valid_path={data / 'bpe'}") == 2
    message = refusal(capsys)
    assert f"data.valid_path={data / 'bpe'}" in message and "'bpe-300'" in message and "'byte'" in message
    assert not (tmp_path / "run").exists()  # nothing written, config.yaml included


def test_token_ids_beyond_model_vocab_size_are_named(data, tmp_path, capsys):
    assert train(tmp_path, data / "byte", "model.vocab_size=100") == 2
    message = refusal(capsys)
    largest = int(np.fromfile(data / "byte" / "tokens.bin", dtype=np.uint16).max())
    assert f"packed dataset {data / 'byte'}: largest token id {largest}" in message
    assert "vocabulary of 100" in message and not (tmp_path / "run").exists()


def test_corrupt_token_file_is_named_when_read(data, tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(data / "byte", corrupt)
    seq_length = json.loads((corrupt / "metadata.json").read_text())["seq_length"]
    tokens = np.memmap(corrupt / "tokens.bin", dtype=np.uint16, mode="r+").reshape(-1, seq_length)
    tokens[:, 5] = 60000  # every window: whichever the first step reads
    tokens.flush()
    assert train(tmp_path, corrupt) == 2
    assert re.search(r"corrupt/tokens.bin: window \d+ holds token id 60000, outside the packing tokenizer's "
                     r"vocabulary of 259", refusal(capsys))
    assert not (tmp_path / "run").exists()  # found in the first step: the fresh run's folder is gone


def test_token_ids_are_not_scanned_when_the_model_vocabulary_covers_the_tokenizer(data):
    dataset = PackedDataset(data / "byte")
    dataset._tokens = None  # reading the tokens now fails: the check must not need them
    dataset.check_token_ids(259)
    with pytest.raises(TypeError):
        dataset.check_token_ids(258)


def test_run_directory_of_another_tokenizer_is_refused(data, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    shutil.copytree(data / "bpe" / "tokenizer", tmp_path / "run" / "tokenizer")  # as a run on other data left it
    assert train(tmp_path, data / "byte") == 2
    assert re.search(r"output_dir=.*run \(its tokenizer/\) uses tokenizer", refusal(capsys))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["tokenizer"]
