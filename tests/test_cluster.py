"""The trainer as a cluster runs it: preempted by a signal to its process group, under torchrun, on two "nodes".

- SIGTERM to the whole process group after earlier saves (how Slurm, Kubernetes and torchrun
  deliver it; Megatron's checkpoint writer keeps helper processes that the signal reaches too)
  saves the step every rank reached and exits 75; SIGUSR1 (Slurm's ``--signal=USR1@120``) does the same;
- under torchrun, SIGTERM to the launcher reaches every worker, which save and exit 75;
- two torchrun launchers, each in its own UTS namespace with its own hostname, sharing this
  filesystem, train, save and resume;
- and every interrupted run, resumed (by the same command on two nodes, in one process otherwise), gives the
  losses of an uninterrupted run (float64-free: fp32 on the CPU, where 1, 2 processes and 2 nodes give the
  same sums).
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
from tiny_runs import child_environment, free_port, pack_texts, tiny_config  # tests/tiny_runs.py

EXIT_PREEMPTED = 75
LONG = 10_000  # the interrupted runs would go on for this many steps; the signal comes after step SIGNAL_AFTER
SIGNAL_AFTER = 5
MORE = 2  # the resumed runs take this many steps beyond the one the signal saved
# torchrun forwards these to its workers (its default lacks Slurm's SIGUSR1)
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# how long a test waits for an event (a step logged, a process gone after its signal) before it gives up: far
# above what a busy machine needs (a 2-core machine under a load of 75 took more than 180 s to log step 5);
# the test's own limit is pytest.ini's timeout
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


def _unshare_permitted() -> bool:
    unshare = shutil.which("unshare")
    return unshare is not None and subprocess.run([unshare, "-u", "true"], capture_output=True).returncode == 0


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


def _relaunch_in_this_process(config, run, capsys):
    """The same command as ``nemo-anchor train`` in this process, with more overrides; returns its output."""
    def relaunch(*overrides) -> str:
        assert main(["train", "--config", str(config), f"output_dir={run}", *overrides]) == 0
        return capsys.readouterr().out
    return relaunch


def _check_saved_and_resume(setup, run, relaunch) -> None:
    """The signal's checkpoint is the last step logged, after the scheduled ones; the same command (``relaunch``
    with a nearer trainer.max_steps) resumes it; all losses equal an uninterrupted run's."""
    reached = max(_losses(run))
    saved = [checkpoint_step(path) for path in RunDir(run).list_checkpoints()]
    assert saved[-1] == reached >= SIGNAL_AFTER and saved[0] % 2 == 0, saved  # earlier scheduled saves, then this
    assert not (run / LOCK_FILE).exists()
    output = relaunch(f"trainer.max_steps={reached + MORE}")
    assert f"resumed from {run / 'checkpoints' / f'iter_{reached:07d}'} at step {reached}" in output
    losses = _losses(run)
    assert sorted(losses) == list(range(1, reached + MORE + 1))
    assert losses == pytest.approx(_reference(setup, reached + MORE), rel=1e-5, abs=1e-6)


def test_group_sigterm_after_earlier_saves_saves_the_step_reached(setup, tmp_path, capsys, launched):
    _, _, config, script = setup
    run, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    command = [sys.executable, str(script), "--config", str(config), f"output_dir={run}"]
    env = child_environment(EXIT_DIR=str(exits))
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    launched.append(process)
    _wait_for_step(run, SIGNAL_AFTER, [process])
    os.killpg(process.pid, signal.SIGTERM)  # the whole group: the trainer and Megatron's writer processes
    output = process.communicate(timeout=WAIT_S)[0]
    assert process.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "BrokenPipeError" not in output and "stop requested (SIGTERM)" in output

    _check_saved_and_resume(setup, run, _relaunch_in_this_process(config, run, capsys))


