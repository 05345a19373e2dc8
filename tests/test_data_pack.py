"""`nemo-anchor pack` and PackedDataset against a naive reference packer (byte tokenizer: ids are UTF-8 bytes)."""
import json
import random

import numpy as np
import pytest
import torch

from nemo_anchor.checksums import verify_digests
from nemo_anchor.cli import main as cli_main
from nemo_anchor.data import PackedDataset, PackOptions, load_tokenizer, pack, packing

BOS, EOS, PAD = 256, 257, 258  # the byte tokenizer's specials


def random_documents(count: int, seed: int, max_chars: int = 300) -> list[dict]:
    """Multilingual texts of very different lengths (some empty), three domains."""
    rng = random.Random(seed)
    alphabet = "abcdefgh ijk\n\t.,é中文🙂<s></s>"
    documents = []
    for number in range(count):
        length = rng.choice([0, 1, 2, rng.randint(3, 40), rng.randint(40, max_chars)])
        documents.append({"text": "".join(rng.choice(alphabet) for _ in range(length)),
                          "domain": rng.choice(["web", "code", "books"]), "group": f"g{number // 3}"})
    return documents


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    return path


def reference_windows(documents, tags, seq_length, drop_last):
    """The spec, naively: anchor, then each document as (tag, tokens, EOS), cut every T - 1 tokens.

    Each token is (id, document number, may be a label); padding is document -1.
    """
    body = []
    for number, (tokens, tag) in enumerate(zip(documents, tags)):
        body += [(t, number, False) for t in tag] + [(t, number, True) for t in tokens] + [(EOS, number, True)]
    windows = []
    for first in range(0, len(body), seq_length - 1):
        chunk = body[first:first + seq_length - 1]
        if len(chunk) < seq_length - 1:
            if drop_last:
                break
            chunk += [(PAD, -1, False)] * (seq_length - 1 - len(chunk))
        windows.append([(BOS, chunk[0][1], False)] + chunk)
    return windows


def assert_window_matches(item, window):
    T = len(window)
    tokens = [token for token, _, _ in window]
    owner = [number for _, number, _ in window]
    boundaries = [0] + [t for t in range(1, T) if owner[t] != owner[t - 1]] + [T]
    loss = [float(t + 1 < T and owner[t + 1] == owner[t] and window[t + 1][2]) for t in range(T)]
    assert item["tokens"].tolist() == tokens
    assert item["labels"].tolist() == tokens[1:] + [PAD]
    assert item["cu_seqlens"].tolist() == boundaries
    assert item["loss_mask"].tolist() == loss
    assert item["position_ids"].tolist() == list(range(T))
    assert (item["tokens"].dtype, item["labels"].dtype, item["loss_mask"].dtype, item["position_ids"].dtype,
            item["cu_seqlens"].dtype) == (torch.int64, torch.int64, torch.float32, torch.int64, torch.int32)


def tokens_of(record):
    return list(record["text"].encode("utf-8"))


# (window length, body tokens the packer writes at a time): windows of 64 out of batches that begin and end inside
# them, and windows of 2,000 that no single batch fills (as 2^20-token windows out of 2^20-token batches)
WINDOWS_AND_BATCHES = [(64, None), (64, 7), (2000, 700)]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("domain_tags", [False, True])
@pytest.mark.parametrize("seq_length, batch_tokens", WINDOWS_AND_BATCHES)
def test_windows_match_reference_packer_in_input_order(tmp_path, monkeypatch, drop_last, domain_tags, seq_length,
                                                       batch_tokens):
    if batch_tokens:
        monkeypatch.setattr(packing, "BATCH_TOKENS", batch_tokens)
        monkeypatch.setattr(packing, "PART_TOKENS", batch_tokens)
    records = random_documents(80, seed=1)
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    options = PackOptions(seq_length=seq_length, drop_last=drop_last, domain_tags=domain_tags)
    pack([source], "byte", tmp_path / "out", options)
    ds = PackedDataset(tmp_path / "out")
    assert verify_digests(tmp_path / "out", ds.metadata["checksums"]) == {}

    kept = [record for record in records if record["text"]]
    tags = [list(f"<{record['domain']}>\n".encode()) if domain_tags else [] for record in kept]
    expected = reference_windows([tokens_of(record) for record in kept], tags, seq_length, drop_last)
    assert len(ds) == len(expected) > 1
    for index, window in enumerate(expected):
        assert_window_matches(ds[index], window)
    # packed documents are the non-empty inputs, in input order
    assert ds.document_sources.tolist() == [i for i, record in enumerate(records) if record["text"]]


