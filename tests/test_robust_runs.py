"""One training run per output_dir, and a resume that changes nothing without saying so.

- a second run into an output_dir in use is refused naming the holder (host, pid, job); a lease left
  by a dead process is taken over, by exactly one of the runs racing for it; so is a lease of
  another host that was not renewed in time, or one of this run's own (requeued) scheduler job; a
  holder is its pid and the pid's start time, so a reused pid is no holder;
- a resume is compared with the checkpoint's config before anything is written: a change of the
  model, the attention, the data (by content, so a same-sized other dataset is caught) or the
  window is refused naming the key and both values; the LR schedule and batch size change only
  when allowed (``--allow-change``), and then for real;
- these refusals are one line, ``nemo-anchor train: error: ...``, exit status 2; under torchrun
  from rank 0 only.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nemo_anchor.atomic import process_start_time
from nemo_anchor.cli import main
from nemo_anchor.run_dir import LOCK_FILE, RunDir
from nemo_anchor.run_lease import RunDirInUse, RunLease

REPO = Path(__file__).resolve().parents[1]
TEXTS = [f"Document number {i} says: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 5)
         for i in range(24)]


def pack(root, name, texts, seq_length=32):
    corpus = root / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", str(seq_length),
                 "--output", str(root / name)]) == 0
    return root / name


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run on ``data`` (checkpoint iter_0000002), and datasets to resume it on."""
    root = tmp_path_factory.mktemp("robust_runs")
    pack(root, "data", TEXTS)
    pack(root, "same_size", [t.swapcase() for t in TEXTS])  # other text, the same windows and segments
    pack(root, "seq64", TEXTS, seq_length=64)
    shutil.copytree(root / "data", root / "moved" / "data")  # the same dataset at another path
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": str(root / "run"), "data": {"path": str(root / "data"), "shuffle": False},
        "model": {"num_layers": 1, "hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2,
                  "num_query_groups": 1, "seq_length": 32, "attention_type": "anchor"},
        "trainer": {"max_steps": 2, "global_batch_size": 1, "precision": "fp32", "progress_bar": False},
        "optim": {"lr": 1e-3, "schedule": "constant"}}))
    assert main(["train", "--config", str(config)]) == 0
    return root


def resume(trained, tmp_path, *args):
    """Run `nemo-anchor train` again on a copy of the trained run; returns (exit status, copy)."""
    run = tmp_path / "run"
    if not run.exists():
        shutil.copytree(trained / "run", run)
    return main(["train", "--config", str(trained / "config.yaml"), f"output_dir={run}", *args]), run


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("nemo-anchor train: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overrides, message", [
    (["model.attention_type=full"], "model.attention_type was 'anchor', the new config has 'full'; it changes the run"),
    (["data.path={same_size}"], "data.path={same_size} is not the packed dataset it was trained on"),
    (["data.path={seq64}", "model.seq_length=64"], "model.seq_length was 32, the new config has 64"),
    (["trainer.seed=7"], "trainer.seed was 1234, the new config has 7"),
    (["optim.lr=0.5"], "optim.lr was 0.001, the new config has 0.5; to resume with the new value on purpose, "
                       "pass --allow-change optim.lr"),
    (["trainer.global_batch_size=2"], "--allow-change trainer.global_batch_size"),
])
def test_resume_that_changes_the_run_is_refused_naming_the_key(trained, tmp_path, capsys, overrides, message):
    paths = {"same_size": trained / "same_size", "seq64": trained / "seq64"}
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    before = snapshot(run)
    status, _ = resume(trained, tmp_path, *(o.format(**paths) for o in overrides))
    assert status == 2
    assert message.format(**paths) in error_line(capsys)
    assert snapshot(run) == before  # nothing written: config.yaml, checkpoints, metrics