def test_torchrun_sigterm_to_the_launcher_saves_on_every_rank(setup, tmp_path, capsys, launched):
    _, _, config, script = setup
    run, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    # --standalone: torchrun takes a free port itself (none can be taken between a look and its bind)
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 str(script), "--config", str(config), f"output_dir={run}"],
                                env=child_environment(EXIT_DIR=str(exits)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launched.append(launcher)
    _wait_for_step(run, SIGNAL_AFTER, [launcher])
    launcher.send_signal(signal.SIGTERM)  # torchrun forwards it to each worker's process group
    output = launcher.communicate(timeout=WAIT_S)[0]
    assert _exit_statuses(exits) == {"rank0": EXIT_PREEMPTED, "rank1": EXIT_PREEMPTED}, output[-3000:]
    assert "stop requested (SIGTERM)" in output

    # in this process: the resume reads both ranks' shards (the two nodes' test resumes under torchrun again)
    _check_saved_and_resume(setup, run, _relaunch_in_this_process(config, run, capsys))


@pytest.mark.skipif(not _unshare_permitted(), reason="two nodes are simulated with a UTS namespace each "
                    "(`unshare -u`), which needs root or user namespaces; not permitted here")
def test_two_nodes_train_save_on_sigusr1_and_resume(setup, tmp_path, launched):
    _, _, config, script = setup
    run, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    # the simulated hostnames do not resolve: gloo is told the interface
    env = child_environment(EXIT_DIR=str(exits), GLOO_SOCKET_IFNAME="lo")

    def two_nodes(*overrides) -> list[subprocess.Popen]:
        port = free_port()
        nodes = [subprocess.Popen(
            ["unshare", "-u", "sh", "-c", f'hostname node{rank}; exec "$@"', "sh",
             sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--signals-to-handle", FORWARDED, str(script), "--config", str(config), f"output_dir={run}",
             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank in (0, 1)]
        launched.extend(nodes)
        return nodes

    launchers = two_nodes()
    _wait_for_step(run, SIGNAL_AFTER, launchers)
    for launcher in launchers:  # Slurm's --signal=USR1@120 signals every task: here, each node's torchrun
        launcher.send_signal(signal.SIGUSR1)
    outputs = [launcher.communicate(timeout=WAIT_S)[0] for launcher in launchers]
    assert _exit_statuses(exits) == {"rank0": EXIT_PREEMPTED, "rank1": EXIT_PREEMPTED}, outputs[0][-3000:]
    assert "stop requested (SIGUSR1)" in outputs[0]

    def relaunch(*overrides):
        again = two_nodes(*overrides)
        outputs = [launcher.communicate(timeout=WAIT_S)[0] for launcher in again]
        assert [launcher.returncode for launcher in again] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
        return outputs[0]

    _check_saved_and_resume(setup, run, relaunch)


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


def test_a_stopped_rank_ends_the_run_within_the_distributed_timeout(setup, tmp_path, launched, request):
    """SIGSTOP one worker of two (a hung rank, a frozen node): the other fails its collective after
    trainer.distributed_timeout_minutes with one line naming it, torchrun stops the frozen worker (SIGTERM, then
    SIGKILL after its fixed 30 s) and exits non-zero, within that bound; torchrun alone would wait forever."""
    _, _, config, script = setup
    run, exits = tmp_path / "run", tmp_path / "exits"
    exits.mkdir()
    timeout_s, torchrun_stop_s = 6, 30  # 0.1 minutes; torchrun's wait for a failed group's workers to exit
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
    assert ("nemo-anchor train: error: rank 0 waited longer than trainer.distributed_timeout_minutes=0.1 (6 s) for "
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
    assert _exit_statuses(exits) == {"rank0": EXIT_PREEMPTED, "rank1": EXIT_PREEMPTED}, output[-3000:]
    assert "Did not get subsequent heartbeat" in output and "will restart worker group" in output, output[-3000:]
    assert "took over the lease" not in output or "its process is gone" in output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == list(range(1, len(steps) + 1)), steps  # each step once, in order
    saved = [checkpoint_step(path) for path in RunDir(run).list_checkpoints()]
    assert saved[-1] == steps[-1] and not (run / LOCK_FILE).exists()
    assert _losses(run) == pytest.approx(_reference(setup, steps[-1]), rel=1e-5, abs=1e-6)
