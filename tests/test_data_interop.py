"""Interop: NeMo 2 packed .npy (both ways) and Megatron indexed datasets as input."""
import json

import numpy as np
import pytest
import torch

from nemo_anchor.data import PackedDataset, PackOptions, pack, read_nemo_packed, write_nemo_packed

EOS, PAD = 257, 258


def nemo_training_pairs(pack_entry):
    """What NeMo's GPTSFTPackedDataset.collate_fn trains on (answer_only_loss): per sequence,
    inputs seq[:-1], labels seq[1:], mask loss_mask[start:end - 1]; returns the trained (input position
    context, label) as (sequence tokens up to the input, label)."""
    ids, mask = pack_entry["input_ids"], pack_entry["loss_mask"]
    bounds = pack_entry["seq_start_id"] + [len(ids)]
    trained = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        for position in range(start, end - 1):
            if mask[position]:
                trained.append((tuple(ids[start:position + 1]), ids[position + 1]))
    return trained


def our_training_pairs(item):
    """The same from one of our windows: context = the segment up to the position (what intra-document
    attention sees), label = labels[t], for every t with loss_mask 1."""
    cu = item["cu_seqlens"].tolist()
    trained = []
    for start, end in zip(cu[:-1], cu[1:]):
        for position in range(start, end):
            if item["loss_mask"][position]:
                trained.append((tuple(item["tokens"][start:position + 1].tolist()), int(item["labels"][position])))
    return trained


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("nemo")
    records = [{"text": "abc " * n, "domain": ["x", "y"][n % 2]} for n in (5, 30, 2, 17, 44, 9, 3)]
    (folder / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    pack([folder / "docs.jsonl"], "byte", folder / "out", PackOptions(seq_length=64, domain_tags=True,
                                                                        valid_fraction=0.3, seed=2), export_nemo=True)
    return folder / "out"


def test_written_nemo_file_trains_what_we_train(packed):
    ds = PackedDataset(packed)
    packs = np.load(packed / "nemo" / "training_64.npy", allow_pickle=True)
    assert len(packs) == len(ds)
    for index, entry in enumerate(packs):
        assert set(entry) == {"input_ids", "loss_mask", "seq_start_id"}
        assert all(isinstance(entry[key], list) for key in entry)  # NeMo concatenates seq_start_id + [len]
        assert nemo_training_pairs(entry) == our_training_pairs(ds[index])
        assert PAD not in entry["input_ids"]  # trailing padding is not a NeMo sequence
    metadata = json.loads((packed / "nemo" / "64_metadata.jsonl").read_text())
    assert len(metadata) == 2  # train, then validation, as prepare_packed_sequence_data appends them
    lengths = [len(entry["input_ids"]) for entry in packs]
    sequences = [np.diff(entry["seq_start_id"] + [len(entry["input_ids"])]) for entry in packs]
    assert metadata[0] == {
        "dataset_max_seqlen": int(max(s.max() for s in sequences)),
        "max_samples_per_bin": max(len(s) for s in sequences),
        "packing_factor": round(sum(len(s) for s in sequences) / len(packs), 2),
        "packing_efficiency": round(sum(lengths) / len(packs) / 64 * 100, 2),
        "pack_size": 64,
        "min_packed_seqlen": min(lengths),
    }
    assert len(np.load(packed / "nemo" / "validation_64.npy", allow_pickle=True)) == len(PackedDataset(packed / "valid"))


def test_nemo_packed_input_round_trips_its_sequences(tmp_path):
    """A file shaped like NeMo's fill_packing_strategy output: sequences with an answer-only loss mask."""
    rng = np.random.default_rng(0)
    packs, sequences = [], []
    for _ in range(5):
        ids, mask, starts = [], [], []
        for _ in range(rng.integers(1, 4)):
            sequence = rng.integers(0, 256, rng.integers(2, 30)).tolist() + [EOS]
            answer = int(rng.integers(1, len(sequence)))
            starts.append(len(ids))
            ids += sequence
            mask += [index >= answer - 1 for index in range(len(sequence) - 1)] + [False]  # rolled by one
            sequences.append((sequence, answer))
        packs.append({"input_ids": ids, "loss_mask": mask, "seq_start_id": starts})
    np.save(tmp_path / "training_64.npy", np.array(packs, dtype=object))

    stats = pack([tmp_path / "training_64.npy"], "byte", tmp_path / "out", PackOptions(seq_length=48))
    ds = PackedDataset(tmp_path / "out")
    assert stats["splits"]["train"]["eos_tokens"] == 0  # sequences already end with EOS
    assert ds.document_sources.tolist() == list(range(len(sequences)))
    rebuilt, trained = {}, set()  # trained: (sequence, index of the label token in it)
    for index in range(len(ds)):
        item, owners = ds[index], ds.window_documents(index)
        cu = item["cu_seqlens"].tolist()
        for segment, owner in enumerate(owners):
            first = cu[segment] + (segment == 0)  # the anchor is no sequence token
            done = len(rebuilt.setdefault(int(owner), []))
            rebuilt[int(owner)].extend(item["tokens"][first:cu[segment + 1]].tolist())
            trained.update((int(owner), done + t + 1 - first) for t in range(cu[segment], cu[segment + 1])
                           if item["loss_mask"][t])
    assert [rebuilt[n] for n in range(len(sequences))] == [sequence for sequence, _ in sequences]
    # exactly NeMo's labels are trained: the answer tokens, never the context
    assert trained == {(n, k) for n, (sequence, answer) in enumerate(sequences) for k in range(answer, len(sequence))}


def test_our_nemo_export_reads_back_as_its_segments(packed, tmp_path):
    sequences = read_nemo_packed(packed / "nemo" / "training_64.npy")
    ds = PackedDataset(packed)
    segments = []
    for index in range(len(ds)):
        item = ds[index]
        cu = item["cu_seqlens"].tolist()
        for segment, owner in enumerate(ds.window_documents(index)):
            if owner >= 0:
                segments.append(item["tokens"][cu[segment]:cu[segment + 1]].tolist())
    assert [sequences.tokens[a:b].tolist() for a, b in zip(sequences.offsets[:-1], sequences.offsets[1:])] == segments


def test_write_nemo_packed_appends_to_metadata_list(packed, tmp_path):
    first = write_nemo_packed(PackedDataset(packed), tmp_path / "training_64.npy", tmp_path / "meta.jsonl")
    second = write_nemo_packed(packed / "valid", tmp_path / "validation_64.npy", tmp_path / "meta.jsonl")
    assert json.loads((tmp_path / "meta.jsonl").read_text()) == [first, second]
    assert (tmp_path / "training_64.npy").read_bytes() == (packed / "nemo" / "training_64.npy").read_bytes()
    (tmp_path / "bad.jsonl").write_text("{}")
    with pytest.raises(ValueError, match="bad.jsonl must hold a JSON list"):
        write_nemo_packed(packed, tmp_path / "x.npy", tmp_path / "bad.jsonl")
    assert not (tmp_path / "x.npy").exists()


def test_bad_nemo_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(3))
    with pytest.raises(ValueError, match="a.npy: expected a 1-D array of dicts"):
        read_nemo_packed(tmp_path / "a.npy")
    np.save(tmp_path / "b.npy", np.array([{"input_ids": [1, 2]}], dtype=object))
    with pytest.raises(ValueError, match="b.npy: pack 0: expected a dict with keys"):
        read_nemo_packed(tmp_path / "b.npy")
    np.save(tmp_path / "c.npy", np.array([{"input_ids": [1, 2], "loss_mask": [1, 1], "seq_start_id": [1]}], dtype=object))
    with pytest.raises(ValueError, match="c.npy: pack 0: seq_start_id must rise"):
        read_nemo_packed(tmp_path / "c.npy")
    (tmp_path / "d.npy").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="d.npy: not a readable NeMo packed .npy"):
        read_nemo_packed(tmp_path / "d.npy")


