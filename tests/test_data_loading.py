"""WindowSampler (resume, data parallelism) and collate_windows / PackedDataset serving."""
import itertools
import json
import pickle

import numpy as np
import pytest
import torch

from nemo_anchor.data import PackedDataset, PackOptions, WindowSampler, collate_windows, pack


def take(iterator, count):
    return list(itertools.islice(iterator, count))


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_sees_exactly_the_windows_of_the_uninterrupted_run(shuffle):
    micro_batch, accumulation, steps = 3, 2, 9  # 54 windows: crosses epochs of 17 windows per rank
    reference = WindowSampler(35, rank=1, world_size=2, seed=5, shuffle=shuffle)
    stream = iter(reference)
    uninterrupted = [take(stream, micro_batch) for _ in range(steps * accumulation)]

    sampler = WindowSampler(35, rank=1, world_size=2, seed=5, shuffle=shuffle)
    stream = iter(sampler)
    seen = [take(stream, micro_batch) for _ in range(4 * accumulation)]
    state = json.loads(json.dumps(sampler.state_dict()))  # checkpoints store plain data
    assert state["consumed"] == 4 * accumulation * micro_batch

    resumed = WindowSampler(35, rank=1, world_size=2, seed=5, shuffle=shuffle)
    resumed.load_state_dict(state)
    stream = iter(resumed)
    seen += [take(stream, micro_batch) for _ in range((steps - 4) * accumulation)]
    assert seen == uninterrupted
    assert resumed.epoch == 54 // 17


def test_ranks_partition_each_epoch_and_epochs_reshuffle():
    samplers = [WindowSampler(23, rank=rank, world_size=4, seed=1) for rank in range(4)]
    streams = [iter(sampler) for sampler in samplers]
    for epoch in range(3):
        per_rank = [take(stream, 5) for stream in streams]  # 23 // 4 = 5 each, 3 dropped
        flat = sum(per_rank, [])
        assert len(set(flat)) == 20 and set(flat) <= set(range(23))
        order = np.random.default_rng([1, epoch]).permutation(23)[:20]
        assert sorted(flat) == sorted(order.tolist())
    assert samplers[0].epoch_windows(0).tolist() != samplers[0].epoch_windows(1).tolist()
    assert WindowSampler(6, shuffle=False).epoch_windows(4).tolist() == list(range(6))
    assert WindowSampler(7, rank=2, world_size=3, shuffle=False).epoch_windows(0).tolist() == [2, 5]


def test_sampler_rejects_bad_configuration_and_foreign_state():
    with pytest.raises(ValueError, match="cannot be shared by 4"):
        WindowSampler(3, world_size=4)
    with pytest.raises(ValueError, match="rank 2 is not in a world of size 2"):
        WindowSampler(10, rank=2, world_size=2)
    state = WindowSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        WindowSampler(10, seed=2).load_state_dict(state)
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


def test_dataset_pickles_by_path_and_feeds_a_dataloader(dataset):
    clone = pickle.loads(pickle.dumps(dataset))
    assert len(pickle.dumps(dataset)) < 1000  # the windows are reopened, not copied
    assert all(torch.equal(clone[-1][key], dataset[len(dataset) - 1][key]) for key in dataset[0])
    sampler = WindowSampler(len(dataset), seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=itertools.islice(iter(sampler), 4),
                                         collate_fn=collate_windows)
    batches = list(loader)
    assert [b["tokens"].shape for b in batches] == [(2, dataset.seq_length)] * 2
    assert torch.equal(batches[0]["tokens"][0], dataset[sampler.epoch_windows(0)[0]]["tokens"])
    with pytest.raises(IndexError):
        dataset[len(dataset)]
