"""Megatron-Bridge's front door holds the run's lease as `nemo-anchor train` does (.venv-bridge), as a user meets it:

- a run whose lease another run took over stops before its next save, leaving the folder and the lease to
  the other run;
- ``run_guard.json`` describes the checkpoint a resume loads: a resume with an allowed change that dies
  before its first save leaves the record of the checkpoint it started from.

Each run is a process of its own, forked from one that imported Megatron-Bridge once (tests/preloaded.py).
"""
import importlib.util
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

from nemo_anchor.run_dir import LOCK_FILE  # noqa: E402
from tiny_runs import pack_texts  # noqa: E402  tests/tiny_runs.py

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4] * 8


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """A `nemo-anchor train` YAML of a tiny model (random weights) on packed byte windows of 64 tokens."""
    root = tmp_path_factory.mktemp("bridge_lease")
    packed = pack_texts(root, TEXTS, name="packed")
    path = root / "run.yaml"
    path.write_text(json.dumps({
        "output_dir": str(root / "unused"),
        "model": {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": 64},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": 20000, "global_batch_size": 1, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False, "eval_batches": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "clip_grad": 1.0},
    }))
    return path


def _start(server, config, save, *args):
    """``python -m nemo_anchor.bridge.pretrain`` started in its own process group, its stderr in its stdout."""
    return server.start(["--config", str(config), f"checkpoint.save={save}", f"checkpoint.load={save}",
                         "--peak-tflops", "1", *args], merge_output=True)


def _wait_for_step(run, save: Path, step: int) -> None:
    """Until ``metrics.jsonl`` shows ``step`` (the run is training), or the run ended."""
    metrics = save / "metrics.jsonl"
    while run.poll() is None:
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        if any(json.loads(row).get("step", 0) >= step for row in rows if '"loss"' in row):
            return
        time.sleep(0.2)
    pytest.fail(f"the run ended before step {step}: {run.communicate()[0][-3000:]}")


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_save(pretrain_cli, config, tmp_path):
    save = tmp_path / "run"
    run = _start(pretrain_cli, config, save)  # 20000 steps of a few ms, saved at the end: still training when taken over
    try:
        _wait_for_step(run, save, 1)
        intruder = json.dumps({"host": socket.gethostname(), "pid": 1, "pid_started": 1.0, "token": "another run"})
        (save / LOCK_FILE).write_text(intruder)  # another run took the lease over (it looked expired)
        out = run.communicate(timeout=600)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0, out[-3000:]
    assert "another run took this run's lease over; this run stops at step" in out, out[-3000:]
    assert (save / LOCK_FILE).read_text() == intruder  # the lease is the other run's, never written again
    assert not list(save.glob("iter_*")), sorted(p.name for p in save.iterdir())  # nothing saved after the takeover


def test_run_guard_json_describes_the_checkpoint_a_resume_loads(pretrain_cli, config, tmp_path):
    save = tmp_path / "run"
    first = _start(pretrain_cli, config, save, "train.train_iters=2")
    out = first.communicate(timeout=600)[0]
    assert first.returncode == 0, out[-3000:]
    record = json.loads((save / "run_guard.json").read_text())
    assert record["config"]["optim"]["clip_grad"] == 1.0
    # a resume with an allowed change, killed (a node failure) after a step and before its first save
    resumed = _start(pretrain_cli, config, save, "train.train_iters=20000", "optimizer.clip_grad=0.5",
                     "--allow-change", "optim.clip_grad")
    try:
        _wait_for_step(resumed, save, 3)
    finally:
        os.killpg(resumed.pid, signal.SIGKILL)
        resumed.communicate(timeout=60)
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002"]
    after = json.loads((save / "run_guard.json").read_text())
    assert after["config"]["optim"]["clip_grad"] == 1.0 and after == record  # it still describes iter_0000002
    assert record["step"] == 2


@pytest.mark.parametrize("variables, holds", [({"SLURM_PROCID": "1"}, False), ({"SLURM_PROCID": "0"}, True),
                                              ({"RANK": "0", "SLURM_PROCID": "3"}, True)],
                         ids=["srun-task-1", "srun-task-0", "torchrun-under-srun"])
