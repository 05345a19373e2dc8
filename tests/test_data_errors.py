"""Every bad input is a ValueError that names the problem, and no partial output is left behind."""
import json

import numpy as np
import pytest

from nemo_anchor.cli import main as cli_main
from nemo_anchor.data import PackedDataset, PackOptions, pack


def assert_fails_cleanly(tmp_path, inputs, match, tokenizer="byte", **options):
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=match):
        pack(inputs, tokenizer, out, PackOptions(**{"seq_length": 16, **options}))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary directory either


def jsonl(tmp_path, lines, name="docs.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_missing_and_empty_inputs(tmp_path):
    assert_fails_cleanly(tmp_path, [tmp_path / "nope.jsonl"], "nope.jsonl does not exist")
    (tmp_path / "empty.jsonl").write_text("")
    assert_fails_cleanly(tmp_path, [tmp_path / "empty.jsonl"], "empty.jsonl is empty")
    (tmp_path / "folder").mkdir()
    assert_fails_cleanly(tmp_path, [tmp_path / "folder"], "folder holds no input files")
    blank = jsonl(tmp_path, [b"", b"  "], "blank.jsonl")
    assert_fails_cleanly(tmp_path, [blank], "no training documents")
    assert_fails_cleanly(tmp_path, [], "no inputs")


def test_unreadable_file(tmp_path, monkeypatch):
    source = jsonl(tmp_path, [b'{"text": "a"}'])

    def denied(path, *args, **kwargs):  # chmod does not stop root, so the read itself fails
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("nemo_anchor.data.readers.open", denied, raising=False)
    assert_fails_cleanly(tmp_path, [source], "cannot read .*docs.jsonl: .*Permission denied")


def test_invalid_utf8_is_reported_with_file_and_line_or_skipped(tmp_path):
    source = jsonl(tmp_path, [b'{"text": "good"}', b'{"text": "bad \xff byte"}', b'{"text": "also good"}'])
    assert_fails_cleanly(tmp_path, [source], r"docs.jsonl:2: invalid UTF-8")
    stats = pack([source], "byte", tmp_path / "skipped", PackOptions(seq_length=16, on_invalid_utf8="skip"))
    assert stats["skipped"] == {"invalid_utf8": 1} and stats["splits"]["train"]["documents"] == 2

    surrogate = jsonl(tmp_path, [b'{"text": "ok"}', b'{"text": "lone \\ud800 surrogate"}'], "surrogate.jsonl")
    assert_fails_cleanly(tmp_path, [surrogate], r"surrogate.jsonl:2: invalid UTF-8")
    text = tmp_path / "plain.txt"
    text.write_bytes(b"line one\nline two\n\xc3\x28 broken\n")
    assert_fails_cleanly(tmp_path, [text], r"plain.txt:3: invalid UTF-8")


def test_malformed_records(tmp_path):
    assert_fails_cleanly(tmp_path, [jsonl(tmp_path, [b'{"text": "a"}', b'{"body": "b"}'], "a.jsonl")],
                         r"a.jsonl:2: no 'text' field \(fields: \['body'\]\)")
    assert_fails_cleanly(tmp_path, [jsonl(tmp_path, [b'{"text": 3}'], "b.jsonl")], r"b.jsonl:1: field 'text' is int")
    assert_fails_cleanly(tmp_path, [jsonl(tmp_path, [b'{"text": "a"', b''], "c.jsonl")], r"c.jsonl:1: invalid JSON")
    assert_fails_cleanly(tmp_path, [jsonl(tmp_path, [b'["text"]'], "d.jsonl")], r"d.jsonl:1: expected a JSON object")
    assert_fails_cleanly(tmp_path, [jsonl(tmp_path, [b'{"text": "a", "domain": 5}'], "e.jsonl")],
                         r"e.jsonl:1: domain/source must be a non-empty string")
    parquet = tmp_path / "f.parquet"
    parquet.write_bytes(b"not parquet at all")
    assert_fails_cleanly(tmp_path, [parquet], "f.parquet: not a readable Parquet file")


def test_bad_options(tmp_path):
    source = jsonl(tmp_path, [b'{"text": "abc"}'])
    assert_fails_cleanly(tmp_path, [source], "seq_length must be at least 2", seq_length=1)
    assert_fails_cleanly(tmp_path, [source], "valid_fraction", valid_fraction=1.0)
    assert_fails_cleanly(tmp_path, [source], "held out none", valid_fraction=1e-9)
    assert_fails_cleanly(tmp_path, [source], "interleave_chunks", interleave_chunks=0)
    assert_fails_cleanly(tmp_path, [source], "tag_template", tag_template="{topic}")
    assert_fails_cleanly(tmp_path, [source], "fill no window", drop_last=True, seq_length=64)
    assert_fails_cleanly(tmp_path, [source], "expected 'byte' or a local", tokenizer=str(tmp_path / "none"))
    assert_fails_cleanly(tmp_path, [source], "train-bpe:VOCAB_SIZE", tokenizer="train-bpe:big")
    assert_fails_cleanly(tmp_path, [source], "vocab_size 100 is below", tokenizer="train-bpe:100")


def test_tokenizer_with_neither_bos_nor_eos(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]")))
    bare.save_pretrained(str(tmp_path / "bare"))
    source = jsonl(tmp_path, [b'{"text": "a"}'])
    assert_fails_cleanly(tmp_path, [source], "neither a BOS nor an EOS", tokenizer=str(tmp_path / "bare"))


def test_corrupt_megatron_index(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    import torch

    builder = IndexedDatasetBuilder(str(tmp_path / "mega.bin"), dtype=np.uint16)
    for document in ([1, 2, 3], [4, 5]):
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(str(tmp_path / "mega.idx"))
    index = (tmp_path / "mega.idx").read_bytes()

    def corrupt(data, match):
        (tmp_path / "mega.idx").write_bytes(data)
        assert_fails_cleanly(tmp_path, [tmp_path / "mega"], "corrupt Megatron index .*mega.idx: .*" + match)

    corrupt(b"NOTMMIDX" + index[8:], "header")
    corrupt(index[:20], "shorter than")
    corrupt(index[:-8], "need")
    corrupt(index[:9] + (2).to_bytes(8, "little") + index[17:], "version 2")
    corrupt(index[:17] + bytes([6]) + index[18:], "not an integer token type")
    (tmp_path / "mega.idx").write_bytes(index)
    (tmp_path / "mega.bin").write_bytes((tmp_path / "mega.bin").read_bytes()[:-2])
    assert_fails_cleanly(tmp_path, [tmp_path / "mega"], "mega.bin has 8 bytes, the index describes 10")
    (tmp_path / "mega.bin").write_bytes(np.array([1, 2, 3, 4, 900], np.uint16).tobytes())
    assert_fails_cleanly(tmp_path, [tmp_path / "mega.bin"], r"token ids span \[1, 900\], outside .* 259")


def test_corrupt_packed_dataset_is_reported(tmp_path):
    source = jsonl(tmp_path, [json.dumps({"text": "x" * 50}).encode()])
    pack([source], "byte", tmp_path / "out", PackOptions(seq_length=16))
    starts = np.load(tmp_path / "out" / "segment_starts.npy")
    np.save(tmp_path / "out" / "segment_starts.npy", starts[::-1])
    with pytest.raises(ValueError, match="corrupt packed index .*segment_starts.npy"):
        PackedDataset(tmp_path / "out")
    np.save(tmp_path / "out" / "segment_starts.npy", starts)
    (tmp_path / "out" / "tokens.bin").write_bytes(b"\0" * 6)
    with pytest.raises(ValueError, match=r"tokens.bin: expected \d+ bytes"):
        PackedDataset(tmp_path / "out")
    with pytest.raises(ValueError, match="metadata.json is missing"):
        PackedDataset(tmp_path)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    code = cli_main(["pack", "--input", str(tmp_path / "missing.jsonl"), "--tokenizer", "byte", "--seq-length", "8",
                     "--output", str(tmp_path / "out")])
    assert code == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
