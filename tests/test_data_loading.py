"""WindowSampler (resume, data parallelism) and collate_windows / PackedDataset serving."""
import json
import pickle

import numpy as np
import pytest
import torch

from nemo_anchor.data import PackedDataset, PackOptions, WindowSampler, collate_windows, pack, rank_microbatches


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_sees_exactly_the_windows_of_the_uninterrupted_run(shuffle):
    global_batch, steps = 6, 9  # 54 windows: crosses epochs of 17 windows
    reference = WindowSampler(17, seed=5, shuffle=shuffle)
    uninterrupted = [reference.next_global_batch(global_batch) for _ in range(steps)]

    sampler = WindowSampler(17, seed=5, shuffle=shuffle)
    seen = [sampler.next_global_batch(global_batch) for _ in range(4)]
    state = json.loads(json.dumps(sampler.state_dict()))  # checkpoints store plain data
    assert state["consumed"] == 4 * global_batch

    resumed = WindowSampler(17, seed=5, shuffle=shuffle)
    resumed.load_state_dict(state)
    seen += [resumed.next_global_batch(global_batch) for _ in range(steps - 4)]
    assert seen == uninterrupted
    assert resumed.epoch == 54 // 17
    stream = [w for batch in uninterrupted for w in batch]
    for epoch in range(3):  # every epoch is a permutation of all windows
        assert sorted(stream[epoch * 17:(epoch + 1) * 17]) == list(range(17))


def test_epochs_follow_the_seeded_permutation_and_reshuffle():
    sampler = WindowSampler(23, seed=1)
    for epoch in range(3):
        expected = np.random.default_rng([1, epoch]).permutation(23).tolist()
        assert sampler.next_global_batch(23) == expected
    assert sampler.epoch_windows(0).tolist() != sampler.epoch_windows(1).tolist()
    assert WindowSampler(6, shuffle=False).epoch_windows(4).tolist() == list(range(6))


@pytest.mark.parametrize("data_parallel_size, micro_batch", [(1, 8), (2, 2), (4, 1), (2, 4)])
def test_ranks_split_the_global_batch_whatever_the_layout(data_parallel_size, micro_batch):
    batch = WindowSampler(40, seed=3).next_global_batch(8)
    per_rank = [rank_microbatches(batch, micro_batch, rank, data_parallel_size) for rank in range(data_parallel_size)]
    assert all(len(mb) == micro_batch for rank in per_rank for mb in rank)
    flat = [w for rank in per_rank for mb in rank for w in mb]
    assert sorted(flat) == sorted(batch)  # every window of the step once, on exactly one rank


def test_sampler_rejects_bad_configuration_and_foreign_state():
    with pytest.raises(ValueError, match="0 windows"):
        WindowSampler(0)
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size x data-parallel size = 3 x 2"):
        rank_microbatches(list(range(8)), 3, 0, 2)
    state = WindowSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        WindowSampler(10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_windows=10"):
        WindowSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="consumed"):
        WindowSampler(10, seed=1).load_state_dict({**state, "consumed": -1})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed")
    lines = [json.dumps({"text": "word " * n}) for n in (3, 40, 7, 90, 1, 25, 60, 12)]
    (folder / "docs.jsonl").write_text("\n".join(lines))
    pack([folder / "docs.jsonl"], "byte", folder / "out", PackOptions(seq_length=96))
    return PackedDataset(folder / "out")


def test_collate_windows_offsets_boundaries(dataset):
    items = [dataset[i] for i in (2, 0, 3)]
    batch = collate_windows(items)
    T = dataset.seq_length
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[key].shape == (3, T) and batch[key].dtype == items[0][key].dtype
        assert torch.equal(batch[key][1], items[1][key])
    expected = [0] + [int(b) + row * T for row, item in enumerate(items) for b in item["cu_seqlens"][1:]]
    assert batch["cu_seqlens"].tolist() == expected and batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_windows"].tolist() == [0, T, 2 * T, 3 * T] and batch["cu_windows"].dtype == torch.int32
    assert set(batch["cu_windows"].tolist()) <= set(batch["cu_seqlens"].tolist())
    with pytest.raises(ValueError, match="different lengths"):
        collate_windows([items[0], {key: value[:-2] for key, value in items[1].items()}])
    with pytest.raises(ValueError, match="at least one"):
        collate_windows([])
    gigawindow = {"tokens": torch.zeros(1, dtype=torch.int64).expand(1 << 30)}  # 2^30 tokens, no memory
    with pytest.raises(ValueError, match="2147483648 tokens, more than the int32 cu_seqlens"):
        collate_windows([gigawindow, gigawindow])  # checked before anything is stacked


def test_dataset_pickles_by_path_and_feeds_a_dataloader(dataset):
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 1000  # the windows are reopened, not copied
    assert all(torch.equal(clone[-1][key], dataset[len(dataset) - 1][key]) for key in dataset[0])
    sampler = WindowSampler(len(dataset), seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler.next_global_batch(4),
                                         collate_fn=collate_windows)
    batches = list(loader)
    assert [b["tokens"].shape for b in batches] == [(2, dataset.seq_length)] * 2
    assert torch.equal(batches[0]["tokens"][0], dataset[sampler.epoch_windows(0)[0]]["tokens"])
    with pytest.raises(IndexError):
        dataset[len(dataset)]