def test_megatron_indexed_input(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, IndexedDataset

    rng = np.random.default_rng(1)
    documents = [rng.integers(0, 256, n).tolist() for n in (5, 70, 1, 33)] + [[7, 8, EOS]]  # --append-eod style
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=np.int32)
    for document in documents[:2]:
        builder.add_document(torch.tensor(document), [len(document)])
    builder.add_document(torch.tensor(documents[2] + documents[3]), [1, 33])  # one document, two sequences
    builder.add_document(torch.tensor(documents[4]), [3])
    builder.finalize(str(tmp_path / "corpus.idx"))
    assert len(IndexedDataset(str(tmp_path / "corpus"))) == 5

    pack([tmp_path / "corpus.idx"], "byte", tmp_path / "out", PackOptions(seq_length=32))
    ds = PackedDataset(tmp_path / "out")
    stream = np.concatenate([ds[i]["tokens"][1:].numpy() for i in range(len(ds))])
    expected = documents[0] + [EOS] + documents[1] + [EOS] + documents[2] + documents[3] + [EOS] + documents[4]
    assert stream[:len(expected)].tolist() == expected and set(stream[len(expected):].tolist()) <= {PAD}
    assert ds.metadata["token_dtype"] == "uint16" and ds.metadata["domains"] == ["corpus"]
