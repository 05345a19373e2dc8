"""Saving off the training loop's critical path (nemo_anchor.training.checkpoint_saver.CheckpointSaver).

The asynchronous save is Megatron's own (dist_checkpointing's async_sharded_save on an AsyncCallsQueue, its
writer a forked process); it needs CUDA only to synchronize the device and to all-reduce the finished call's
index, so here those two calls are stood in for on the CPU and everything else runs as on a GPU machine."""
import json
import threading

import pytest
import torch

from nemo_anchor import checksums
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import checkpoint_saver
from nemo_anchor.training.config import load_config
from nemo_anchor.training.loop import Trainer
from tiny_runs import pack_texts, tiny_config, train_tiny  # tests/tiny_runs.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return pack_texts(tmp_path_factory.mktemp("saver"))


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """Megatron's async writer on the CPU: no device to synchronize, and its all-reduce on the CPU (gloo).
    Where CUDA is present nothing is stood in: the tests run the real asynchronous save."""
    if torch.cuda.is_available():
        return
    monkeypatch.setattr(checkpoint_saver, "async_save_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def _weights(run_root):
    from nemo_anchor.convert.sources import read_checkpoint

    return {step: read_checkpoint(path).state for step, path in
            ((checkpoint_step(p), p) for p in RunDir(run_root).list_checkpoints())}


def test_the_async_save_writes_the_checkpoints_the_synchronous_save_writes_and_resumes(data, tmp_path,
                                                                                      cuda_stand_in, capsys):
    assert train_tiny(tmp_path / "sync", data, "checkpoint.async_save=false") == 0
    assert train_tiny(tmp_path / "async", data, "checkpoint.async_save=true") == 0
    sync, asynchronous = _weights(tmp_path / "sync"), _weights(tmp_path / "async")
    assert sorted(sync) == sorted(asynchronous) == [2, 4]
    for step in sync:
        assert all(torch.equal(sync[step][name], asynchronous[step][name]) for name in sync[step])
    for path in RunDir(tmp_path / "async").list_checkpoints():
        checksums.verify_files(path)  # digested as written, read back in the background, every file covered
        assert json.loads((path / checksums.CHECKSUMS).read_text())[checksums.RECORDED] == checksums.AS_WRITTEN
    assert RunDir(tmp_path / "async").latest_file.read_text() == "4"
    capsys.readouterr()
    assert train_tiny(tmp_path / "async", data, "checkpoint.async_save=true", max_steps=6) == 0
    assert f"resumed from {RunDir(tmp_path / 'async').checkpoint(4)} at step 4" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the asynchronous save is available")
def test_async_save_asked_for_without_cuda_is_refused_in_one_line(data, tmp_path, capsys):
    assert train_tiny(tmp_path / "run", data, "checkpoint.async_save=true") == 2
    assert "checkpoint.async_save=true needs CUDA" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_checkpoint_is_named_latest_only_once_it_is_read_back(asynchronous, data, tmp_path,
                                                                            monkeypatch, request):
    if asynchronous:
        request.getfixturevalue("cuda_stand_in")
    release = threading.Event()
    digest = checksums.file_digest

    def held_digest(path):  # the background read-back waits until the test lets it go on
        assert release.wait(60)
        return digest(path)

    monkeypatch.setattr(checksums, "file_digest", held_digest)
    config = load_config(tiny_config(tmp_path / "run", data),
                         [f"checkpoint.async_save={str(asynchronous).lower()}"])
    trainer = Trainer(config)
    run = trainer.run
    try:
        trainer.train_step()
        final = trainer.save()
        trainer.train_step()  # the loop goes on while the files are read back
        trainer.saver.poll()
        assert not final.exists() and not run.latest_file.exists()  # not announced before it is read back
        release.set()
        assert trainer.saver.finish() == final
        assert final.is_dir() and run.latest_file.read_text() == "1"
        checksums.verify_files(final)
        times = trainer.saver.times[-1]
        assert times.step == 1 and 0 < times.written <= times.published and times.blocked > 0
    finally:
        release.set()
        trainer.saver.close()
        trainer._release(failed=False)