def test_under_srun_without_torchrun_only_task_0_takes_the_lease(tmp_path, monkeypatch, variables, holds):
    """``srun python -m nemo_anchor.bridge.pretrain``: no RANK, every task has its SLURM_PROCID; only the global
    rank 0 may take (and later release) the lease, or every task would race for it."""
    from types import SimpleNamespace

    from nemo_anchor.bridge import run_guard

    monkeypatch.delenv("RANK", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    save = tmp_path / "run"
    with run_guard.claimed(SimpleNamespace(checkpoint=SimpleNamespace(save=str(save)))) as guard:
        assert (save / LOCK_FILE).is_file() == holds and (guard.claim is not None) == holds
    assert not (save / LOCK_FILE).exists()


def _bridge_folder(save: Path, steps: list[int]) -> None:
    """Bridge's checkpoints as its save leaves them: ``iter_N`` and the tracker naming the newest."""
    for step in steps:
        (save / f"iter_{step:07d}").mkdir(parents=True)
        (save / f"iter_{step:07d}" / "common.pt").write_bytes(b"shards")
    (save / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))


def _folder(save: Path) -> dict:
    return {str(p.relative_to(save)): p.read_bytes() if p.is_file() else None for p in sorted(save.rglob("*"))}


INTRUDER = json.dumps({"host": "another-host", "pid": 1, "token": "another run", "started": "now"})


def test_a_save_after_the_lease_was_taken_over_writes_nothing(tmp_path, monkeypatch, capsys):
    """The lease is taken over between the step's check and Bridge's save: the manager reads the lease file before
    the save starts, writes no iter_N and no tracker, says so and stops the run (the final save too). ~1 CPU s."""
    from types import SimpleNamespace

    from nemo_anchor.bridge import run_guard  # first: it makes Bridge importable here
    from nemo_anchor.bridge.preemption import AnchorCheckpointManager
    from nemo_anchor.run_lease import RunDirInUse
    from megatron.bridge.training.config import CheckpointConfig

    monkeypatch.setenv("RANK", "0")
    save = tmp_path / "run"
    _bridge_folder(save, [1, 2])
    config = CheckpointConfig(save=str(save), most_recent_k=1)
    with run_guard.claimed(SimpleNamespace(checkpoint=config)):
        manager = AnchorCheckpointManager(config)
        before = _folder(save)
        (save / LOCK_FILE).write_text(INTRUDER)
        ctx = SimpleNamespace(state=SimpleNamespace(train_state=SimpleNamespace(step=3)), non_persistent_ckpt=False)
        with pytest.raises(RunDirInUse, match="another run took this run's lease over; this run stops at step 3"):
            manager.save(ctx, None)
        assert _folder(save) == {**before, LOCK_FILE: INTRUDER.encode()}
    assert (save / LOCK_FILE).read_text() == INTRUDER
    assert f"output_dir {save}: this run does not save iter_0000003: it does not hold its lease" in \
        capsys.readouterr().err


def test_an_eviction_after_the_lease_was_taken_over_removes_nothing(tmp_path, monkeypatch, capsys):
    """The lease is taken over while Bridge saves (a run paused past its lease timeout): the eviction beyond
    ``most_recent_k`` reads the lease file first and removes none of the other run's checkpoints. Bridge's save is
    stood in for by what it leaves (iter_N, the tracker) and its own eviction call (checkpointing.py:1620). ~1 CPU s."""
    from types import SimpleNamespace

    from nemo_anchor.bridge import run_guard  # first: it makes Bridge importable here
    from nemo_anchor.bridge.preemption import AnchorCheckpointManager
    from megatron.bridge.training import checkpointing
    from megatron.bridge.training.config import CheckpointConfig

    monkeypatch.setenv("RANK", "0")
    save = tmp_path / "run"
    _bridge_folder(save, [1, 2])

    def bridge_save_then_taken_over(self, ctx, callback_manager):
        _bridge_folder(save, [ctx.state.train_state.step])
        (save / LOCK_FILE).write_text(INTRUDER)
        if self.checkpoint_config.most_recent_k > -1:  # Bridge evicts inside its save
            checkpointing.cleanup_old_non_persistent_checkpoint(
                str(save), leave_ckpt_num=self.checkpoint_config.most_recent_k, do_async=False)

    monkeypatch.setattr(checkpointing.DefaultCheckpointManager, "save", bridge_save_then_taken_over)
    config = CheckpointConfig(save=str(save), most_recent_k=1)
    with run_guard.claimed(SimpleNamespace(checkpoint=config)):
        ctx = SimpleNamespace(state=SimpleNamespace(train_state=SimpleNamespace(step=3)), non_persistent_ckpt=False)
        AnchorCheckpointManager(config).save(ctx, None)
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert config.most_recent_k == 1
    assert f"output_dir {save}: this run does not remove checkpoints older than the newest 1: it does not hold its " \
           f"lease" in capsys.readouterr().err