def reconstruct_documents(ds):
    """Concatenate every packed document's segments (anchors removed), keyed by packed document number."""
    pieces = {}
    for index in range(len(ds)):
        item, owners = ds[index], ds.window_documents(index)
        cu = item["cu_seqlens"].tolist()
        for segment, owner in enumerate(owners):
            tokens = item["tokens"][cu[segment]:cu[segment + 1]].tolist()
            pieces.setdefault(int(owner), []).extend(tokens[1:] if segment == 0 else tokens)
    padding = pieces.pop(-1, [])
    assert set(padding) <= {ds.metadata["pad_id"]}
    return pieces


def test_shuffled_packing_is_a_seeded_permutation_and_lossless(tmp_path):
    records = random_documents(60, seed=2)
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    for name, seed in [("a", 7), ("b", 7), ("c", 8)]:
        pack([source], "byte", tmp_path / name, PackOptions(seq_length=48, shuffle=True, seed=seed, domain_tags=True))
    a, b, c = (PackedDataset(tmp_path / name) for name in "abc")
    nonempty = [i for i, record in enumerate(records) if record["text"]]
    assert sorted(a.document_sources.tolist()) == nonempty
    assert a.document_sources.tolist() != nonempty  # shuffled
    assert a.document_sources.tolist() == b.document_sources.tolist()  # deterministic
    assert (a.path / "tokens.bin").read_bytes() == (b.path / "tokens.bin").read_bytes()
    assert a.document_sources.tolist() != c.document_sources.tolist()

    rebuilt = reconstruct_documents(a)
    for number, source_index in enumerate(a.document_sources.tolist()):
        record = records[source_index]
        tag = list(f"<{record['domain']}>\n".encode())
        assert rebuilt[number] == tag + tokens_of(record) + [EOS]
    kept = [records[i] for i in a.document_sources.tolist()]
    expected = reference_windows([tokens_of(r) for r in kept], [list(f"<{r['domain']}>\n".encode()) for r in kept],
                                 48, drop_last=False)
    for index, window in enumerate(expected):
        assert_window_matches(a[index], window)


def test_interleaved_chunks_keep_each_documents_order(tmp_path):
    records = [{"text": "".join(chr(97 + (i + j) % 26) for j in range(n)), "domain": "d"}
               for i, n in enumerate([200, 150, 90, 300, 5, 120, 60, 250, 80, 170])]
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    pack([source], "byte", tmp_path / "out", PackOptions(seq_length=512, interleave_chunks=4, seed=3))
    ds = PackedDataset(tmp_path / "out")
    rebuilt = reconstruct_documents(ds)
    assert [rebuilt[n] for n in range(len(records))] == [tokens_of(r) + [EOS] for r in records]
    owners = np.concatenate([ds.window_documents(i) for i in range(len(ds))])
    runs = owners[np.concatenate(([True], np.diff(owners) != 0))]  # consecutive segments of a document merged
    runs = runs[runs >= 0]
    assert len(runs) > len(set(runs.tolist()))  # some document's chunks are separated by other documents


