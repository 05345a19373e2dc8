"""NeMo's ``llm.pretrain`` on a real Slurm cluster, submitted as docs/cluster.md shows: NeMo-Run's ``SlurmExecutor``.

The cluster is ``scripts/slurm/local_cluster.sh``'s (the ``slurm_cluster`` fixture, shared with
tests/test_slurm_cluster.py). The job is the docs' example adapted to the CPU: our ``anchor_smollm2_135m`` recipe
(``attention_type: anchor``) shrunk to a 1-layer model on 64-token byte windows, 2 nodes with one CPU worker each
(one srun task a node, Lightning's ranks from Slurm), ``signal="USR1@120"``, ``retries`` and ``requeue``, submitted
with ``run.Experiment`` through NeMo-Run's ``LocalTunnel``. One job covers:

- the time-limit signal (``scancel --signal=USR1``: what ``--signal=USR1@120`` sends, to the tasks) -> every rank
  saves the step reached, exits 75, NeMo-Run's batch script requeues the job (its ``retries``), which resumes from
  that checkpoint; the stop ends with one line naming the signal, the checkpoint and the requeue, no traceback;
- then one node is killed (not the batch host): Slurm requeues the job onto the spare node, and the run resumes from
  its newest intact checkpoint and ends COMPLETED;
- every step is logged once and every loss equals an uninterrupted one-process run of the same recipe (which the
  submitting script runs while the job waits and trains).

Each step is paced to 0.5 s (tests/paced_steps.py, sleeping) so that the signal and the node failure land mid-run.
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_jobs import (SPARE, cancel_and_wait, job_fields, job_nodes, kill_node, requeued,  # tests/slurm_jobs.py
                        revive_down_nodes, wait_until)
from tiny_runs import REPO, child_environment, pack_texts  # tests/tiny_runs.py

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nemo") is None, reason="NeMo is not installed")

STEPS = 24  # the run's trainer.max_steps: the events below come by step ~12, each step lasting 0.5 s at least
NAME = "anchor_smollm2_135m"  # the recipe's log name

# The docs' example (docs/cluster.md, "NeMo's llm.pretrain with NeMo-Run's SlurmExecutor") adapted to the CPU and
# this cluster; then, while the job waits and trains, the same recipe on one process without Slurm: the reference.
SUBMIT = """
import sys
import nemo_run as run
from nemo_anchor.nemo.recipes import anchor_smollm2_135m
from paced_steps import PacedSteps

data, log_dir, reference_dir, jobs_dir, max_steps = sys.argv[1:]
recipe = anchor_smollm2_135m(data_path=data, seq_length=64)
for key, value in dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, kv_channels=16, vocab_size=512).items():
    setattr(recipe.model.config, key, value)
recipe.data.global_batch_size, recipe.data.micro_batch_size = 2, 1
recipe.trainer.num_nodes, recipe.trainer.devices = 2, 1
recipe.trainer.max_steps = recipe.trainer.val_check_interval = int(max_steps)
recipe.log.log_dir = log_dir
recipe.log.ckpt.every_n_train_steps, recipe.log.ckpt.train_time_interval = 2, None
recipe.trainer.callbacks.append(run.Config(PacedSteps, seconds=0.5))

executor = run.SlurmExecutor(
    account="test", partition="test", nodes=2, ntasks_per_node=1, time="01:00:00",
    signal="USR1@120",                          # SIGUSR1 to every task 2 min before the limit
    retries=3,                                  # NeMo-Run's script requeues a job that exits non-zero this often
    additional_parameters={"requeue": True},    # a node failure or preemption: Slurm requeues it
    packager=run.Packager(),                    # the code is installed on the nodes (PYTHONPATH here)
    tunnel=run.LocalTunnel(job_dir=f"{jobs_dir}/experiments"),
)
with run.Experiment("anchor-smollm2-135m", executor=executor, base_dir=jobs_dir) as experiment:
    experiment.add(recipe, name="pretrain")
    experiment.run(detach=True)
    print("submitted", experiment.jobs[0].handle, flush=True)

recipe.trainer.num_nodes = 1
recipe.trainer.callbacks.pop()  # no pace
recipe.log.log_dir = reference_dir
recipe.log.ckpt.save_last, recipe.log.ckpt.save_top_k = False, 0
run.run(recipe, direct=True)
"""


def _metrics(log_dir: Path) -> dict[int, float]:
    """The losses of ``log_dir``'s metrics.jsonl, checking each step is logged once."""
    path = log_dir / NAME / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    steps = [row["step"] for row in rows if "loss" in row]
    assert len(steps) == len(set(steps)), steps
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _checkpoints(log_dir: Path) -> list[Path]:
    """NeMo's complete checkpoints in ``log_dir``, oldest first (a save in progress has an ``-unfinished`` marker)."""
    saved = [path for path in (log_dir / NAME / "checkpoints").glob("step=*") if path.is_dir()
             and not path.with_name(path.name + "-unfinished").exists()]
    return sorted(saved, key=_step)


