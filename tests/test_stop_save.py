"""The stop save inside the grace period, and publishing off the critical path (issue 36, items 1 and 2).

- A group SIGTERM in the middle of a step (between two of its micro-batches), while the read-back of an
  earlier save never ends: the run exits 75 without waiting for it, saves the last completed step, reads
  nothing of the checkpoint back (its digests are those made as it was written), and the next start verifies
  them before it resumes; the resumed run continues with an uninterrupted run's losses.
- A stop's checkpoint whose files changed after the save is not trusted at the next start.
- Old checkpoints are renamed away at the publish and deleted in the background; leftover ``.tmp.*`` saves
  are removed at start and named; ``checksums.json``, the rename and ``latest`` are fsynced.
- A read-back that makes no progress is named, not waited for forever.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_anchor import checksums
from nemo_anchor.checksums import CheckpointError
from nemo_anchor.cli import main
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import checkpoint as ckpt
from nemo_anchor.training import checkpoint_saver
from nemo_anchor.training.config import load_config
from nemo_anchor.training.loop import Trainer
from test_checkpoint_saver import cuda_stand_in  # noqa: F401 - a fixture
from tiny_runs import child_environment, free_port, pack_texts, tiny_config  # tests/tiny_runs.py

EXIT_PREEMPTED = 75
MICROBATCHES = 4  # per step: global batch 4, micro-batch 1, one process
STOP_IN = 5  # the signal comes between the first and the second micro-batch of this step
HELD = 3  # the read-back of this scheduled save (save_every=3) never ends

# `nemo-anchor train` with three observers a test cannot get from outside: when the signal arrived, which files
# were read for a checksum after it, and a pause inside step STOP_IN until the signal is there (so that it
# arrives mid-step on a busy machine); the read-back of checkpoint HELD is held for good
_OBSERVED = f'''
import os, sys, threading, time
from pathlib import Path

# dist_checkpointing's spawn-context Manager re-imports this module: the trainer is imported only here
if __name__ == "__main__":
    from nemo_anchor import checksums
    from nemo_anchor.training import engine, preemption
    from nemo_anchor.training.cli import main

    events = Path(os.environ["EVENTS"])
    signalled = threading.Event()
    handle = preemption.StopRequest._handle

    def noted(self, signum, frame):
        handle(self, signum, frame)
        signalled.set()

    preemption.StopRequest._handle = noted
    digest = checksums.file_digest

    def observed_digest(path):
        if signalled.is_set():
            with open(events / "read_after_signal", "a") as log:
                log.write(str(path) + "\\n")
        if "iter_{HELD:07d}" in str(path):
            threading.Event().wait()
        return digest(path)

    checksums.file_digest = observed_digest
    forward, drawn = engine.megatron_forward_step, [0]

    def paused_forward_step(data_iterator, model):
        drawn[0] += 1
        if drawn[0] == {(STOP_IN - 1) * MICROBATCHES + 2}:
            (events / "in_step_{STOP_IN}").write_text("")
            deadline = time.time() + 120
            while not signalled.is_set() and time.time() < deadline:
                time.sleep(0.05)
        return forward(data_iterator, model)

    engine.megatron_forward_step = paused_forward_step
    status = main()
    (events / ("exit_rank" + os.environ.get("RANK", "0"))).write_text(str(status))
    sys.exit(status)
'''


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return pack_texts(tmp_path_factory.mktemp("stop_save"))


def _losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _config(tmp_path, data, name: str, max_steps: int, processes: int = 1):
    return tiny_config(tmp_path / name, data, max_steps=max_steps, global_batch_size=MICROBATCHES * processes)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("processes", [1, 2], ids=["setsid", "torchrun"])
def test_group_sigterm_mid_step_saves_the_last_completed_step_without_reading_anything_back(processes, data, tmp_path,
                                                                                           capsys):
    """One process in its own session, SIGTERM to its group; or torchrun with two data-parallel ranks, SIGTERM to
    torchrun, which forwards it to each worker's group (the ranks must leave the step at the same micro-batch)."""
    run, events = tmp_path / "run", tmp_path / "events"
    events.mkdir()
    config = _config(tmp_path, data, "run", max_steps=1000, processes=processes)
    script = tmp_path / "observed_train.py"
    script.write_text(_OBSERVED)
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
        str(free_port())]
    process = subprocess.Popen([*launcher, str(script), "--config", str(config), "checkpoint.save_every=3"],
                               env=child_environment(EVENTS=str(events)), start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not (events / f"in_step_{STOP_IN}").exists():
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.time() < deadline, f"the run did not reach step {STOP_IN}"
            time.sleep(0.1)
        if processes == 1:
            os.killpg(process.pid, signal.SIGTERM)  # the whole group, as Slurm and Kubernetes deliver it
        else:
            process.send_signal(signal.SIGTERM)  # torchrun forwards it to each worker's process group
        output = process.communicate(timeout=180)[0]  # an older main waited here for the held read-back
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    statuses = {path.name: int(path.read_text()) for path in events.glob("exit_rank*")}
    assert statuses == {f"exit_rank{rank}": EXIT_PREEMPTED for rank in range(processes)}, output[-3000:]
    completed = STOP_IN - 1
    checkpoints = RunDir(run).list_checkpoints()
    assert [checkpoint_step(path) for path in checkpoints] == [HELD, completed], output[-3000:]
    assert RunDir(run).latest_file.read_text() == str(completed)
    assert max(_losses(run)) == completed  # the step the signal interrupted is neither logged nor saved
    # written once, read back never: no file was read back after the signal (the kilobytes of metadata the main
    # process writes are digested right after, from the page cache, not by the read-back), and both checkpoints (the
    # stop's and the scheduled one whose read-back was abandoned) are published with the digests made as written
    assert not (events / "read_after_signal").exists(), (events / "read_after_signal").read_text()
    for path in checkpoints:
        assert json.loads((path / checksums.CHECKSUMS).read_text())[checksums.RECORDED] == checksums.AS_WRITTEN
        assert not (path / ckpt.PENDING).exists()
    assert f"stop requested (SIGTERM): saved {run / 'checkpoints' / f'iter_{completed:07d}'} at step {completed}" \
        in output
    assert "BrokenPipeError" not in output  # the group signal reached Megatron's writer processes too: they survive it

    # the same command resumes, verifying them, and continues as if never interrupted
    capsys.readouterr()
    assert main(["train", "--config", str(config), "checkpoint.save_every=3", f"trainer.max_steps={STOP_IN + 1}"]) == 0
    resumed = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / f'iter_{completed:07d}'} at step {completed}" in resumed
    for path in RunDir(run).list_checkpoints():
        assert not (path / ckpt.PENDING).exists()
        checksums.verify_files(path)
    reference = tmp_path / "reference"
    assert main(["train", "--config", str(_config(tmp_path, data, "reference", max_steps=STOP_IN + 1,
                                                  processes=processes))]) == 0
    assert sorted(_losses(run)) == list(range(1, STOP_IN + 2))
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-5, abs=1e-6)


