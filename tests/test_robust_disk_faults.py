"""A full disk, a read-only run folder: the error names the output and the cause in one line, the
partial output is removed and the earlier output is intact (real small file systems where this user
may mount them, the same faults raised by hand everywhere)."""
import errno
import os
import subprocess
import uuid

import pytest

from nemo_anchor.atomic import OutputError, atomic_directory, atomic_file
from nemo_anchor.cli import main
from nemo_anchor.run_dir import RunDir, checkpoint_step
from tiny_runs import TEXTS, pack_texts, train_tiny  # tests/tiny_runs.py


def _mount(path, options):
    path.mkdir(exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    except OSError:
        done = None
    if done is None or done.returncode:
        pytest.skip("this user cannot mount a small file system")
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A function mounting a tmpfs of the given KiB; unmounted afterwards."""
    mounted = []

    def make(kib):
        mounted.append(_mount(tmp_path / f"disk{len(mounted)}", f"size={kib}k"))
        return mounted[-1]
    yield make
    for path in mounted:
        subprocess.run(["umount", "--lazy", str(path)], check=False)  # the failed trainer may hold files open


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_faults")
    packed = pack_texts(root, [t + str(i) for i, t in enumerate(TEXTS * 20)], name="packed")
    return root / "corpus.jsonl", packed


def train(output_dir, data_path, *overrides):
    """(status, error line): the trainer's one-line error, whether it is printed or raised."""
    try:
        return train_tiny(output_dir, data_path, *overrides), ""
    except OutputError as error:
        return 2, str(error)


def _kib_used(path):
    return int(subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True).stdout.split()[0])


def test_pack_on_a_full_disk_names_the_output_and_leaves_nothing(corpus, small_disk, capsys):
    disk = small_disk(300)
    status = main(["pack", "--input", str(corpus[0]), "--tokenizer", "byte", "--seq-length", "64",
                   "--output", str(disk / "packed")])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err == f"nemo-anchor pack: error: cannot write {disk / 'packed'}: no space left on device"
    assert list(disk.iterdir()) == []  # the staging directory is gone


def test_checkpoint_save_on_a_full_disk_keeps_the_previous_checkpoint(corpus, tmp_path, small_disk, capsys):
    # the same run on a disk that holds the run after step 2 and half a checkpoint more
    assert train(tmp_path / "measure", corpus[1], "trainer.max_steps=2")[0] == 0
    checkpoint = RunDir(tmp_path / "measure").list_checkpoints()[-1]
    disk = small_disk(_kib_used(tmp_path / "measure") + _kib_used(checkpoint) // 2)
    status, error = train(disk / "run", corpus[1])
    error = error or capsys.readouterr().err
    saved = RunDir(disk / "run")
    assert status != 0 and f"cannot write {saved.checkpoint(4)}: no space left on device" in error
    assert sorted(p.name for p in saved.checkpoints.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert checkpoint_step(saved.list_checkpoints()[-1]) == 2 and saved.latest_file.read_text() == "2"


def test_resume_in_a_read_only_run_folder_names_the_run_folder(corpus, tmp_path, capsys):
    run = tmp_path / "ro_run"
    assert train(run, corpus[1], "trainer.max_steps=2")[0] == 0
    if os.geteuid() == 0:  # permissions do not stop root: make the file system itself read-only
        subprocess.run(["mount", "--bind", str(run), str(run)], check=False)
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(run)], capture_output=True).returncode:
            subprocess.run(["umount", str(run)], check=False)
            pytest.skip("this user cannot make a read-only file system")
    else:
        run.chmod(0o555)
    try:
        status, error = train(run, corpus[1])
        error = error or capsys.readouterr().err
    finally:
        subprocess.run(["umount", "--lazy", str(run)], check=False) if os.geteuid() == 0 else run.chmod(0o755)
    assert status != 0
    assert f"cannot write {run}: read-only file system" in error and "staging" not in error  # its lock, first
    assert [checkpoint_step(p) for p in RunDir(run).list_checkpoints()] == [2]


@pytest.mark.parametrize("code,why", [(errno.ENOSPC, "no space left on device"), (errno.EDQUOT, "disk quota exceeded"),
                                      (errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied")])
def test_disk_faults_are_named_for_the_output_on_any_file_system(tmp_path, code, why):
    """The same translation without a small disk: the fault as the OS raises it, on the staging path."""
    target = tmp_path / "out"
    with pytest.raises(OutputError, match=f"^cannot write {target}: {why}$"):
        with atomic_directory(target) as staging:
            raise OSError(code, os.strerror(code), str(staging / "tokens.bin"))
    with pytest.raises(OutputError, match=f"^cannot write {target / 'x.json'}: {why}$"):
        with atomic_file(target / "x.json") as staging:
            raise OSError(code, os.strerror(code), str(staging))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and list(target.iterdir()) == []  # no staging left


def test_a_fault_reading_an_input_is_not_blamed_on_the_output(tmp_path):
    source = tmp_path / "elsewhere" / f"{uuid.uuid4().hex}.jsonl"
    with pytest.raises(PermissionError):
        with atomic_directory(tmp_path / "outputs" / "out"):
            raise PermissionError(errno.EACCES, "Permission denied", str(source))
    assert not (tmp_path / "outputs" / "out").exists()
