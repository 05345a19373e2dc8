"""Checkpoints that cannot be trusted: a shard damaged after the save is detected by its checksum, and
the resume falls back to the previous intact checkpoint, naming the file."""
import json
import os

import pytest

from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training.checkpoint import CHECKSUMS
from tiny_runs import pack_texts, train_tiny  # tests/tiny_runs.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return pack_texts(tmp_path_factory.mktemp("robust_checkpoint"))


def train(tmp_path, data_path, *overrides):
    return train_tiny(tmp_path / "run", data_path, *overrides)


def test_a_shard_overwritten_with_same_size_garbage_falls_back_to_the_previous_checkpoint(data, tmp_path, capsys):
    assert train(tmp_path, data) == 0
    run = RunDir(tmp_path / "run")
    previous, latest = run.list_checkpoints()
    sums = json.loads((latest / CHECKSUMS).read_text())
    on_disk = {str(p.relative_to(latest)) for p in latest.rglob("*") if p.is_file()} - {CHECKSUMS}
    assert set(sums) == on_disk  # every file of the checkpoint, the shards, the index and config.yaml
    shard = max((latest / name for name in sums if name.endswith(".distcp")), key=lambda p: p.stat().st_size)
    shard.write_bytes(os.urandom(shard.stat().st_size))  # same size: a size check cannot see it
    capsys.readouterr()

    assert train(tmp_path, data, "trainer.max_steps=6") == 0
    out = capsys.readouterr().out
    assert f"warning: cannot resume from {latest.name}: {shard} is corrupt" in out
    assert f"resumed from {previous} at step {checkpoint_step(previous)}" in out
    assert [checkpoint_step(p) for p in run.list_checkpoints()] == [4, 6]  # steps 3-4 retrained and saved again
