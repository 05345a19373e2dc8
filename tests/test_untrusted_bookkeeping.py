"""Bookkeeping files read as untrusted input, as a user meets them.

- a checkpoint's ``checksums.json`` that is empty, not an object, or has a malformed entry verifies nothing:
  a reader refuses the checkpoint with one line naming the file and the field, never exports it as verified;
- the training data of a resume: when its files moved or changed size or modification time since the
  checkpoint, they are read again against the digests pack recorded (the time it took is said); a
  ``tokens.bin`` rewritten in its middle is refused naming it; unchanged files are not read again.
"""
import json
import shutil

import numpy as np
import pytest

from nemo_anchor.checksums import CHECKSUMS
from nemo_anchor.cli import main
from nemo_anchor.data.layout import TOKENS_FILE
from nemo_anchor.run_dir import RunDir
from tiny_runs import pack_texts, train_tiny  # tests/tiny_runs.py


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the packed data, a finished tiny run on it: checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("bookkeeping")
    data = pack_texts(root)
    assert train_tiny(root / "run", data) == 0
    return data, root / "run"


def _copy(trained, tmp_path):
    data, run = trained
    return shutil.copytree(data, tmp_path / "data"), shutil.copytree(run, tmp_path / "run")


def _flip_bytes(shard, count=9):
    with open(shard, "r+b") as handle:
        handle.seek(shard.stat().st_size // 2)
        chunk = handle.read(count)
        handle.seek(shard.stat().st_size // 2)
        handle.write(bytes(255 - b for b in chunk))


@pytest.mark.parametrize("manifest, line", [
    ({}, "checksums.json is empty, not {file: [bytes, CRC-32]} of the checkpoint's files: it verifies nothing"),
    ("verified", "checksums.json is a JSON str, not {file: [bytes, CRC-32]}"),
    ({"common.pt": [12]}, "checksums.json: field 'common.pt' is [12], not [bytes, CRC-32]"),
], ids=["empty", "string", "malformed-entry"])
def test_a_damaged_checksum_manifest_verifies_nothing(trained, tmp_path, capsys, manifest, line):
    _, run = _copy(trained, tmp_path)
    latest = RunDir(run).list_checkpoints()[-1]
    _flip_bytes(max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size))  # what the manifest would catch
    (latest / CHECKSUMS).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["export-hf", str(latest), str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err
    assert f"{latest / CHECKSUMS}" in err and line in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and not (tmp_path / "hf").exists()


def test_data_rewritten_in_its_middle_is_refused_naming_the_file(trained, tmp_path, capsys):
    data, run = _copy(trained, tmp_path)
    tokens = np.memmap(data / TOKENS_FILE, dtype=json.loads((data / "metadata.json").read_text())["token_dtype"],
                       mode="r+")
    middle = len(tokens) // 2
    tokens[middle:middle + 16] = tokens[:16][::-1].copy()  # other valid tokens, the same size
    tokens.flush()
    del tokens
    capsys.readouterr()
    assert train_tiny(run, data, f"data.path={data}", max_steps=6) == 2
    err = capsys.readouterr().err
    assert f"{data / TOKENS_FILE} changed since it was packed" in err, err
    assert RunDir(run).list_checkpoints()[-1].name == "iter_0000004"  # nothing trained on other tokens


def test_moved_data_is_read_again_and_the_time_is_said_unchanged_data_is_not(trained, tmp_path, capsys):
    data, run = _copy(trained, tmp_path)  # the copy is the run's data now: another path
    capsys.readouterr()
    assert train_tiny(run, data, f"data.path={data}", max_steps=5) == 0
    out = capsys.readouterr().out
    assert f"data.path={data.resolve()}: its files moved or changed size or modification time" in out, out
    assert "again in" in out and "they match the digests pack recorded" in out
    assert train_tiny(run, data, f"data.path={data}", max_steps=6) == 0  # the same files as at the last save
    assert "again in" not in capsys.readouterr().out