def test_allowed_changes_apply_for_real(trained, tmp_path, capsys):
    # overrides on both sides of --allow-change (argparse's intermixed parsing)
    status, run = resume(trained, tmp_path, f"data.path={trained / 'moved' / 'data'}", "trainer.max_steps=3",
                         "--allow-change", "optim.lr", "optim.lr=0.5")
    assert status == 0
    out = capsys.readouterr().out
    assert "resuming iter_0000002 with" in out and "optim.lr: 0.001 -> 0.5" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lrs = {row["step"]: row["lr"] for row in rows if "lr" in row}
    assert lrs == {1: 1e-3, 2: 1e-3, 3: 0.5}  # the moved dataset is the same one; the new lr is used
    assert not (run / LOCK_FILE).exists()


def test_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    first = RunLease(tmp_path / LOCK_FILE)
    first.acquire()
    with pytest.raises(RunDirInUse, match=f"host {socket.gethostname()}, pid {os.getpid()}"):
        RunLease(tmp_path / LOCK_FILE).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    taker = RunLease(tmp_path / LOCK_FILE)
    taker.acquire()  # the holder is gone: stale
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    taker.release()


def test_runs_racing_for_a_stale_lock_get_it_once(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)}))
    # each racer waits for the same moment, tries, says how it went; the winner holds the lock until stdin closes
    script = ("import sys, time\nfrom nemo_anchor.run_lease import RunLease, RunDirInUse\n"
              "time.sleep(max(0.0, float(sys.argv[2]) - time.time()))\n"
              "try:\n    RunLease(sys.argv[1]).acquire(); print('won', flush=True); sys.stdin.read()\n"
              "except RunDirInUse:\n    print('refused', flush=True)\n")
    start = str(time.time() + 1.5)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    racers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / LOCK_FILE), start], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(6)]
    results = [racer.stdout.readline().strip() for racer in racers]
    for racer in racers:
        racer.communicate(timeout=60)
    assert sorted(results) == ["refused"] * 5 + ["won"], results


@pytest.fixture
def holder():
    """A live process of this host, as a run holding a lock."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process.pid
    process.kill()
    process.wait()


def test_second_training_into_a_run_in_use_is_refused(trained, tmp_path, capsys, holder):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder, "started": "now",
                                             "pid_started": process_start_time(holder)}))
    before = snapshot(run)
    status, _ = resume(trained, tmp_path, "trainer.max_steps=3")
    assert status == 2
    line = error_line(capsys)
    assert f"is in use by another training run (host {socket.gethostname()}, pid {holder}" in line
    assert f"kill -TERM {holder}" in line
    assert snapshot(run) == before and RunDir(run).list_checkpoints()[-1].name == "iter_0000002"


def test_data_whose_metadata_disagrees_with_its_tokenizer_leaves_no_run_folder(trained, tmp_path, capsys):
    lying = tmp_path / "lying"
    shutil.copytree(trained / "data", lying)
    metadata = json.loads((lying / "metadata.json").read_text())
    (lying / "metadata.json").write_text(json.dumps({**metadata, "vocab_size": 200}))
    status = main(["train", "--config", str(trained / "config.yaml"), f"output_dir={tmp_path / 'new'}",
                   f"data.path={lying}"])
    assert status == 2
    assert "metadata.json says vocab_size=200 but its tokenizer/ has 259 tokens" in error_line(capsys)
    assert not (tmp_path / "new").exists()


def test_user_error_under_torchrun_is_one_line_from_rank_0(trained, tmp_path, holder):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder,
                                             "pid_started": process_start_time(holder)}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(REPO / "scripts" / "pretrain.py"), "--config", str(trained / "config.yaml"),
                           f"output_dir={run}", "trainer.global_batch_size=2"], env=env, capture_output=True,
                          text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    errors = [line for line in output.splitlines() if "nemo-anchor train: error:" in line]
    assert len(errors) == 1 and f"pid {holder}" in errors[0], output[-3000:]
    assert "[rank0]" not in output and "[rank1]" not in output, output[-3000:]  # no per-rank traceback
    assert "exitcode  : 2" in output, output[-3000:]  # torchrun's report of the ranks' exit status


# ----------------------------------------------------------------- the lease: who may take a run folder over
UNSHARE = shutil.which("unshare")


def _unshare_permitted() -> bool:
    return UNSHARE is not None and subprocess.run([UNSHARE, "-u", "true"], capture_output=True).returncode == 0


needs_unshare = pytest.mark.skipif(not _unshare_permitted(), reason="another host is simulated with a UTS namespace "
                                   "(`unshare -u`), which needs root or user namespaces; not permitted here")

# a live holder renews this often (and is refused as soon as it is seen renewing)
FAST_LEASE = {"NEMO_ANCHOR_LEASE_RENEW_S": "0.2", "NEMO_ANCHOR_LEASE_TIMEOUT_S": "60"}

# holds the lease from another host until stdin closes: prints its record once it holds it
_HOLD = ("import json, sys\nfrom nemo_anchor.run_lease import RunLease\n"
         "lease = RunLease(sys.argv[1]); lease.acquire(); lease.start_renewing()\n"
         "print(json.dumps(lease.record), flush=True); sys.stdin.read(); lease.release()\n")


def _job_env(**variables):
    """os.environ without any scheduler's job variables, plus ``variables``."""
    jobs = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
    return {**{k: v for k, v in os.environ.items() if k not in jobs}, "PYTHONPATH": str(REPO), **variables}


