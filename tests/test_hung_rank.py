"""A rank that stops making progress, under the launchers our users use: torchrun and nvidia-resiliency-ext's
``ft_launcher`` (docs/cluster.md, "A hung rank, and NVIDIA's fault-tolerance launcher").

- under torchrun, a SIGSTOPped worker (a hung rank, a frozen node) ends the run within
  ``trainer.distributed_timeout_minutes`` plus torchrun's 30 s, with one line naming the key, so that the scheduler
  can start it again;
- under ``ft_launcher``, the trainer's heartbeats let the rank monitor see the hang: the launcher restarts the
  workers in the job, which resume from the newest checkpoint, every step logged once with an uninterrupted run's
  losses.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_anchor.atomic import process_start_time
from nemo_anchor.cli import main
from nemo_anchor.run_dir import LOCK_FILE, RunDir, checkpoint_step
from tiny_runs import child_environment, pack_texts, tiny_config  # tests/tiny_runs.py

EXIT_PREEMPTED = 75
LONG = 10_000  # the runs would go on for this many steps; the hang comes after step SIGNAL_AFTER
SIGNAL_AFTER = 5
# how long a test waits for an event (a step logged, a process gone) before it gives up: far above what a busy
# machine needs; the test's own limit is pytest.ini's timeout
WAIT_S = 600

# every rank records the exit status it returns (torchrun reports none of them once it was signalled)
_RECORD_EXIT = '''
import os, sys
from nemo_anchor.training.cli import main

if __name__ == "__main__":  # dist_checkpointing's spawn-context workers re-import this module
    status = main()
    with open(os.path.join(os.environ["EXIT_DIR"], "rank%s" % os.environ.get("RANK", "0")), "w") as out:
        out.write(str(status))
    sys.exit(status)
'''



@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(packed data, the tiny config for 2 data-parallel ranks, the launcher that records exit statuses)."""
    root = tmp_path_factory.mktemp("cluster")
    data = pack_texts(root)
    config = tiny_config(root / "run", data, max_steps=LONG, global_batch_size=2)
    script = root / "record_exit.py"
    script.write_text(_RECORD_EXIT)
    return root, data, config, script


@pytest.fixture
def launched():
    """Processes a test starts; any still running at its end is stopped (SIGTERM: torchrun stops its workers)."""
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()



def _losses(run) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _reference(setup, steps: int) -> dict[int, float]:
    """The losses of the first ``steps`` steps of an uninterrupted run (in this process, run once for all tests)."""
    root, _, config, _ = setup
    out = root / "reference"
    if not out.exists() or max(_losses(out)) < steps:
        shutil.rmtree(out, ignore_errors=True)
        length = max(steps, 3 * SIGNAL_AFTER)
        assert main(["train", "--config", str(config), f"output_dir={out}", f"trainer.max_steps={length}"]) == 0
    return {step: loss for step, loss in _losses(out).items() if step <= steps}


def _wait_for_step(run, step: int, processes: list[subprocess.Popen]) -> None:
    deadline = time.time() + WAIT_S
    while not (run / "metrics.jsonl").is_file() or max(_losses(run), default=0) < step:
        for process in processes:
            assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.time() < deadline, "the run did not reach step %d" % step
        time.sleep(0.2)


def _exit_statuses(exits) -> dict[str, int]:
    return {path.name: int(path.read_text()) for path in sorted(exits.iterdir())}



def _worker_of_rank(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of ``launcher``'s worker of global ``rank`` (its child with RANK in its environment)."""
    children = (Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split())
    for pid in map(int, children):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} among {children}")


def _killer(pid: int):
    """What SIGKILLs process ``pid`` later if it is still the one it is now (a pid is reused, with its start time
    it is not)."""
    started = process_start_time(pid)

    def kill() -> None:
        if started is not None and process_start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)
    return kill


def _processes_of(run: Path) -> list[int]:
    """The processes whose command line names ``run``, once every one still ending has ended (up to 60 s)."""
    def named() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(run).encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # ended meanwhile
                continue
        return pids
    deadline = time.time() + 60
    while (left := named()) and time.time() < deadline:
        time.sleep(0.5)
    return left


