"""``scripts/slurm/bridge.sbatch`` on a real Slurm cluster, submitted as a Megatron-Bridge user submits it.

The cluster is ``scripts/slurm/local_cluster.sh``'s (the ``slurm_cluster`` fixture): slurmctld and three slurmd on
this machine, each node with its own address and hostname. One job, ``sbatch --export=ALL,CONFIG=...,SAVE=...
scripts/slurm/bridge.sbatch``, runs Bridge's ``pretrain()`` with one CPU worker per node (``GPUS_PER_NODE=1
--gpus-per-node=0``) on two nodes (data parallel 2, Bridge's distributed optimizer, sharded over the nodes), training
a 1-layer model; what Slurm does is Slurm's own:

- the time-limit signal (``scancel --batch --signal=USR1``, what ``--signal=B:USR1@120`` sends) saves, requeues and
  resumes from that checkpoint; the log names SIGUSR1 (Bridge's own line said SIGTERM whatever came), ends the stop
  with the run's line (signal, checkpoint, run again) and the batch script's (signal, checkpoint, requeued), and
  holds no traceback (Bridge logged its planned exit as "Pretrain failed", every start began with an import one);
- then one node is killed (its slurmd and every process on it, SIGKILL): Slurm marks it down and requeues the job
  onto the spare node, and the run resumes from its newest complete checkpoint (Bridge's tracker) and ends COMPLETED;
- every step is logged once, with the losses of the same run uninterrupted (two ranks on one node, forked from
  tests/preloaded.py); the run folder has a space in its name, through sbatch, bash -c and torchrun.

Skipped where Megatron-Bridge is not installed or the cluster cannot start (the fixture says why).
"""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

from slurm_jobs import (SPARE, cancel_and_wait, job_fields, job_nodes, kill_node,  # noqa: E402  tests/slurm_jobs.py
                        planned_stop_step, requeued, wait_until)
from tiny_runs import REPO, child_environment, pack_texts  # noqa: E402  tests/tiny_runs.py

# train.train_iters: far more than the events below need, so that none comes after the run's end however slow or
# fast the machine is; the job that must complete is then given a nearer end in its config
LONG = 20_000
MORE = 3  # the completing job's steps beyond the checkpoint it resumes last
SLURM = REPO / "scripts/slurm"
UNFINISHED = ("PENDING", "RUNNING", "COMPLETING", "REQUEUED")


def _run_config(root: Path, max_steps: int) -> Path:
    """A `nemo-anchor train` YAML of a tiny model over packed byte windows of 64 tokens, 2 windows a step."""
    config = root / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(root / "unused"),
        "model": {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": 64, "attention_type": "anchor", "rotary_base": "10000"},
        "data": {"path": str(root / "packed")},
        "trainer": {"max_steps": max_steps, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False, "eval_batches": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 2, "keep_last": 2},
    }))
    return config


def _losses(save: Path) -> dict[int, float]:
    """The losses of ``save``'s metrics.jsonl, checking each step is logged once."""
    metrics = save / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [row["step"] for row in rows if "loss" in row]
    assert len(steps) == len(set(steps)), steps
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _newest(save: Path) -> int:
    """The step of the newest complete checkpoint (Bridge's tracker, written once a save is complete)."""
    return int((save / "latest_checkpointed_iteration.txt").read_text())


def test_time_limit_signal_requeues_and_a_killed_node_is_replaced_by_the_spare(slurm_cluster, pretrain_cli,
                                                                                tmp_path):
    pack_texts(tmp_path, name="packed")
    config = _run_config(tmp_path, LONG)
    save = tmp_path / "time limit run"
    env = child_environment(SLURM_CONF=str(slurm_cluster / "slurm.conf"),
                            PATH=f"{Path(sys.executable).parent}:{child_environment()['PATH']}")
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--export=ALL,CONFIG={config},SAVE={save},GPUS_PER_NODE=1", "--gpus-per-node=0",
         f"--chdir={REPO}", f"--output={tmp_path}/%x-%j.out", str(SLURM / "bridge.sbatch"), "--peak-tflops", "1"],
        env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    log = tmp_path / f"nemo-anchor-bridge-{job}.out"

    def trained(step: int):
        def reached():
            assert job_fields(env, job)["JobState"] in ("PENDING", "RUNNING"), (job_fields(env, job), log.read_text()[-3000:])
            return max(_losses(save), default=0) >= step
        wait_until(reached, f"{save} to log step {step}")

    try:
        trained(3)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True, timeout=60)
        requeued(env, job, 1)
        signalled_at = planned_stop_step(log, "requeued, the job runs again and resumes from it")
        text = log.read_text()
        assert "[exiting program after receiving SIGUSR1.]" in text
        assert (f"stop requested (SIGUSR1): saved {save / f'iter_{signalled_at:07d}'} at step {signalled_at}; run the "
                f"same command again to resume") in text
        trained(signalled_at + 3)
        assert "Traceback" not in log.read_text() and "Pretrain failed" not in log.read_text(), log.read_text()[-5000:]

        nodes = job_nodes(env, job)
        assert SPARE not in nodes
        killed = nodes[1]  # not the batch host: the survivor's srun waits until Slurm marks the node down
        kill_node(slurm_cluster, killed)
        wait_until(lambda: job_fields(env, job).get("Restarts") == "2", f"job {job}'s requeue after the node failure")
        newest = _newest(save)
        last = newest + MORE
        config.write_text(config.read_text().replace(f'"max_steps": {LONG}', f'"max_steps": {last}'))
        requeued(env, job, 2)
        wait_until(lambda: job_fields(env, job)["JobState"] not in UNFINISHED, f"job {job} to end")
    finally:
        cancel_and_wait(env, [job])
    assert job_fields(env, job)["JobState"] == "COMPLETED", log.read_text()[-5000:]
    assert set(job_nodes(env, job)) == {nodes[0], SPARE}
    resumed = [int(step) for step in re.findall(r"successfully loaded checkpoint from .* at iteration (\d+)",
                                                log.read_text())]
    assert resumed == [signalled_at, newest], resumed
    assert _newest(save) == last

    # every step trained once, as the run uninterrupted: two ranks on one node
    reference = tmp_path / "uninterrupted"
    straight = pretrain_cli.run(["--config", str(config), f"checkpoint.save={reference}",
                                 f"checkpoint.load={reference}", "--peak-tflops", "1"], processes=2, timeout=600)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-3000:]
    losses = _losses(save)
    assert sorted(losses) == list(range(1, last + 1))
    assert losses == pytest.approx(_losses(reference), rel=1e-5, abs=1e-6)