def _trainer(tmp_path, data, *overrides) -> Trainer:
    return Trainer(load_config(_config(tmp_path, data, "run", max_steps=10), list(overrides)))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_stop_checkpoint_whose_files_changed_is_not_trusted_at_the_next_start(asynchronous, data, tmp_path, capsys,
                                                                               request):
    if asynchronous:  # Megatron's asynchronous writer, as on GPUs (tests/test_checkpoint_saver.py)
        request.getfixturevalue("cuda_stand_in")
    trainer = _trainer(tmp_path, data, f"checkpoint.async_save={str(asynchronous).lower()}")
    try:
        for _ in range(2):
            trainer.train_step()
            trainer.save(read_back=False)
    finally:
        trainer.saver.close(wait_for_deletions=False)
        trainer._release(failed=False)
    first, second = RunDir(tmp_path / "run").list_checkpoints()
    assert json.loads((second / checksums.CHECKSUMS).read_text())[checksums.RECORDED] == checksums.AS_WRITTEN
    shard = max((p for p in second.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as handle:  # lost at a crash of the machine, or cut short by a quota
        handle.truncate(shard.stat().st_size - 8)
    capsys.readouterr()
    trainer = _trainer(tmp_path, data)
    try:
        assert trainer.resumed_from == first and trainer.step == 1
        out = capsys.readouterr().out
        assert f"cannot resume from {second.name}: {shard} has" in out and "recorded" in out
    finally:
        trainer.saver.close()
        trainer._release(failed=False)


def test_publishing_renames_old_checkpoints_away_and_deletes_them_in_the_background(data, tmp_path, monkeypatch,
                                                                                    capsys):
    run = RunDir(tmp_path / "run")
    leftover = run.checkpoints / ".tmp.iter_0000007"  # what a save killed by SIGKILL or a node failure leaves
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"\0" * 1024)
    release, deleting_on = threading.Event(), []
    rmtree = shutil.rmtree

    def held_rmtree(path, *args, **kwargs):  # deleting a checkpoint takes long (~100 GB on a parallel file system)
        if run.checkpoints in Path(path).parents:
            deleting_on.append((threading.current_thread() is threading.main_thread(), str(path)))
            release.wait(30)
        return rmtree(path, *args, **kwargs)

    synced = []
    fsync = os.fsync

    def recorded_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fsync(fd)

    monkeypatch.setattr(shutil, "rmtree", held_rmtree)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    trainer = _trainer(tmp_path, data, "checkpoint.keep_last=1", "checkpoint.save_every=1")
    try:
        assert f"removing {leftover}, left by a save or a deletion that did not finish" in capsys.readouterr().out
        assert not leftover.exists()
        for _ in range(2):
            trainer.train_step()
            trainer.save()
            trainer.saver.finish()
        assert [p.name for p in run.list_checkpoints()] == ["iter_0000002"]  # iter_1 is gone from the run at once
        assert any(p.name.startswith(".deleting.iter_0000001.") for p in run.checkpoints.iterdir())
        assert deleting_on and not any(on_main for on_main, _ in deleting_on), deleting_on
        # flushed to the disk: the manifest (staged beside it), the rename into checkpoints/, latest (staged there)
        checkpoints = os.path.realpath(run.checkpoints)
        assert any(s.startswith(f"{checkpoints}/.tmp.iter_0000002/.{checksums.CHECKSUMS}.") for s in synced), synced
        assert checkpoints in synced, synced
        assert any(s.startswith(f"{checkpoints}/.{run.latest_file.name}.") for s in synced), synced
        release.set()
        trainer.saver.close()  # waits for the deletions (a stop would not)
        assert sorted(p.name for p in run.checkpoints.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    finally:
        release.set()
        trainer.saver.close()
        trainer._release(failed=False)


def test_a_stuck_read_back_is_named_not_waited_for_forever(data, tmp_path, monkeypatch):
    release = threading.Event()
    digest = checksums.file_digest

    def hung_digest(path):  # a read on a hung NFS server (that comes back after a while)
        if not release.wait(20):
            release.set()
        return digest(path)

    monkeypatch.setattr(checksums, "file_digest", hung_digest)
    monkeypatch.setattr(checkpoint_saver, "WAIT_S", 1.0)
    trainer = _trainer(tmp_path, data)
    try:
        trainer.train_step()
        final = trainer.save()
        with pytest.raises(CheckpointError, match=rf"read-back of .*\.tmp\.{final.name} has been reading .*"
                                                  rf"{final.name}/.* for more than 1 s"):
            trainer.saver.finish()
        assert not final.exists()
    finally:
        release.set()
        trainer.saver.close()
        trainer._release(failed=False)


def test_a_stop_at_a_checkpoint_whose_checksums_are_recorded_does_not_call_them_pending(data, tmp_path, monkeypatch,
                                                                                       capsys):
    """A stop in the first step after a resume: the step reached is the resumed checkpoint's, whose checksums the
    run recorded when it saved it; the stop saves nothing new and says they are recorded, not pending."""
    from nemo_anchor.training import engine

    config = _config(tmp_path, data, "run", max_steps=2)
    assert main(["train", "--config", str(config)]) == 0
    forward, drawn = engine.megatron_forward_step, [0]

    def signalled_forward_step(data_iterator, model):  # SIGTERM between the step's micro-batches
        drawn[0] += 1
        if drawn[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(data_iterator, model)

    monkeypatch.setattr(engine, "megatron_forward_step", signalled_forward_step)
    capsys.readouterr()
    assert main(["train", "--config", str(config), "trainer.max_steps=4"]) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    saved = tmp_path / "run" / "checkpoints" / "iter_0000002"
    assert (saved / checksums.CHECKSUMS).is_file() and not (saved / ckpt.PENDING).exists()
    assert f"stop requested (SIGTERM): saved {saved} at step 2 in " in out, out[-3000:]
    assert "(its checksums are recorded already); run the same command again to resume" in out, out[-3000:]


def test_the_checkpoint_writers_manager_ends_with_a_sigkilled_worker():
    """A launcher SIGKILLs a worker (torchrun's shutdown, ft_launcher's rank monitor before an in-job restart): the
    Manager it forked for Megatron's checkpoint writer at setup, which ignores the stop signals for good, ends too
    instead of staying behind with a copy of the worker's memory (one more at every restart)."""
    script = ("import multiprocessing, os\n"
              "from nemo_anchor.training.preemption import start_checkpoint_writer_queue\n"
              "start_checkpoint_writer_queue()\n"
              "print(' '.join(str(child.pid) for child in multiprocessing.active_children()), flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    worker = subprocess.run([sys.executable, "-c", script], env=child_environment(), capture_output=True, text=True,
                            timeout=300)
    assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
    managers = [int(pid) for pid in worker.stdout.split()]
    assert len(managers) == 1, worker.stdout
    deadline = time.time() + 60
    while Path(f"/proc/{managers[0]}").exists() and time.time() < deadline:
        time.sleep(0.1)
    left = Path(f"/proc/{managers[0]}").exists()
    if left:
        os.kill(managers[0], signal.SIGKILL)
    assert not left, "the writer's Manager outlived its SIGKILLed worker"
