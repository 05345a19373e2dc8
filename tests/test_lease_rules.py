"""The lease on an output_dir, as a cluster user meets it: who may take it over, and when a run knows it lost it.

- two live steps of one Slurm job (no ``SLURM_RESTART_COUNT``: it was never requeued) on two nodes are two
  runs: the second is refused, and the first keeps its lease;
- staleness is judged by watching the lease change, with this host's clock: a lease renewed by a host whose
  clock is far behind is live, one "renewed" far in this host's future but never again is taken over after
  its timeout;
- malformed fields (a pid "abc" or null) are named in one line, file and field, never a traceback;
- a run whose renewals keep failing, for whatever reason, gives its lease up and says so;
- a bad ``NEMO_ANCHOR_LEASE_*`` setting is refused before the output folder is made.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nemo_anchor import run_dir
from nemo_anchor.run_dir import LOCK_FILE, RunDirInUse, RunLease
from tiny_runs import pack_texts, train_tiny

REPO = Path(__file__).resolve().parents[1]
UNSHARE = shutil.which("unshare")
JOB_VARIABLES = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _unshare_permitted() -> bool:
    return UNSHARE is not None and subprocess.run([UNSHARE, "-u", "true"], capture_output=True).returncode == 0


# takes the lease as node0 (a UTS namespace), renewing it often, and holds it until stdin closes
_HOLD = ("import json, sys\nfrom nemo_anchor.run_dir import RunLease\n"
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
    import time

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

        monkeypatch.setattr(run_dir, "json", types.SimpleNamespace(dumps=dumps, loads=json.loads, dump=json.dump))
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
