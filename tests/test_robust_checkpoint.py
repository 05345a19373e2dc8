"""Checkpoints that cannot be trusted: a shard damaged after the save is detected by its checksum, and
the resume falls back to the previous intact checkpoint, naming the file."""
import json
import os

import pytest
import torch

from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor import checksums
from nemo_anchor.checksums import CHECKSUMS
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
    sums = checksums.read_manifest(latest / CHECKSUMS)
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


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """A finished tiny run (checkpoints at steps 2 and 4); tests damage copies of it."""
    root = tmp_path_factory.mktemp("trained")
    assert train_tiny(root / "run", data) == 0
    return root / "run"


def _copy_run(trained, tmp_path):
    import shutil

    shutil.copytree(trained, tmp_path / "run")
    return RunDir(tmp_path / "run")


def _flip_bytes(shard, count=9):
    """Overwrite ``count`` bytes in the middle of ``shard`` with their complement (size unchanged)."""
    with open(shard, "r+b") as handle:
        handle.seek(shard.stat().st_size // 2)
        chunk = handle.read(count)
        handle.seek(shard.stat().st_size // 2)
        handle.write(bytes(255 - b for b in chunk))


def _largest_shard(ckpt_dir):
    return max(ckpt_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _snapshot(root):
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in root.rglob("*") if p.is_file() and p.name != "run.lock"}


READERS = {
    "export-hf": lambda ckpt, out, data: ["export-hf", str(ckpt), str(out)],
    "eval": lambda ckpt, out, data: ["eval", "--checkpoint", str(ckpt), "--output", str(out), "--tasks", "none",
                                     "--perplexity-data", str(data), "--perplexity-length", "32"],
    "probe": lambda ckpt, out, data: ["probe", "--checkpoint", str(ckpt), "--output", str(out), "--data", str(data),
                                      "--num-sequences", "1", "--sequence-length", "32", "--lengths", "32"],
}


@pytest.mark.parametrize("command", sorted(READERS))
def test_every_reader_refuses_a_checkpoint_with_flipped_bytes_naming_the_file(command, trained, data, tmp_path,
                                                                                capsys):
    from nemo_anchor.cli import main

    run = _copy_run(trained, tmp_path)
    latest = run.list_checkpoints()[-1]
    shard = _largest_shard(latest)
    _flip_bytes(shard)
    capsys.readouterr()
    assert main(READERS[command](latest, tmp_path / "out", data)) != 0
    err = capsys.readouterr().err
    assert f"{shard} is corrupt" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_run_folder_is_read_from_its_newest_intact_checkpoint_naming_both(trained, tmp_path, capsys):
    from nemo_anchor.cli import main

    run = _copy_run(trained, tmp_path)
    previous, latest = run.list_checkpoints()
    shard = _largest_shard(latest)
    _flip_bytes(shard)
    capsys.readouterr()
    assert main(["export-hf", str(run.root), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert f"warning: {shard} is corrupt" in out and f"reading {previous}, the newest intact checkpoint" in out
    from nemo_anchor.convert.sources import read_checkpoint

    exported = read_checkpoint(tmp_path / "hf").state  # the weights of the intact checkpoint, not the damaged one
    expected = read_checkpoint(previous).state
    assert all(torch.equal(exported[name], expected[name]) for name in expected)


def test_no_verify_reads_a_damaged_checkpoint_on_explicit_request(trained, tmp_path, capsys):
    from nemo_anchor.cli import main

    run = _copy_run(trained, tmp_path)
    latest = run.list_checkpoints()[-1]
    _flip_bytes(_largest_shard(latest))
    assert main(["export-hf", "--no-verify", str(latest), str(tmp_path / "hf")]) == 0


def test_init_from_hf_refuses_a_checkpoint_with_flipped_bytes_naming_the_file(trained, data, tmp_path, capsys):
    run = _copy_run(trained, tmp_path)
    latest = run.list_checkpoints()[-1]
    shard = _largest_shard(latest)
    _flip_bytes(shard)
    capsys.readouterr()
    assert train_tiny(tmp_path / "new", data, f"model.init_from_hf={latest}") == 2
    err = capsys.readouterr().err
    assert f"{shard} is corrupt" in err
    assert not (tmp_path / "new").exists()  # nothing written for a run that could not start


def test_a_resume_with_every_checkpoint_damaged_is_refused_and_changes_nothing(trained, data, tmp_path, capsys):
    run = _copy_run(trained, tmp_path)
    shards = [_largest_shard(ckpt) for ckpt in run.list_checkpoints()]
    for shard in shards:
        _flip_bytes(shard)
    before = _snapshot(run.root)
    capsys.readouterr()
    assert train_tiny(run.root, data, "trainer.max_steps=6") == 2
    captured = capsys.readouterr()
    assert "none of its checkpoints is intact" in captured.err and all(str(s) in captured.err for s in shards)
    assert "nothing was changed" in captured.err
    assert _snapshot(run.root) == before  # no checkpoint, metrics.jsonl or config rewritten, nothing deleted


def test_a_checkpoint_without_checksums_says_not_verified_once(trained, data, tmp_path, capsys):
    from nemo_anchor.cli import main

    run = _copy_run(trained, tmp_path)
    for ckpt in run.list_checkpoints():
        (ckpt / CHECKSUMS).unlink()
    latest = run.list_checkpoints()[-1]
    capsys.readouterr()
    assert main(["export-hf", str(run.root), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.count("not verified") == 1
    assert train_tiny(run.root, data, "trainer.max_steps=5") == 0
    out = capsys.readouterr().out
    assert out.count("not verified") == 1 and f"{latest} has no {CHECKSUMS}: not verified" in out