def test_upsampling_draws_long_documents_factor_times_as_often_per_domain(tmp_path):
    rng = random.Random(4)
    records = [{"text": "x" * (rng.choice([400, 600]) if i % 4 == 0 else rng.choice([20, 30])),
                "domain": ["a", "b"][(i // 4) % 2]} for i in range(2000)]
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    pack([source], "byte", tmp_path / "out", PackOptions(seq_length=256, upsample_factor=4, long_doc_tokens=300))
    ds = PackedDataset(tmp_path / "out")
    copies = np.bincount(ds.document_sources, minlength=len(records))
    lengths = np.array([len(r["text"]) for r in records])
    domains = np.array([r["domain"] for r in records])
    for domain in ("a", "b"):
        mine = domains == domain
        long, short = mine & (lengths >= 300), mine & (lengths < 300)
        assert 3.2 < copies[long].mean() / copies[short].mean() < 4.8
        assert abs((copies * lengths)[mine].sum() / lengths[mine].sum() - 1) < 0.05  # domain keeps its tokens
    rebuilt = reconstruct_documents(ds)
    assert all(rebuilt[n] == tokens_of(records[s]) + [EOS] for n, s in enumerate(ds.document_sources.tolist()))


def test_validation_split_holds_out_whole_groups_and_is_loadable(tmp_path):
    records = random_documents(120, seed=5)
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    stats = pack([source], "byte", tmp_path / "out", PackOptions(seq_length=64, valid_fraction=0.3, seed=1))
    train, valid = PackedDataset(tmp_path / "out"), PackedDataset(tmp_path / "out" / "valid")
    train_groups = {records[i]["group"] for i in train.document_sources}
    valid_groups = {records[i]["group"] for i in valid.document_sources}
    assert train_groups and valid_groups and not train_groups & valid_groups
    assert sorted(train.document_sources.tolist() + valid.document_sources.tolist()) == \
        [i for i, r in enumerate(records) if r["text"]]
    assert stats["splits"]["valid"]["documents"] == len(valid.document_sources)
    assert train.metadata["valid"] == "valid" and valid.metadata["split"] == "valid"
    assert load_tokenizer(tmp_path / "out").anchor_id == BOS == valid.tokenizer.anchor_id


def test_min_doc_tokens_and_statistics(tmp_path):
    records = random_documents(100, seed=6)
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    stats = pack([source], "byte", tmp_path / "out", PackOptions(seq_length=32, min_doc_tokens=10))
    kept = [r for r in records if len(r["text"].encode()) >= 10]
    train = stats["splits"]["train"]
    assert train["documents"] == len(kept)
    assert train["document_tokens"] == sum(len(tokens_of(r)) for r in kept)
    assert stats["skipped"]["empty"] == sum(not r["text"] for r in records)
    assert stats["skipped"]["short"] == sum(0 < len(r["text"].encode()) < 10 for r in records)
    for domain, numbers in train["domains"].items():
        mine = [r for r in kept if r["domain"] == domain]
        assert numbers["documents"] == len(mine)
        assert numbers["token_ratio"] == pytest.approx(sum(len(tokens_of(r)) for r in mine) / train["document_tokens"])
    assert sum(d["mixture_ratio"] for d in train["domains"].values()) == pytest.approx(1)
    assert train["tokens"] == train["windows"] * 32 == (train["document_tokens"] + train["eos_tokens"]
                                                          + train["anchor_tokens"] + train["padding_tokens"])
    assert json.loads((tmp_path / "out" / "stats.json").read_text()) == json.loads(json.dumps(stats))
    assert (tmp_path / "out" / "document_lengths.png").read_bytes()[:4] == b"\x89PNG"


def test_text_folder_and_parquet_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second file\n")
    (folder / "sub" / "a.md").write_text("first ✓")
    (folder / "empty.txt").write_text("")
    (folder / ".hidden").write_text("ignored")
    pq.write_table(pa.table({"text": ["from parquet", "row two"], "domain": ["pq", None]}), tmp_path / "t.parquet")
    pack([folder, tmp_path / "t.parquet"], "byte", tmp_path / "out", PackOptions(seq_length=16))
    ds = PackedDataset(tmp_path / "out")
    rebuilt = reconstruct_documents(ds)
    texts = ["second file\n", "first ✓", "from parquet", "row two"]
    assert [rebuilt[n][:-1] for n in range(4)] == [list(t.encode()) for t in texts]
    assert ds.metadata["domains"] == ["books", "pq", "t"]
    assert ds.document_domains.tolist() == [0, 0, 1, 2]


def test_cli_pack_trains_a_bpe_saved_beside_the_data(tmp_path, capsys):
    records = random_documents(200, seed=7, max_chars=600)
    source = write_jsonl(tmp_path / "docs.jsonl", records)
    code = cli_main(["pack", "--input", str(source), "--tokenizer", "train-bpe:300", "--seq-length", "128",
                     "--output", str(tmp_path / "out"), "--valid-fraction", "0.2", "--shuffle"])
    assert code == 0
    assert "[train]" in capsys.readouterr().out
    ds = PackedDataset(tmp_path / "out")
    tokenizer = load_tokenizer(tmp_path / "out")
    assert tokenizer.vocab_size == 300 and ds.metadata["vocab_size"] == 300
    rebuilt = reconstruct_documents(ds)
    for number, source_index in enumerate(ds.document_sources.tolist()):
        assert tokenizer.decode(rebuilt[number][:-1]) == records[source_index]["text"]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "out" / "tokenizer"), local_files_only=True)
    assert hf.decode(rebuilt[0][:-1]) == records[ds.document_sources[0]]["text"]


def test_overwrite(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", random_documents(20, seed=8))
    pack([source], "byte", tmp_path / "out", PackOptions(seq_length=16))
    with pytest.raises(ValueError, match="already exists"):
        pack([source], "byte", tmp_path / "out", PackOptions(seq_length=32))
    pack([source], "byte", tmp_path / "out", PackOptions(seq_length=32), overwrite=True)
    assert PackedDataset(tmp_path / "out").seq_length == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "out"]
