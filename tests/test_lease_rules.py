"""The lease on an output_dir, as a cluster user meets it: who may take it over, and when a run knows it lost it.

- two live steps of one Slurm job (no ``SLURM_RESTART_COUNT``: it was never requeued) on two nodes are two
  runs: the second is refused, and the first keeps its lease;
- staleness is judged by watching the lease change, with this host's clock: a lease renewed by a host whose
  clock is far behind is live, one "renewed" far in this host's future but never again is taken over after
  its timeout;
- malformed fields (a pid "abc" or null) are named in one line, file and field, never a traceback;
- a run whose renewals keep failing, for whatever reason, gives its lease up and says so;
- a bad ``NEMO_ANCHOR_LEASE_*`` setting is refused before the output folder is made;
- fenced: a run whose lease another run took over changes nothing in the folder (publish, clean-up of a failed
  fresh run) and says so; an unreadable lease is not held;
- the rules are as strong as the lease: ``.break`` is never broken before the lease could be, a requeue is only
  Slurm's own job id with a higher restart count (never torchrun's user-chosen id), and a fresh run signalled
  before its stop handler is installed exits 75 leaving no folder.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_anchor import run_lease
from nemo_anchor.run_dir import LOCK_FILE, RunDir
from nemo_anchor.run_lease import RunClaim, RunDirInUse, RunLease
from tiny_runs import pack_texts, tiny_config, train_tiny

REPO = Path(__file__).resolve().parents[1]
UNSHARE = shutil.which("unshare")
JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _unshare_permitted() -> bool:
    return UNSHARE is not None and subprocess.run([UNSHARE, "-u", "true"], capture_output=True).returncode == 0


# takes the lease as node0 (a UTS namespace), renewing it often, and holds it until stdin closes
_HOLD = ("import json, sys\nfrom nemo_anchor.run_lease import RunLease\n"
         "lease = RunLease(sys.argv[1]); lease.acquire(); lease.start_renewing()\n"
         "print(json.dumps(lease.record), flush=True); sys.stdin.read()\n"
         "print('lost' if lease.lost.is_set() else 'held', flush=True); lease.release()\n")


@pytest.mark.skipif(not _unshare_permitted(), reason="another host is simulated with a UTS namespace (`unshare -u`)")
def test_two_live_steps_of_one_job_on_two_nodes_are_refused(tmp_path, monkeypatch):
    """`srun` twice in one allocation, both into one output_dir: Slurm sets SLURM_RESTART_COUNT only after a
    requeue, so neither step has one; the second must not take the first one's live lease."""
    env = {**{k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}, "PYTHONPATH": str(REPO),
           "SLURM_JOB_ID": "41", "NEMO_ANCHOR_LEASE_RENEW_S": "0.2", "NEMO_ANCHOR_LEASE_TIMEOUT_S": "60"}
    first = subprocess.Popen([UNSHARE, "-u", "sh", "-c", 'hostname node0; exec "$@"', "sh", sys.executable, "-c",
                              _HOLD, str(tmp_path / LOCK_FILE)], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        record = json.loads(first.stdout.readline())
        for name in JOB_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SLURM_JOB_ID", "41")  # the second step, on this node
        with pytest.raises(RunDirInUse, match=f"host node0, pid {record['pid']}, job slurm 41.*renewed while this run "
                                              f"watched it"):
            RunLease(tmp_path / LOCK_FILE).acquire()
        out, _ = first.communicate("", timeout=60)
    finally:
        first.kill()
        first.wait()
    assert out.strip() == "held"  # the first step never lost its lease


def _other_host_lease(**fields) -> dict:
    return {"host": "node9", "pid": 4242, "job": None, "restart": None, "started": "then", "timeout_s": 1.0,
            "token": "node9's", "renewals": 0, **fields}


def test_a_live_lease_from_a_host_whose_clock_is_behind_is_refused(tmp_path):
    """node9's clock is 3 hours behind: its renewals look 3 hours old here, but they keep coming."""
    lock = tmp_path / LOCK_FILE
    record = _other_host_lease(renewed=0.0, timeout_s=300.0)
    lock.write_text(json.dumps(record))
    stop = threading.Event()

    def renew():  # node9 renews, as its RunLease does: the same holder written again
        while not stop.wait(0.05):
            record["renewals"] += 1
            staging = lock.with_name("renewing.tmp")
            staging.write_text(json.dumps({**record, "renewed": record["renewals"] * 0.05}))
            os.replace(staging, lock)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        with pytest.raises(RunDirInUse, match="host node9, pid 4242, started then, renewed while this run watched it"):
            RunLease(lock, renew_s=30, timeout_s=300).acquire()
    finally:
        stop.set()
        renewer.join()
    assert json.loads(lock.read_text())["token"] == "node9's"


def test_a_lease_renewed_in_the_future_is_judged_by_its_timeout(tmp_path, capsys):
    """node9's clock was a day ahead when it last renewed, then node9 died: its lease is taken over once it stayed
    unchanged for its timeout, with one line naming the field."""

    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps(_other_host_lease(renewed=time.time() + 86400)))
    lease = RunLease(lock, renew_s=0.1, timeout_s=0.5)
    lease.acquire()
    assert "not renewed while this run watched it" in lease.took_over
    err = capsys.readouterr().err
    assert f"{lock}: field renewed is 86400 s ahead of this host's clock" in err or \
        f"{lock}: field renewed is 86399 s ahead of this host's clock" in err, err
    lease.release()


