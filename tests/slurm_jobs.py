"""Jobs on the test Slurm cluster (the ``slurm_cluster`` fixture, scripts/slurm/local_cluster.sh), shared by the tests
that submit a batch script to it: tests/test_slurm_cluster.py (train.sbatch), tests/bridge/test_bridge_slurm.py
(bridge.sbatch). ``env`` is the environment the Slurm commands run in (with the cluster's ``SLURM_CONF``)."""
import os
import re
import subprocess
import time
from pathlib import Path

WAIT_S = 600  # how long any one wait gives up after (a step logged, a job state reached)
SPARE = f"anchor{os.environ.get('LOCAL_CLUSTER_TAG', '')}-n3"  # the third node: idle while a two-node job runs


def _scontrol(env, *args) -> str:
    return subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout


def _job(env, job: str) -> dict[str, str]:
    """``job``'s fields (JobState, Restarts, NodeList, ...); JobState PURGED once slurmctld forgot it."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                           timeout=60)
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout)) if shown.returncode == 0 else {"JobState": "PURGED"}


def _wait_until(condition, what: str) -> None:
    deadline = time.time() + WAIT_S
    while not condition():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.5)


def _requeued(env, job: str, restarts: int) -> None:
    """Wait for ``job``'s requeue number ``restarts``, then start it now (a requeued job waits ~2 min otherwise)."""
    _wait_until(lambda: (lambda state: state["JobState"] == "PENDING" and state.get("Restarts") == str(restarts))(
        _job(env, job)), f"job {job}'s requeue {restarts}")
    _scontrol(env, "update", f"jobid={job}", "StartTime=now")


def _stop_line(log: Path, ending: str) -> int:
    """The step of the checkpoint named by the log's one planned-stop line ending with ``ending``."""
    text = log.read_text()
    assert "SignalException" not in text and "Exited with exit code" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("job ") and " stopped on " in line]
    assert len(lines) == 1 and lines[0].endswith(ending), lines
    return int(re.search(r"iter_(\d+)", lines[0]).group(1))