@pytest.fixture
def other_host(tmp_path):
    """Start a holder of ``tmp_path/LOCK_FILE`` on host node7 (a UTS namespace); yields (process, its record)."""
    holders = []

    def start(lock=tmp_path / LOCK_FILE, **variables):
        process = subprocess.Popen([UNSHARE, "-u", "sh", "-c", 'hostname node7; exec "$@"', "sh", sys.executable,
                                    "-c", _HOLD, str(lock)], env=_job_env(**variables),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        holders.append(process)
        return process, json.loads(process.stdout.readline())

    yield start
    for process in holders:
        process.kill()
        process.wait()


@needs_unshare
def test_lease_of_a_live_run_on_another_host_is_refused_naming_host_pid_and_job(tmp_path, other_host, monkeypatch):
    _, record = other_host(SLURM_JOB_ID="41", **FAST_LEASE)
    assert record["host"] == "node7" and record["job"] == "slurm 41"
    monkeypatch.setenv("SLURM_JOB_ID", "42")  # another job
    with pytest.raises(RunDirInUse, match=f"host node7, pid {record['pid']}, job slurm 41") as refused:
        RunLease(tmp_path / LOCK_FILE).acquire()
    assert "kill" not in str(refused.value)  # that host's processes are not ours to signal
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == record["token"]


@needs_unshare
@pytest.mark.parametrize("variables, mine", [
    ({"SLURM_JOB_ID": "41"}, {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "1"}),  # Slurm requeued job 41
])  # torchrun's TORCHELASTIC_RUN_ID is a user's choice, never a requeue: tests/test_lease_rules.py
def test_requeued_job_takes_its_fresh_lease_over_at_once(tmp_path, other_host, monkeypatch, variables, mine):
    _, record = other_host(**variables)
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in mine.items():
        monkeypatch.setenv(name, value)
    lease = RunLease(tmp_path / LOCK_FILE)
    lease.acquire()  # node7's lease was renewed a moment ago: the scheduler has ended that run
    assert "was requeued" in lease.took_over and "host node7" in lease.took_over
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == lease.record["token"]
    lease.release()


@needs_unshare
def test_requeued_training_resumes_where_another_node_holds_the_lease(trained, tmp_path, other_host, monkeypatch,
                                                                      capsys):
    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    other_host(lock=run / LOCK_FILE, SLURM_JOB_ID="41")  # the job ran on node7 until the scheduler requeued it
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    status, _ = resume(trained, tmp_path, "trainer.max_steps=3")
    assert status == 0
    out = capsys.readouterr().out
    assert "took over the lease of host node7" in out and "its job slurm 41 was requeued" in out
    assert RunDir(run).list_checkpoints()[-1].name == "iter_0000003" and not (run / LOCK_FILE).exists()


@needs_unshare
def test_two_live_steps_of_one_job_are_not_a_requeue(tmp_path, other_host, monkeypatch):
    _, record = other_host(SLURM_JOB_ID="41", SLURM_RESTART_COUNT="2", **FAST_LEASE)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.raises(RunDirInUse, match="job slurm 41 restart 2"):
        RunLease(tmp_path / LOCK_FILE).acquire()


@needs_unshare
def test_lease_not_renewed_within_its_timeout_is_taken_over_from_any_host(tmp_path, other_host, monkeypatch):
    monkeypatch.setenv("NEMO_ANCHOR_LEASE_RENEW_S", "0.2")
    monkeypatch.setenv("NEMO_ANCHOR_LEASE_TIMEOUT_S", "1.5")
    holder, record = other_host(NEMO_ANCHOR_LEASE_RENEW_S="0.2", NEMO_ANCHOR_LEASE_TIMEOUT_S="1.5")
    with pytest.raises(RunDirInUse, match="host node7.*renewed while this run watched it"):
        RunLease(tmp_path / LOCK_FILE).acquire()  # watched until it renews
    holder.kill()  # node7 fails: nobody renews its lease, and its pid cannot be checked from here
    holder.wait()
    lease = RunLease(tmp_path / LOCK_FILE)
    lease.acquire()  # watched for 1.5 s (node7's timeout) by this host's clock, unchanged
    assert "not renewed while this run watched it" in lease.took_over
    lease.release()


def _eventually(condition, timeout_s: float = 120.0) -> bool:
    """Whether ``condition()`` comes true within ``timeout_s`` (polled): a wait for an event, not a sleep."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _lease_record(**fields):
    return {"host": socket.gethostname(), "started": "then", "renewed": time.time(), "timeout_s": 300.0,
            "token": "0123456789abcdef", **fields}


def test_lease_naming_this_runs_own_pid_from_an_earlier_life_is_taken_over(tmp_path):
    # a container restarted under the same hostname: this run got the pid its predecessor had
    (tmp_path / LOCK_FILE).write_text(json.dumps(_lease_record(pid=os.getpid(), pid_started=1.0e9)))
    lease = RunLease(tmp_path / LOCK_FILE)
    lease.acquire()
    assert f"pid {os.getpid()} is another process now" in lease.took_over
    lease.release()


def test_lease_naming_a_reused_pid_is_taken_over_and_never_advises_killing_it(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps(_lease_record(pid=1, pid_started=12345.0)))  # pid 1 started at boot
    lease = RunLease(tmp_path / LOCK_FILE)
    lease.acquire()
    assert "pid 1 is another process now" in lease.took_over
    lease.release()


def test_lease_held_by_this_same_process_is_refused_without_advising_to_kill_it(tmp_path):
    first = RunLease(tmp_path / LOCK_FILE)
    first.acquire()
    with pytest.raises(RunDirInUse, match="an earlier run in this same process") as refused:
        RunLease(tmp_path / LOCK_FILE).acquire()
    assert "kill" not in str(refused.value)
    first.release()


@pytest.mark.parametrize("pid", ["holder", 1])
def test_old_lock_without_start_time_naming_a_live_pid_is_kept_until_it_expires(tmp_path, holder, capsys, pid):
    pid = holder if pid == "holder" else pid  # pid 1 (init) is alive, and never the run
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))  # the previous format
    lease = RunLease(lock, renew_s=0.1, timeout_s=0.5)
    lease.acquire()  # watched for its timeout: nothing renewed it
    assert "may be another process now" in lease.took_over
    err = capsys.readouterr().err
    assert f"records no start time for pid {pid}" in err and "kill" not in err
    lease.release()


def test_renewal_stops_when_the_lease_was_taken_over(tmp_path):
    # a timeout far above the renewal interval: on a loaded machine a renewal late by the timeout gives the lease up
    lease = RunLease(tmp_path / LOCK_FILE, renew_s=0.1, timeout_s=60)
    lease.acquire()
    lease.start_renewing()
    first = json.loads((tmp_path / LOCK_FILE).read_text())["renewed"]
    assert _eventually(lambda: json.loads((tmp_path / LOCK_FILE).read_text())["renewed"] > first)
    (tmp_path / LOCK_FILE).write_text(json.dumps(_lease_record(pid=1, token="another run")))  # taken over
    assert lease.lost.wait(timeout=5)
    lease.release()  # not this one's any more: left alone
    assert json.loads((tmp_path / LOCK_FILE).read_text())["token"] == "another run"


def test_lease_removed_while_its_run_lives_is_lost_and_never_written_again(tmp_path, capsys):
    lease = RunLease(tmp_path / LOCK_FILE, renew_s=0.05, timeout_s=1.0)
    lease.acquire()
    lease.start_renewing()
    (tmp_path / LOCK_FILE).unlink()  # by hand, or by a run that judged it stale and is about to take it
    assert lease.lost.wait(timeout=60)
    assert not (tmp_path / LOCK_FILE).exists()  # a renewal never makes it again: the folder may be another run's
    assert f"this run no longer holds {tmp_path / LOCK_FILE} ({tmp_path / LOCK_FILE} was removed)" in \
        capsys.readouterr().err
    lease.release()


@pytest.mark.parametrize("variables, message", [
    ({"NEMO_ANCHOR_LEASE_RENEW_S": "soon"}, "NEMO_ANCHOR_LEASE_RENEW_S='soon' is not a positive number of seconds"),
    ({"NEMO_ANCHOR_LEASE_TIMEOUT_S": "-1"}, "NEMO_ANCHOR_LEASE_TIMEOUT_S='-1' is not a positive number"),
    ({"NEMO_ANCHOR_LEASE_RENEW_S": "60", "NEMO_ANCHOR_LEASE_TIMEOUT_S": "90"}, "must be at least twice"),
])
def test_bad_lease_timing_is_named(tmp_path, monkeypatch, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        RunLease(tmp_path / LOCK_FILE)


def test_run_whose_lease_was_taken_over_stops_without_writing(trained, tmp_path, capsys, monkeypatch):
    from nemo_anchor.training.loop import Trainer

    run = tmp_path / "run"
    intruder = json.dumps(_lease_record(pid=1, token="another run"))
    train_step = Trainer.train_step

    def step_then_taken_over(self, stop=None):  # another run takes the lease over while step 1 runs (its lease looked expired)
        result = train_step(self, stop)
        if self.step == 1:
            (run / LOCK_FILE).write_text(intruder)
        return result

    monkeypatch.setattr(Trainer, "train_step", step_then_taken_over)
    # renewed every 30 s (the default): the takeover must be seen before the next write, not at the next renewal
    status = main(["train", "--config", str(trained / "config.yaml"), f"output_dir={run}", "trainer.max_steps=3",
                   "checkpoint.save_every=1"])
    assert status == 2
    assert "another run took this run's lease over; this run stops at step 1 without saving" in error_line(capsys)
    assert run.is_dir() and (run / LOCK_FILE).read_text() == intruder  # the folder and the lease are the other run's
    assert not RunDir(run).list_checkpoints()  # nothing saved after the lease was lost


def test_run_that_loses_its_lease_during_a_save_does_not_publish_it(trained, tmp_path, capsys, monkeypatch):
    """The lease is lost between a save's write and its publish (a run paused past its lease timeout, then resumed):
    the trainer's fence reads the lease file before the rename, so nothing is published into the other run's
    folder, and the run stops saying so."""
    from nemo_anchor.training.checkpoint_saver import CheckpointSaver

    run = tmp_path / "run"
    intruder = json.dumps(_lease_record(pid=1, token="another run"))
    save = CheckpointSaver.save

    def save_then_taken_over(self, *args, **kwargs):
        final = save(self, *args, **kwargs)
        (run / LOCK_FILE).write_text(intruder)
        return final

    monkeypatch.setattr(CheckpointSaver, "save", save_then_taken_over)
    status = main(["train", "--config", str(trained / "config.yaml"), f"output_dir={run}", "trainer.max_steps=3",
                   "checkpoint.save_every=1"])
    assert status == 2
    err = capsys.readouterr().err
    assert f"output_dir {run}: this run does not publish iter_0000001: it does not hold its lease" in err
    assert (run / LOCK_FILE).read_text() == intruder
    assert not RunDir(run).list_checkpoints() and not RunDir(run).latest_file.exists()
