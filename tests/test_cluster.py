"""Slurm's time-limit signal to the trainer: SIGUSR1 (``--signal=USR1@120``) in the middle of a run saves the last
step completed, after the scheduled saves, and exits 75; the same command resumes it, and every loss equals an
uninterrupted run's.

The other ways a cluster stops a run are tested where they run for real: the trainer under
``scripts/slurm/train.sbatch`` on a real two-node Slurm cluster (tests/test_slurm_cluster.py: the time-limit signal
through the batch script, srun and each node's torchrun, a preemption's SIGTERM to every process of the job,
``scancel``, a killed node, a resume on two nodes), and, without Slurm, a group SIGTERM to one process and SIGTERM
to torchrun, which forwards it to two ranks that must leave the step together (tests/test_stop_save.py). All
three signals go through the same handler (``nemo_anchor.training.preemption.STOP_SIGNALS``); this test is the
one that sends SIGUSR1 where Slurm cannot run.
"""
import json
import os
import signal

import pytest

from nemo_anchor.cli import main
from nemo_anchor.run_dir import LOCK_FILE, RunDir, checkpoint_step
from tiny_runs import pack_texts, tiny_config  # tests/tiny_runs.py

EXIT_PREEMPTED = 75
MICROBATCHES = 4  # per step: global batch 4, micro-batch 1, one process
SIGNAL_IN = 4  # the signal comes between the first and the second micro-batch of this step (saves: every 2)
MORE = 2  # the resumed run takes this many steps beyond the one the signal saved


def _losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def test_sigusr1_saves_the_step_reached_after_earlier_saves_and_the_same_command_resumes(tmp_path, capsys,
                                                                                          monkeypatch):
    from nemo_anchor.training import engine

    data = pack_texts(tmp_path)
    run = tmp_path / "run"
    config = tiny_config(run, data, max_steps=10_000, global_batch_size=MICROBATCHES)
    forward, drawn = engine.megatron_forward_step, [0]

    def signalled_forward_step(data_iterator, model):  # what Slurm's --signal=USR1@120 does, mid-step
        drawn[0] += 1
        if drawn[0] == (SIGNAL_IN - 1) * MICROBATCHES + 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return forward(data_iterator, model)

    monkeypatch.setattr(engine, "megatron_forward_step", signalled_forward_step)
    assert main(["train", "--config", str(config)]) == EXIT_PREEMPTED
    out = capsys.readouterr().out
    reached = SIGNAL_IN - 1  # the step the signal interrupted is neither logged nor saved
    saved = [checkpoint_step(path) for path in RunDir(run).list_checkpoints()]
    assert saved == [2, reached] and max(_losses(run)) == reached, (saved, out[-3000:])
    assert f"stop requested (SIGUSR1): saved {run / 'checkpoints' / f'iter_{reached:07d}'} at step {reached}" in out
    assert not (run / LOCK_FILE).exists()
    monkeypatch.undo()

    assert main(["train", "--config", str(config), f"trainer.max_steps={reached + MORE}"]) == 0
    assert f"resumed from {run / 'checkpoints' / f'iter_{reached:07d}'} at step {reached}" in capsys.readouterr().out
    reference = tmp_path / "reference"
    assert main(["train", "--config", str(tiny_config(reference, data, max_steps=reached + MORE,
                                                      global_batch_size=MICROBATCHES))]) == 0
    assert sorted(_losses(run)) == list(range(1, reached + MORE + 1))
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-5, abs=1e-6)