def _step(checkpoint: Path) -> int:
    return int(re.match(r"step=(\d+)", checkpoint.name).group(1))


def _task_log(jobs_dir: Path, job: str, restart: int) -> str:
    """What the job's srun tasks printed in its run number ``restart`` (NeMo-Run's log-*_JOB_RESTART.out)."""
    found = list(jobs_dir.glob(f"experiments/*/*/pretrain/log-*_{job}_{restart}.out"))
    assert len(found) == 1, found
    return found[0].read_text()


@pytest.fixture
def jobs(slurm_cluster):
    """Jobs the test submits: cancelled (and waited for) if still queued or running at its end; then a node the test
    killed is started again."""
    submitted: list[str] = []
    yield submitted
    env = child_environment(SLURM_CONF=str(slurm_cluster / "slurm.conf"))
    cancel_and_wait(env, submitted)
    revive_down_nodes(slurm_cluster, env)


def test_nemo_run_slurm_executor_requeues_on_the_time_limit_and_a_killed_node_resumes_on_the_spare(
        slurm_cluster, jobs, tmp_path):
    # not a folder named nemo_run: NeMo-Run replaces "/nemo_run" in its script's paths without a container
    log_dir, reference_dir, jobs_dir = tmp_path / "log", tmp_path / "reference", tmp_path / "jobs"
    env = child_environment(SLURM_CONF=str(slurm_cluster / "slurm.conf"), NEMORUN_HOME=str(jobs_dir),
                            PYTHONPATH=f"{REPO}:{REPO / 'tests'}",
                            PATH=f"{Path(sys.executable).parent}:{child_environment()['PATH']}")
    submit_log = tmp_path / "submit.log"
    with submit_log.open("w") as out:
        submit = subprocess.Popen([sys.executable, "-c", SUBMIT, str(pack_texts(tmp_path)), str(log_dir),
                                   str(reference_dir), str(jobs_dir), str(STEPS)],
                                  env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def submitted():
            assert submit.poll() in (None, 0), submit_log.read_text()[-3000:]
            return re.search(r"submitted slurm_tunnel://nemo_run/(\d+)", submit_log.read_text())
        wait_until(submitted, "the job's submission")
        job = submitted().group(1)
        jobs.append(job)

        def reached(step: int) -> bool:
            assert job_fields(env, job)["JobState"] in ("PENDING", "RUNNING"), job_fields(env, job)
            return max(_metrics(log_dir), default=0) >= step

        # the time limit near: SIGUSR1 to every task; each rank saves the step reached and exits 75; requeued
        wait_until(lambda: reached(3), "step 3")
        subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=60)
        requeued(env, job, 1)
        first = _task_log(jobs_dir, job, 0)
        stops = [line for line in first.splitlines() if line.startswith("stop requested")]
        signalled_at = max(_metrics(log_dir))
        stop_checkpoint = _checkpoints(log_dir)[-1]
        assert len(stops) == 1 and stops[0].startswith(
            f"stop requested (SIGUSR1): saved {stop_checkpoint} at step {signalled_at} in "), stops
        assert stops[0].endswith(f"; NeMo-Run's batch script requeues job {job} (restart 1 of retries=3), which "
                                 f"resumes from it"), stops
        assert "Traceback" not in first, first[-3000:]

        # the requeued job resumes from the stop's checkpoint; then one node (not the batch host) fails
        wait_until(lambda: reached(signalled_at + 4), f"step {signalled_at + 4}")  # a checkpoint after the stop's
        assert f"Restored all states from the checkpoint at {stop_checkpoint}/weights" in _task_log(jobs_dir, job, 1)
        nodes, batch_host = job_nodes(env, job), job_fields(env, job)["BatchHost"]
        assert SPARE not in nodes
        killed = next(node for node in nodes if node != batch_host)
        kill_node(slurm_cluster, killed)
        wait_until(lambda: job_fields(env, job).get("Restarts") == "2", f"job {job}'s requeue after the node failure")
        newest = _checkpoints(log_dir)[-1]  # the newest intact one the failure left
        assert _step(newest) > _step(stop_checkpoint)
        requeued(env, job, 2)
        wait_until(lambda: job_fields(env, job)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING"),
                   f"job {job} to end")
        assert job_fields(env, job)["JobState"] == "COMPLETED", job_fields(env, job)
        assert set(job_nodes(env, job)) == {batch_host, SPARE}
        restored = re.findall(r"Restored all states from the checkpoint at (\S+)/weights", _task_log(jobs_dir, job, 2))
        assert restored == [str(newest)], restored

        submit.wait(timeout=600)
        assert submit.returncode == 0, submit_log.read_text()[-3000:]
    finally:
        if submit.poll() is None:  # with the processes it started (Megatron's checkpoint writer forks a Manager)
            os.killpg(submit.pid, signal.SIGKILL)
            submit.wait()
    losses, reference = _metrics(log_dir), _metrics(reference_dir)
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)