def test_a_stopped_rank_ends_the_run_within_the_distributed_timeout(setup, tmp_path, launched, request):
    """SIGSTOP one worker of two (a hung rank, a frozen node): the other fails its collective after
    trainer.distributed_timeout_minutes with one line naming it, torchrun stops the frozen worker (SIGTERM, then
    SIGKILL after its fixed 30 s) and exits non-zero, within that bound; torchrun alone would wait forever."""
    _, _, config, script = setup
    run, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    # 0.5 minutes: the timeout bounds the process group's start too (both ranks meet in the store), and on a loaded
    # machine one rank's imports can end many seconds after the other's (6 s failed there); torchrun's wait for a
    # failed group's workers to exit
    timeout_s, torchrun_stop_s = 30, 30
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 "--monitor-interval", "0.5", str(script), "--config", str(config),
                                 f"output_dir={run}", f"trainer.distributed_timeout_minutes={timeout_s / 60:g}"],
                                env=child_environment(EXIT_DIR=str(exits)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launched.append(launcher)
    _wait_for_step(run, SIGNAL_AFTER, [launcher])
    hung = _worker_of_rank(launcher, 1)
    os.kill(hung, signal.SIGSTOP)
    request.addfinalizer(_killer(hung))  # a failed test leaves no frozen worker behind
    stopped = time.monotonic()
    output = launcher.communicate(timeout=WAIT_S)[0]
    ended = time.monotonic() - stopped
    assert launcher.returncode != 0 and _exit_statuses(exits) == {"rank0": 1}, output[-3000:]  # rank 1: SIGKILL
    assert ("nemo-anchor train: error: rank 0 waited longer than trainer.distributed_timeout_minutes=0.5 (30 s) for "
            "the other ranks") in output, output[-3000:]
    # the bound, with room for a busy machine; the default (10 minutes) or torch's gloo default (30) are far above
    assert ended < timeout_s + torchrun_stop_s + 60, ended
    assert not (run / LOCK_FILE).exists()  # rank 0 left the folder to the restarted run


def test_ft_launcher_restarts_a_hung_rank_in_job_from_the_newest_checkpoint(setup, tmp_path, launched, request):
    """nvidia-resiliency-ext's ft_launcher instead of torchrun: a SIGSTOPped worker sends no heartbeat, its rank
    monitor kills it, the launcher restarts both workers in the job, the new rank 0 takes the lease over at once and
    resumes from the newest checkpoint; SIGTERM to the launcher then saves the step reached on every rank (75). Every
    step is logged once, with an uninterrupted run's losses. Without the trainer's heartbeats the monitor watches
    nothing and the run waits for trainer.distributed_timeout_minutes (10)."""
    pytest.importorskip("nvidia_resiliency_ext.fault_tolerance.launcher",
                        reason="nvidia-resiliency-ext (ft_launcher) is not installed here (.venv-bridge has none: "
                               "0.4.1 breaks megatron-core 0.19's import)")
    _, _, config, script = setup
    run, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    log = tmp_path / "ft_launcher.log"  # read while it runs
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-c", "from nvidia_resiliency_ext.fault_tolerance.launcher import main; main()",
             "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
             "--workers-stop-timeout", "10", "--term-timeout", "60", "--ft-workload-check-interval", "1",
             "--ft-rank-heartbeat-timeout", "5", "--ft-enable-nic-monitor", "false",
             str(script), "--config", str(config), f"output_dir={run}"],
            env=child_environment(EXIT_DIR=str(exits)), stdout=out, stderr=subprocess.STDOUT, text=True)
    launched.append(launcher)
    _wait_for_step(run, SIGNAL_AFTER, [launcher])
    hung = _worker_of_rank(launcher, 1)
    os.kill(hung, signal.SIGSTOP)
    request.addfinalizer(_killer(hung))  # a failed test leaves no frozen worker behind
    deadline = time.time() + WAIT_S
    while not (resumed := re.search(r"resumed from \S+ at step (\d+)", log.read_text())):
        assert launcher.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    newest = int(resumed.group(1))
    assert newest >= SIGNAL_AFTER - 1 and newest % 2 == 0  # checkpoint.save_every=2: the newest before the hang
    _wait_for_step(run, newest + 2, [launcher])
    launcher.send_signal(signal.SIGTERM)  # ft_launcher forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT (not SIGUSR1)
    launcher.wait(timeout=WAIT_S)
    output = log.read_text()
    assert not Path(f"/proc/{hung}").exists()
    assert _processes_of(run) == [], "processes of the run outlived it (the killed incarnation's writer Managers?)"
    assert _exit_statuses(exits) == {"rank0": EXIT_PREEMPTED, "rank1": EXIT_PREEMPTED}, output[-3000:]
    assert "Did not get subsequent heartbeat" in output and "will restart worker group" in output, output[-3000:]
    assert "took over the lease" not in output or "its process is gone" in output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == list(range(1, len(steps) + 1)), steps  # each step once, in order
    saved = [checkpoint_step(path) for path in RunDir(run).list_checkpoints()]
    assert saved[-1] == steps[-1] and not (run / LOCK_FILE).exists()
    assert _losses(run) == pytest.approx(_reference(setup, steps[-1]), rel=1e-5, abs=1e-6)
