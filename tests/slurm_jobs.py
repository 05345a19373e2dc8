"""Jobs on the local Slurm cluster (the ``slurm_cluster`` fixture, ``scripts/slurm/local_cluster.sh``): what the
Slurm tests ask slurmctld and how they wait for it. ``env``: an environment with the cluster's ``SLURM_CONF``."""
import os
import re
import subprocess
import time
from pathlib import Path

LOCAL_CLUSTER = Path(__file__).resolve().parents[1] / "scripts/slurm/local_cluster.sh"
WAIT_S = 600  # how long any one wait gives up after (a step logged, a job state reached)
SPARE = f"anchor{os.environ.get('LOCAL_CLUSTER_TAG', '')}-n3"  # the third node: idle while a two-node job runs


def scontrol(env, *args) -> str:
    return subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, check=True,
                          timeout=60).stdout


def job_fields(env, job: str) -> dict[str, str]:
    """``job``'s fields (JobState, Restarts, NodeList, ...); JobState PURGED once slurmctld forgot it. scontrol is
    asked again when it could not reach slurmctld (a busy controller on a loaded machine times out now and then)."""
    for _ in range(10):
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True,
                               timeout=60)
        if shown.returncode == 0:
            return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        if "Invalid job id" in shown.stderr:
            return {"JobState": "PURGED"}
        time.sleep(1)
    raise AssertionError(f"scontrol show job {job} failed 10 times: {shown.stderr.strip()}")


def job_nodes(env, job: str) -> list[str]:
    """The hostnames ``job`` runs (or last ran) on, the batch host first."""
    return scontrol(env, "show", "hostnames", job_fields(env, job)["NodeList"]).split()


def wait_until(condition, what: str) -> None:
    deadline = time.time() + WAIT_S
    while not condition():
        assert time.time() < deadline, f"gave up waiting for {what}"
        time.sleep(0.5)


def requeued(env, job: str, restarts: int) -> None:
    """Wait for ``job``'s requeue number ``restarts``, then start it now (a requeued job waits ~2 min otherwise).

    Not before every node has ended the job's previous run (none COMPLETING), and a second later: the slurmd that
    ends it revokes the job's credential, and a credential issued before that, or in the same second, is refused
    ("Killing non-startable batch job: Job credential revoked", the job FAILED). Slurm's own wait avoids that."""
    wait_until(lambda: (lambda state: state["JobState"] == "PENDING" and state.get("Restarts") == str(restarts))(
        job_fields(env, job)), f"job {job}'s requeue {restarts}")
    wait_until(lambda: not subprocess.run(["sinfo", "-h", "-t", "completing", "-o", "%N"], env=env, capture_output=True,
                                          text=True, check=True, timeout=60).stdout.strip(),
               f"the nodes to end job {job}'s previous run")
    time.sleep(1.5)
    scontrol(env, "update", f"jobid={job}", "StartTime=now")


def cancel_and_wait(env, jobs: list[str]) -> None:
    """``scancel`` each of ``jobs`` and wait until none is queued or running any more."""
    for job in jobs:
        subprocess.run(["scancel", job], env=env, timeout=60)
    for job in jobs:
        wait_until(lambda: job_fields(env, job)["JobState"] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED"),
                   f"job {job} to end")


def kill_node(cluster: Path, node: str) -> None:
    """A node failure: ``node``'s slurmd and every process on it SIGKILLed (``local_cluster.sh kill-node``)."""
    subprocess.run(["bash", str(LOCAL_CLUSTER), "kill-node", str(cluster), node[-1]], check=True, timeout=60)


def revive_down_nodes(cluster: Path, env) -> None:
    """Every node Slurm has down (a test killed it) back in service (``local_cluster.sh revive-node``), so that the
    next test on the shared cluster has its spare again."""
    down = subprocess.run(["sinfo", "-h", "-t", "down", "-o", "%N"], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()
    for node in scontrol(env, "show", "hostnames", down).split() if down else []:
        subprocess.run(["bash", str(LOCAL_CLUSTER), "revive-node", str(cluster), node[-1]], check=True, timeout=120)


def planned_stop_step(log: Path, ending: str) -> int:
    """The step of the checkpoint named by the batch log's one planned-stop line (train.sbatch's and bridge.sbatch's
    last line), which must end with ``ending``; the log holds no torchrun traceback and no srun error."""
    text = log.read_text()
    assert "SignalException" not in text and "Exited with exit code" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if line.startswith("job ") and " stopped on " in line]
    assert len(lines) == 1 and lines[0].endswith(ending), lines
    return int(re.search(r"iter_(\d+)", lines[0]).group(1))
