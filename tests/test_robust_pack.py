"""`nemo-anchor pack` as a user runs it, with bad outputs, bad options and signals: nothing is lost."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


from nemo_anchor.atomic import MARKER
from nemo_anchor.cli import main
from nemo_anchor.data import PackedDataset

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def write_corpus(path: Path, documents: int = 30, words: int = 20) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": " ".join(WORDS[(d + w) % len(WORDS)] for w in range(words))}) + "\n"
                            for d in range(documents)))
    return path


def pack(corpus, output, *extra):
    return main(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "32", "--output", str(output),
                 *map(str, extra)])


def staging_left(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.endswith(("nemo-anchor-staging", "nemo-anchor-retired"))]


def test_output_that_is_the_input_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "X.jsonl")
    before = corpus.read_bytes()
    assert pack(corpus, corpus, "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"output {corpus} is the input" in err and "Traceback" not in err
    assert corpus.read_bytes() == before


def test_output_folder_holding_the_input_is_refused(tmp_path, capsys):
    folder = tmp_path / "D"
    corpus = write_corpus(folder / "X.jsonl")
    (folder / "notes.txt").write_text("unrelated")
    assert pack(corpus, folder, "--overwrite") == 2
    assert f"output {folder} contains the input {corpus}" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["X.jsonl", "notes.txt"]
    assert pack(folder, folder / "packed") == 2  # an output inside an input folder would be read back next time
    assert "lies inside the input" in capsys.readouterr().err
    assert not (folder / "packed").exists()


def test_overwrite_replaces_only_what_pack_wrote(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "X.jsonl")
    out = tmp_path / "out"
    assert pack(corpus, out) == 0
    assert pack(corpus, out) == 2 and "already exists" in capsys.readouterr().err
    assert pack(corpus, out, "--overwrite") == 0  # its own output: replaced
    (out / "user.txt").write_text("mine")
    assert pack(corpus, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert f"{out / 'user.txt'}" in err and "did not write" in err
    assert (out / "user.txt").read_text() == "mine" and len(PackedDataset(out)) > 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    assert pack(corpus, other, "--overwrite") == 2
    assert f"{other} was not written by nemo-anchor" in capsys.readouterr().err
    assert (other / "thesis.tex").read_text() == "years of work" and not staging_left(tmp_path)


def test_outputs_get_the_users_permissions(tmp_path):
    corpus = write_corpus(tmp_path / "X.jsonl")
    old = os.umask(0o022)
    try:
        assert pack(corpus, tmp_path / "out") == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == 0o755 and (out / "tokenizer").stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {0o644}
    assert set(json.loads((out / MARKER).read_text())["files"]) == {str(p.relative_to(out)) for p in out.rglob("*")
                                                                    if p.name != MARKER}


def test_options_are_bound_checked_before_tokenizing(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "X.jsonl")
    for option, value in (("--seq-length", "99999999999"), ("--interleave-chunks", "1000000000"), ("--seed", "-1")):
        assert main(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "32",
                     "--output", str(tmp_path / "out"), option, value]) == 2
        err = capsys.readouterr().err
        assert option[2:].replace("-", "_") in err and value in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.jsonl"]


def test_unwritable_output_locations_are_named(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "X.jsonl")
    blocker = tmp_path / "afile"
    blocker.write_text("")
    assert pack(corpus, blocker / "out") == 2
    assert f"{blocker} is a file, not a directory" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        readonly = tmp_path / "ro"
        readonly.mkdir(mode=0o555)
        assert pack(corpus, readonly / "out") == 2
        err = capsys.readouterr().err
        assert f"no permission to write in {readonly}" in err and "staging" not in err


def test_stale_staging_of_a_dead_run_is_removed(tmp_path):
    corpus = write_corpus(tmp_path / "X.jsonl")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.{socket.gethostname()}.{dead.pid}.deadbeef.nemo-anchor-staging"
    (stale / "nemo").mkdir(parents=True)
    (stale / "tokens.bin").write_bytes(b"\0" * 1000)
    live = tmp_path / f".out.{socket.gethostname()}.{os.getpid()}.cafecafe.nemo-anchor-staging"
    live.mkdir()  # a run still going on: left alone
    assert pack(corpus, tmp_path / "out") == 0
    assert not stale.exists() and live.exists()


def test_sigterm_during_pack_leaves_nothing_behind(tmp_path):
    corpus = write_corpus(tmp_path / "big.jsonl", documents=1500, words=400)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-m", "nemo_anchor.cli", "pack", "--input", str(corpus),
                             "--tokenizer", "byte", "--seq-length", "64", "--output", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not staging_left(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert staging_left(tmp_path), "pack finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert not out.exists() and not staging_left(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]
