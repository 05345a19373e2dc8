"""``scripts/slurm/train.sbatch`` on a real Slurm cluster, submitted as users submit it.

The cluster is ``scripts/slurm/local_cluster.sh``'s (the ``slurm_cluster`` fixture): slurmctld and three slurmd on
this machine, each node with its own address and hostname. Each job is ``sbatch --export=ALL,CONFIG=...
scripts/slurm/train.sbatch overrides...`` with one CPU worker per node (``GPUS_PER_NODE=1 --gpus-per-node=0``) on two
nodes, training the 1-layer test model (tests/tiny_runs.py); what Slurm does is Slurm's own:

- a preemption (``scontrol requeue``: SIGTERM to every process of the job) saves, and the requeued job resumes;
  a second job on the same output folder is refused while the first runs, which goes on unharmed; ``scancel``
  saves and the job is not requeued;
- the time-limit signal (``scancel --batch --signal=USR1``, what ``--signal=B:USR1@120`` sends) saves, requeues
  and resumes; then one node is killed (its slurmd and every process on it, SIGKILL): Slurm marks it down,
  requeues the job onto the spare node, and the run resumes from its newest intact checkpoint and ends COMPLETED;
- every step is logged once, and the losses equal an uninterrupted single-process run's (as tests/test_cluster.py);
  overrides with spaces and ``[a,b]`` lists reach the trainer through the real sbatch;
- each planned stop ends the job's log with one line naming the signal, the checkpoint and what comes next, and
  no torchrun traceback (the batch script cannot tell a preemption from scancel: both read COMPLETING).
"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_anchor.cli import main
from nemo_anchor.run_dir import RunDir, checkpoint_step
from slurm_jobs import (SPARE, cancel_and_wait, job_fields, job_nodes, kill_node, planned_stop_step,  # tests/
                        requeued, revive_down_nodes, scontrol, wait_until)
from tiny_runs import REPO, child_environment, pack_texts, tiny_config  # tests/tiny_runs.py

# each job's trainer.max_steps: far more than the events below need, so that none comes after the run's end however
# slow or fast the machine is; the job that must complete is then given a nearer end in its config (as a user
# extends or shortens a run between restarts)
LONG = 10_000
MORE = 3  # the completing job's steps beyond the checkpoint it resumes last
SLURM = REPO / "scripts/slurm"


@pytest.fixture(scope="module")
def setup(slurm_cluster, tmp_path_factory):
    """(the cluster's folder, the tiny config for 2 data-parallel ranks, the environment sbatch is run in)."""
    root = tmp_path_factory.mktemp("slurm-jobs")
    config = tiny_config(root / "run", pack_texts(root), max_steps=LONG, global_batch_size=2)
    env = child_environment(SLURM_CONF=str(slurm_cluster / "slurm.conf"),
                            PATH=f"{Path(sys.executable).parent}:{child_environment()['PATH']}")
    return root, config, env


@pytest.fixture
def jobs(setup, slurm_cluster):
    """Jobs a test submits; any still queued or running at its end is cancelled (and waited for), and a node the test
    killed is started again."""
    submitted: list[str] = []
    yield submitted
    cancel_and_wait(setup[2], submitted)
    revive_down_nodes(slurm_cluster, setup[2])


def _submit(setup, jobs, *overrides, nodes: int = 2, config: Path | None = None) -> tuple[str, Path]:
    """``sbatch train.sbatch overrides`` as a user types it (``config``: the setup's); the job's id and its log."""
    root, default_config, env = setup
    config = config or default_config
    done = subprocess.run(
        ["sbatch", "--parsable", f"--export=ALL,CONFIG={config},GPUS_PER_NODE=1", "--gpus-per-node=0",
         f"--nodes={nodes}", f"--chdir={REPO}", f"--output={root}/%x-%j.out", str(SLURM / "train.sbatch"),
         *overrides], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    jobs.append(job)
    return job, root / f"nemo-anchor-{job}.out"


def _losses(run: Path) -> dict[int, float]:
    """The losses of ``run``'s metrics.jsonl, checking each step is logged once."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert len(steps) == len(set(steps)), steps
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _wait_for_step(env, job: str, run: Path, step: int) -> None:
    def reached():
        assert job_fields(env, job)["JobState"] in ("PENDING", "RUNNING"), job_fields(env, job)
        return (run / "metrics.jsonl").is_file() and max(_losses(run), default=0) >= step
    wait_until(reached, f"{run} to log step {step}")


def _check_losses(setup, run: Path, last: int) -> None:
    """Steps 1..last each logged once, with the losses of an uninterrupted single-process run."""
    root, config, _ = setup
    reference = root / "reference"
    if not (reference / "metrics.jsonl").is_file() or max(_losses(reference)) < last:
        shutil.rmtree(reference, ignore_errors=True)
        assert main(["train", "--config", str(config), f"output_dir={reference}", f"trainer.max_steps={last}"]) == 0
    losses = _losses(run)
    assert sorted(losses) == list(range(1, last + 1))
    assert losses == pytest.approx({s: v for s, v in _losses(reference).items() if s <= last}, rel=1e-5, abs=1e-6)


def test_preemption_saves_a_second_job_is_refused_and_scancel_saves_without_requeue(setup, jobs):
    root, _, env = setup
    run = root / "preempted run"  # a space in the override, through sbatch, bash -c and torchrun
    job, log = _submit(setup, jobs, f"output_dir={run}")
    _wait_for_step(env, job, run, 3)

    second, second_log = _submit(setup, jobs, f"output_dir={run}", nodes=1)  # on the spare node
    wait_until(lambda: job_fields(env, second)["JobState"] in ("FAILED", "COMPLETED"), f"job {second} to end")
    assert job_fields(env, second)["JobState"] == "FAILED"
    assert f"output_dir {run} is in use by another training run" in second_log.read_text()
    assert job_fields(env, job)["JobState"] == "RUNNING"

    scontrol(env, "requeue", job)  # a preemption: SIGTERM to every process of the job, then back in the queue
    requeued(env, job, 1)
    preempted_at = planned_stop_step(log, "a requeued job resumes from it; after scancel, the same sbatch command does")
    assert f"stop requested (SIGTERM): saved {run / 'checkpoints' / f'iter_{preempted_at:07d}'}" in log.read_text()
    _wait_for_step(env, job, run, preempted_at + 2)
    assert f"resumed from {run / 'checkpoints' / f'iter_{preempted_at:07d}'} at step {preempted_at}" in log.read_text()

    subprocess.run(["scancel", job], env=env, check=True, timeout=60)
    wait_until(lambda: job_fields(env, job)["JobState"] == "CANCELLED", f"job {job} to be cancelled")
    cancelled_at = checkpoint_step(RunDir(run).list_checkpoints()[-1])
    assert log.read_text().count(" stopped on SIGTERM ") == 2
    assert f"newest checkpoint {run / 'checkpoints' / f'iter_{cancelled_at:07d}'}: a requeued" in log.read_text()
    assert f"stop requested (SIGTERM): saved {run / 'checkpoints' / f'iter_{cancelled_at:07d}'}" in log.read_text()
    assert job_fields(env, job)["JobState"] == "CANCELLED" and job_fields(env, job)["Restarts"] == "1"
    _check_losses(setup, run, cancelled_at)


def test_time_limit_signal_requeues_and_a_killed_node_is_replaced_by_the_spare(setup, slurm_cluster, jobs):
    root, config, env = setup
    run = root / "time limit run"
    config = tiny_config(run, Path(yaml.safe_load(config.read_text())["data"]["path"]), max_steps=LONG,
                         global_batch_size=2)  # this job's own config, beside its output folder
    job, log = _submit(setup, jobs, "checkpoint.allow_change=[optim.lr,optim.min_lr]", config=config)
    _wait_for_step(env, job, run, 3)

    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=60)
    requeued(env, job, 1)
    signalled_at = planned_stop_step(log, "requeued, the job runs again and resumes from it")
    assert "stopped on SIGUSR1 (time limit near)" in log.read_text()
    _wait_for_step(env, job, run, signalled_at + 3)

    nodes = job_nodes(env, job)
    assert SPARE not in nodes
    newest = checkpoint_step(RunDir(run).list_checkpoints()[-1])
    killed = nodes[1]  # not the batch host: the survivor's srun waits until Slurm marks the node down
    kill_node(slurm_cluster, killed)
    wait_until(lambda: job_fields(env, job).get("Restarts") == "2", f"job {job}'s requeue after the node failure")
    last = checkpoint_step(RunDir(run).list_checkpoints()[-1]) + MORE
    config.write_text(config.read_text().replace(f"max_steps: {LONG}", f"max_steps: {last}"))
    requeued(env, job, 2)
    wait_until(lambda: job_fields(env, job)["JobState"] == "COMPLETED", f"job {job} to complete")
    assert set(job_nodes(env, job)) == {nodes[0], SPARE}
    resumed = [int(step) for step in re.findall(r"resumed from .* at step (\d+)", log.read_text())]
    assert resumed[0] == signalled_at and resumed[1] >= max(newest, signalled_at), resumed
    assert "SignalException" not in log.read_text()
    _check_losses(setup, run, last)
