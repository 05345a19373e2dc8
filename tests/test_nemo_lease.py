"""NeMo's ``llm.pretrain`` holds the run's lease as `nemo-anchor train` does, as a NeMo user meets it: a run whose
lease another run took over (it looked expired to that run) stops before its next save, leaving the log directory
and the lease to the other run. Skipped without NeMo."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")

from nemo_anchor.run_dir import LOCK_FILE  # noqa: E402
from tiny_runs import pack_texts  # noqa: E402  (tests/tiny_runs.py)

REPO = Path(__file__).resolve().parents[1]
NEMO = Path(sys.executable).with_name("nemo")


def test_a_nemo_run_whose_lease_was_taken_over_stops_before_its_next_save(tmp_path):
    data = pack_texts(tmp_path)  # byte windows of 64 tokens
    log_dir = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    run = subprocess.Popen(
        [str(NEMO), "llm", "pretrain", "--factory", "nemo_anchor.nemo.recipes.anchor_smollm2_135m",
         f"data.path={data}", "data.seq_length=64", "model.config.seq_length=64", "model.config.num_layers=1",
         "trainer.devices=1", "trainer.strategy.context_parallel_size=1", "trainer.strategy.tensor_model_parallel_size=1",
         "data.global_batch_size=1", "data.micro_batch_size=1", "trainer.max_steps=5000", f"log.log_dir={log_dir}", "-y"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    folder = log_dir / "anchor_smollm2_135m"
    try:
        while run.poll() is None and not ((folder / "metrics.jsonl").is_file() and
                                          '"loss"' in (folder / "metrics.jsonl").read_text()):
            time.sleep(0.2)  # until the run trains
        assert run.poll() is None, run.communicate()[0][-3000:]
        intruder = json.dumps({"host": socket.gethostname(), "pid": 1, "pid_started": 1.0, "token": "another run"})
        (folder / LOCK_FILE).write_text(intruder)
        out = run.communicate(timeout=600)[0]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0, out[-3000:]
    assert "another run took this run's lease over; this run stops at step" in out, out[-3000:]
    assert (folder / LOCK_FILE).read_text() == intruder  # the lease is the other run's, never written again
    saved = list((folder / "checkpoints").glob("*")) if (folder / "checkpoints").is_dir() else []
    assert not saved, saved  # nothing saved after the takeover


@pytest.fixture
def guarded_strategy(tmp_path):
    """Our NeMo strategy in a run whose AnchorRunGuard holds the lease of ``tmp_path/log``, as its setup leaves it
    on the lease holder; the Trainer stands in as the two attributes the strategy reads of it."""
    from types import SimpleNamespace

    import lightning.pytorch as pl

    from nemo_anchor.nemo.run_guard import AnchorRunGuard
    from nemo_anchor.nemo.strategy import AnchorMegatronStrategy
    from nemo_anchor.run_dir import RunDir
    from nemo_anchor.run_lease import RunClaim, RunGuard

    folder = tmp_path / "log"
    claim = RunClaim(RunDir(folder))
    callback = AnchorRunGuard()
    callback._guard = RunGuard(claim, folder)
    strategy = AnchorMegatronStrategy()
    strategy.trainer = SimpleNamespace(callbacks=[callback], global_step=3)
    strategy._lightning_module = pl.LightningModule()
    yield strategy, folder
    claim.release(failed=False)


def _taken_over(folder) -> str:
    intruder = json.dumps({"host": socket.gethostname(), "pid": 1, "pid_started": 1.0, "token": "another run"})
    (folder / LOCK_FILE).write_text(intruder)
    return intruder


def test_a_top_k_removal_after_the_lease_was_taken_over_removes_nothing(guarded_strategy, capsys):
    strategy, folder = guarded_strategy
    older, oldest = (folder / "checkpoints" / f"step={step}" for step in (2, 1))
    for checkpoint in (older, oldest):
        checkpoint.mkdir(parents=True)
        (checkpoint / "common.pt").write_bytes(b"weights")
    strategy.remove_checkpoint(oldest)  # while the run holds its lease: NeMo's removal
    assert not oldest.exists()
    intruder = _taken_over(folder)
    strategy.remove_checkpoint(older)
    assert (older / "common.pt").read_bytes() == b"weights"  # the other run's folder now: left as it is
    assert f"output_dir {folder}: this run does not remove step=2: it does not hold its lease" in capsys.readouterr().err
    assert (folder / LOCK_FILE).read_text() == intruder


def test_a_save_after_the_lease_was_taken_over_writes_nothing_and_stops_the_run(guarded_strategy, capsys):
    from nemo_anchor.run_lease import RunDirInUse

    strategy, folder = guarded_strategy
    intruder = _taken_over(folder)
    with pytest.raises(RunDirInUse, match="another run took this run's lease over; this run stops at step 3"):
        strategy.save_checkpoint({"state_dict": {}}, folder / "checkpoints" / "step=3-last")
    assert not (folder / "checkpoints").exists()
    assert f"this run does not save step=3-last: it does not hold its lease" in capsys.readouterr().err
    assert (folder / LOCK_FILE).read_text() == intruder