@pytest.mark.parametrize("pid, line", [("abc", "field pid is 'abc', not a process id"),
                                       (None, "field pid is missing")])
def test_a_malformed_pid_is_named_in_one_line(tmp_path, capsys, pid, line):
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "renewed": 0, "token": "old"}))
    lease = RunLease(lock, renew_s=0.1, timeout_s=0.5)
    lease.acquire()  # judged by whether it changes: nothing renews it
    err = capsys.readouterr().err
    assert f"warning: {lock}: {line}" in err and "Traceback" not in err
    assert "not renewed while this run watched it" in lease.took_over
    lease.release()


@pytest.mark.parametrize("failure", ["file-system", "anything-else"])
def test_a_run_whose_renewals_keep_failing_gives_its_lease_up_and_says_so(tmp_path, capsys, monkeypatch, failure):
    """A failing file system (or any other error in the renewal thread): before another host could judge the lease
    stale, the run treats it as lost, so it stops before its next write, and says why."""
    import types

    lease = RunLease(tmp_path / LOCK_FILE, renew_s=0.05, timeout_s=0.5)
    lease.acquire()
    if failure == "file-system":  # the renewal's staging file cannot be written
        (tmp_path / f"{LOCK_FILE}.{lease.record['token']}.tmp").mkdir()
        said = "Is a directory"
    else:
        def dumps(*args, **kwargs):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(run_lease, "json", types.SimpleNamespace(dumps=dumps, loads=json.loads, dump=json.dump))
        said = "renewing it failed: RuntimeError: can't start new thread"
    lease.start_renewing()
    assert lease.lost.wait(timeout=60)
    assert not lease.held()
    err = capsys.readouterr().err
    assert f"this run no longer holds {tmp_path / LOCK_FILE}" in err and said in err, err
    lease.release()


@pytest.mark.parametrize("variable, value", [("NEMO_ANCHOR_LEASE_RENEW_S", "soon"),
                                             ("NEMO_ANCHOR_LEASE_TIMEOUT_S", "1")])
def test_a_bad_lease_setting_is_refused_before_the_output_folder_is_made(tmp_path, capsys, monkeypatch, variable,
                                                                        value):
    data = pack_texts(tmp_path)
    monkeypatch.setenv(variable, value)
    assert train_tiny(tmp_path / "run", data) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("nemo-anchor train: error: ")]
    assert len(lines) == 1 and variable in lines[0], err
    assert not (tmp_path / "run").exists()


def _another_runs_lease() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": 1, "pid_started": 1.0, "token": "another run"})


def test_a_fresh_run_whose_lease_was_taken_over_leaves_the_new_owners_folder_alone(tmp_path, capsys):
    """A fresh run paused past its lease timeout: another run took the folder over and wrote into it; the paused run
    then fails. Its clean-up reads the lease file, not what it last knew, and removes nothing."""
    run = RunDir(tmp_path / "run")
    claim = RunClaim(run)  # renewed every 30 s: the takeover is not seen by a renewal before the clean-up
    (run.root / "config.yaml").write_text("the new owner's")
    run.lock.write_text(_another_runs_lease())
    claim.release(failed=True)
    assert (run.root / "config.yaml").read_text() == "the new owner's" and run.lock.read_text() == _another_runs_lease()
    err = capsys.readouterr().err
    assert f"output_dir {run.root}: this run does not remove the folder it made: it does not hold its lease (taken " \
           f"over by host {socket.gethostname()}, pid 1)" in err, err


