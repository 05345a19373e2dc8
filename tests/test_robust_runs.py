"""One training run per output_dir, and a resume that changes nothing without saying so.

- a second run into an output_dir in use is refused naming the holder (host, pid); a lock left by
  a dead process is taken over, by exactly one of the runs racing for it;
- a resume is compared with the checkpoint's config before anything is written: a change of the
  model, the attention, the data (by content, so a same-sized other dataset is caught) or the
  window is refused naming the key and both values; the LR schedule and batch size change only
  when allowed (``--allow-change``), and then for real;
- these refusals are one line, ``nemo-anchor train: error: ...``, exit status 2; under torchrun
  from rank 0 only.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from nemo_anchor.cli import main
from nemo_anchor.run_dir import LOCK_FILE, RunDir, RunDirInUse, RunLease

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
    status, run = resume(trained, tmp_path, f"data.path={trained / 'moved' / 'data'}", "trainer.max_steps=3",
                         "optim.lr=0.5", "--allow-change", "optim.lr")
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
    script = ("import sys, time\nfrom nemo_anchor.run_dir import RunLease, RunDirInUse\n"
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
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder, "started": "now"}))
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
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": holder}))
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