def test_the_fence_reads_the_lease_before_each_change_and_says_why_not(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    claim = RunClaim(run)
    try:
        assert claim.fence("publish iter_0000010")
        run.lock.write_text(_another_runs_lease())
        assert not claim.fence("publish iter_0000012") and not claim.fence("evict iter_0000002")
        lines = [line for line in capsys.readouterr().err.splitlines() if "this run does not" in line]
        assert [line.split(": this run does not ")[1].split(":")[0] for line in lines] == \
            ["publish iter_0000012", "evict iter_0000002"], lines
    finally:
        claim.release(failed=False)
    assert run.lock.read_text() == _another_runs_lease()  # never written again, nor removed


def test_an_unreadable_lease_is_not_held_until_it_reads_again(tmp_path, capsys):
    """A file system error reading the lease: no write is fenced through on it (held() is False), but the lease is
    not lost yet: the renewals give it up if it lasts."""
    lease = RunLease(tmp_path / LOCK_FILE, renew_s=30, timeout_s=300)
    lease.acquire()
    saved = lease.path.read_bytes()
    lease.path.unlink()
    lease.path.mkdir()  # reading it fails: IsADirectoryError, an OSError as an NFS stall's EIO
    assert not lease.held()
    assert "cannot be read" in lease.check() and not lease.lost.is_set()
    lease.path.rmdir()
    lease.path.write_bytes(saved)
    assert lease.held()
    lease.release()
    assert not lease.path.exists()


class _Clock:
    """This host's monotonic clock, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_break_lock_is_not_broken_before_the_lease_could_be(tmp_path, monkeypatch):
    """Another run holds ``.break`` (it judges the lease, or it died in there): the holder skips its renewals until
    ``.break`` stayed unchanged for the lease's timeout, so a renewer paused inside ``.break`` cannot have it taken
    away, and then write over its successor's lease, before its lease could be taken over."""
    import types

    clock = _Clock()
    monkeypatch.setattr(run_lease, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep,
                                                                  time=time.time, strftime=time.strftime))
    lease = RunLease(tmp_path / LOCK_FILE, renew_s=30, timeout_s=300)
    lease.acquire()
    breaking = lease.break_path
    breaking.write_text(json.dumps({"host": "node9", "pid": 4242, "token": "node9's"}))
    assert lease.renew()  # skipped: another run holds .break
    clock.now += 250  # far beyond any few seconds, within the lease's timeout
    assert lease.renew()
    assert json.loads(breaking.read_text())["token"] == "node9's"
    assert json.loads(lease.path.read_text())["renewals"] == 0
    clock.now += 60  # unchanged for longer than the lease's timeout: left by a run that died holding it
    assert lease.renew()
    assert json.loads(lease.path.read_text())["renewals"] == 1 and not breaking.exists()
    lease.release()


@pytest.mark.parametrize("holder, mine, taken_at_once", [
    ({"job": "slurm 41"}, {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}, True),  # Slurm requeued job 41
    ({"job": "slurm 41", "restart": 2}, {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}, False),  # lower
    ({"job": "slurm 41", "restart": 2}, {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}, False),  # equal
    ({"job": "torchelastic r9", "restart": 0}, {"TORCHELASTIC_RUN_ID": "r9", "TORCHELASTIC_RESTART_COUNT": "1"},
     False),  # a user-chosen --rdzv-id, reused by another launch
], ids=["slurm-requeue", "slurm-lower-count", "slurm-same-count", "torchelastic-id-reused"])
def test_only_slurms_own_job_id_with_a_higher_restart_count_is_a_requeue(tmp_path, monkeypatch, holder, mine,
                                                                         taken_at_once):
    """A lease from node9 (not renewed: watched for its 0.3 s timeout here, as a dead holder's would be)."""
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in mine.items():
        monkeypatch.setenv(name, value)
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps(_other_host_lease(renewed=time.time(), timeout_s=0.3, **holder)))
    lease = RunLease(lock, renew_s=0.1, timeout_s=0.5)
    lease.acquire()
    if taken_at_once:
        assert "its job slurm 41 was requeued (restart 0 -> 1)" in lease.took_over
    else:  # judged by its renewals: a live run of the same id renews and is refused
        assert "was requeued" not in lease.took_over and "not renewed while this run watched it" in lease.took_over
    assert json.loads(lock.read_text())["job"] == f"{'slurm 41' if 'SLURM_JOB_ID' in mine else 'torchelastic r9'}"
    lease.release()


# a fresh nemo-anchor train whose lease is taken, then at once SIGTERM: before the trainer's stop handler is in
_SIGNALLED_AFTER_THE_LEASE = """import os, signal, sys
from nemo_anchor.cli import main
from nemo_anchor.training import loop

class SignalledAfterTheLease(loop.RunClaim):
    def __init__(self, run):
        super().__init__(run)
        os.kill(os.getpid(), signal.SIGTERM)

loop.RunClaim = SignalledAfterTheLease
sys.exit(main(["train", "--config", sys.argv[1]]))
"""


def test_a_fresh_run_signalled_right_after_taking_its_lease_exits_75_and_leaves_no_folder(tmp_path):
    from nemo_anchor.training.preemption import EXIT_INTERRUPTED
    from tiny_runs import child_environment

    data = pack_texts(tmp_path)
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_AFTER_THE_LEASE, str(tiny_config(run, data))],
                          env=child_environment(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == EXIT_INTERRUPTED, done.stderr[-3000:]
    assert "stop requested (SIGTERM) before the first step: nothing saved" in done.stdout, done.stdout[-3000:]
    assert not run.exists(), sorted(p.name for p in run.iterdir())
