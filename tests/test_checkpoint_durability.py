"""Nothing silently lost (issue 43): retention, a stop's checkpoint, publishing, the fence.

- Retention keeps the newest ``keep_last`` checkpoints and the newest ``keep_last`` scheduled ones, scheduled as each
  checkpoint recorded at its save: a resume that changes ``save_every`` keeps the earlier saves, a stop's extra save
  neither is evicted while among the newest nor pushes out a scheduled one.
- A stop's checkpoint whose bytes changed on the disk (same size) before the next start is not used.
- Publishing fsyncs every file and the folder before the rename, and the rename and ``latest`` before an eviction
  (a real save traced with strace).
- A ``fence`` that says no leaves the run folder as it was.
"""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from nemo_anchor import checksums
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import checkpoint_saver
from nemo_anchor.training.checkpoint import SCHEDULED
from nemo_anchor.training.checkpoint_saver import CheckpointSaver, checkpoints_to_evict
from nemo_anchor.training.config import load_config
from nemo_anchor.training.loop import Trainer
from tiny_runs import REPO, child_environment, pack_texts, tiny_config, train_tiny  # tests/tiny_runs.py


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return pack_texts(tmp_path_factory.mktemp("durability"))


def _trainer(root, data, *overrides, max_steps=10) -> Trainer:
    return Trainer(load_config(tiny_config(root, data, max_steps=max_steps), list(overrides)))


def _steps(root) -> list[int]:
    return [checkpoint_step(path) for path in RunDir(root).list_checkpoints()]


def test_a_resume_that_changes_save_every_keeps_the_earlier_checkpoints(data, tmp_path):
    """The issue's run: every 2 steps to step 6 (keep 3), resumed to step 10 saving every 5."""
    run = tmp_path / "run"
    assert train_tiny(run, data, "checkpoint.save_every=2", "checkpoint.keep_last=3", max_steps=6) == 0
    assert _steps(run) == [2, 4, 6]
    assert train_tiny(run, data, "checkpoint.save_every=5", "checkpoint.keep_last=3", max_steps=10) == 0
    assert _steps(run) == [4, 6, 10]  # today's main: [10], the others judged off-schedule by save_every=5 and evicted


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """A run saving every step to step 6 with save_every=2 (steps 1, 3, 5 saved as a stop saves them, off-schedule),
    nothing evicted."""
    root = tmp_path_factory.mktemp("saved") / "run"
    trainer = _trainer(root, data, "checkpoint.save_every=2", "checkpoint.keep_last=10")
    try:
        for step in range(1, 7):
            trainer.train_step()
            trainer.save(read_back=step % 2 == 0)
        trainer.saver.finish()
    finally:
        trainer.saver.close()
        trainer._release(failed=False)
    return RunDir(root)


def _run_with(saved, tmp_path, steps) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    for step in steps:
        shutil.copytree(saved.checkpoint(step), run.checkpoint(step))
    return run


def _evicted(run, keep_last) -> list[int]:
    return [checkpoint_step(path) for path in checkpoints_to_evict(run, keep_last)]


def test_a_stops_extra_save_is_kept_among_the_newest_and_pushes_out_no_scheduled_one(saved, tmp_path):
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(saved.checkpoint(5)))
    assert common["train"][SCHEDULED] is False  # recorded at the save
    run = _run_with(saved, tmp_path, [2, 4, 5, 6])
    # the newest two (5, 6) and the newest two scheduled (4, 6); today's main evicts 5 as well, though it is
    # among the newest keep_last (its rule keeps an off-schedule checkpoint only while it is the newest)
    assert _evicted(run, keep_last=2) == [2]
    assert _evicted(run, keep_last=1) == [2, 4, 5]  # keep_last changed between runs: the newest one only
    # a stop after the last scheduled save: the scheduled ones averaging needs stay
    assert _evicted(_run_with(saved, tmp_path / "b", [1, 2, 3, 4, 5]), keep_last=2) == [1, 3]  # 2, 4 and 5 kept


def test_checkpoints_saved_before_the_record_count_as_scheduled(saved, tmp_path):
    run = _run_with(saved, tmp_path, [3, 5, 6])
    for step in (3, 5):  # as an earlier version saved them: no SCHEDULED in the train state
        common = run.checkpoint(step) / "common.pt"
        state = torch.load(common, weights_only=False)
        del state["train"][SCHEDULED]
        torch.save(state, common)
    assert _evicted(run, keep_last=2) == [3]  # 5 and 6 are the newest two, scheduled or not


def _flip_bytes(path, count=9):
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        chunk = handle.read(count)
        handle.seek(path.stat().st_size // 2)
        handle.write(bytes(255 - b for b in chunk))


def test_a_stop_checkpoint_damaged_before_the_next_start_is_not_used(data, tmp_path, capsys):
    root = tmp_path / "run"
    trainer = _trainer(root, data)
    try:
        trainer.train_step()
        trainer.save()
        trainer.train_step()
        trainer.save(read_back=False)  # SIGTERM's save: nothing read back
    finally:
        trainer.saver.close(wait_for_deletions=False)
        trainer._release(failed=False)
    first, second = RunDir(root).list_checkpoints()
    manifest = json.loads((second / checksums.CHECKSUMS).read_text())
    assert manifest[checksums.RECORDED] == checksums.AS_WRITTEN
    shard = max(second.glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip_bytes(shard)  # a bad sector, a faulty copy: the size is unchanged
    capsys.readouterr()
    trainer = _trainer(root, data)
    try:  # today's main digests the damaged files at this start and resumes from them
        assert trainer.resumed_from == first and trainer.step == 1
        out = capsys.readouterr().out
        assert f"warning: cannot resume from {second.name}: {shard} is corrupt: its XXH3-128 differs" in out
    finally:
        trainer.saver.close()
        trainer._release(failed=False)


_TRACED = ("openat", "fsync", "fdatasync", "rename", "renameat", "renameat2")


def _trace(log: str):
    """(syscall, path, second path) of each traced call, in order; fsync's path is the one its fd was opened on."""
    import re

    opened, events = {}, []
    for line in log.splitlines():
        match = re.match(r"(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)", line)
        if not match or int(match.group(4)) < 0:
            continue
        pid, call, args, result = match.group(1), match.group(2), match.group(3), int(match.group(4))
        paths = re.findall(r'"([^"]*)"', args)
        if call == "openat":
            opened[(pid, result)] = paths[0]
        elif call in ("fsync", "fdatasync"):
            events.append(("fsync", opened.get((pid, int(args.split(",")[0])), "?"), None))
        elif call.startswith("rename"):
            events.append(("rename", paths[0], paths[1]))
    return events


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
def test_a_checkpoint_is_on_the_disk_before_it_is_published_and_before_anything_older_is_evicted(data, tmp_path):
    """A real run of three steps, saving each and keeping one, traced with ``strace -f`` (its writer processes too):
    every file of the third checkpoint and its folder are fsynced before the folder is renamed into place; the
    rename (checkpoints/ fsynced) and latest come before the second checkpoint is renamed away."""
    run = RunDir(tmp_path / "run")
    config = tiny_config(run.root, data, max_steps=3)
    log = tmp_path / "strace.log"
    subprocess.run(["strace", "-f", "-qq", "-e", f"trace={','.join(_TRACED)}", "-o", str(log), sys.executable, "-m",
                    "nemo_anchor.cli", "train", "--config", str(config), "checkpoint.save_every=1",
                    "checkpoint.keep_last=1"], env=child_environment(), cwd=REPO, check=True, capture_output=True)
    events = _trace(log.read_text())
    checkpoints, final = str(run.checkpoints.resolve()), run.checkpoint(3).resolve()
    staging = f"{checkpoints}/.tmp.{final.name}"
    publish = events.index(("rename", staging, str(final)))
    synced_before = {path for call, path, _ in events[:publish] if call == "fsync"}
    files = sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())
    assert {"common.pt", "metadata.json", ".metadata", "config.yaml", checksums.CHECKSUMS} <= set(files)
    for name in files:  # each under the name it was written with: staged and renamed, or written in place
        written_as = [path for call, path, target in events[:publish] if call == "rename" and target ==
                      f"{staging}/{name}"] or [f"{staging}/{name}"]
        assert written_as[-1] in synced_before, f"{name} was not fsynced before the publish"
    last_entry = max(i for i, (call, _, target) in enumerate(events[:publish]) if call == "rename"
                     and target.startswith(f"{staging}/"))
    assert ("fsync", staging, None) in events[last_entry:publish]  # the folder, after its last entry
    evicted = next(i for i, (call, source, target) in enumerate(events) if call == "rename"
                   and source == str(run.checkpoint(2).resolve()) and "/.deleting." in target)
    latest = next(i for i, (call, _, target) in enumerate(events) if call == "rename"
                  and target == str(run.latest_file.resolve()) and i > publish)
    assert ("fsync", checkpoints, None) in events[publish:latest]  # the rename into place
    assert events[latest - 1][0] == "fsync"  # latest's staged file
    assert ("fsync", checkpoints, None) in events[latest:evicted]  # latest's rename, before the eviction
    assert _steps(run.root) == [3]


class _Fence:
    """A fence on the run folder that says no to the acts starting with one of ``refused`` (what a run that lost its
    lease meets); it records every act it is asked about."""

    def __init__(self, *refused):
        self.refused, self.asked = refused, []

    def __call__(self, act: str) -> bool:
        self.asked.append(act)
        allowed = not act.startswith(self.refused)
        if not allowed:
            print(f"not allowed to {act}: the run folder's lease is lost")
        return allowed


def _listing(run: RunDir) -> dict:
    return {str(p.relative_to(run.root)): p.stat().st_size if p.is_file() else None
            for p in sorted(run.root.rglob("*")) if "metrics" not in p.name}


def test_a_fence_that_says_no_leaves_the_run_folder_as_it_was(data, tmp_path):
    root = tmp_path / "run"
    trainer = _trainer(root, data, "checkpoint.keep_last=1")
    run = trainer.run
    leftover = run.checkpoints / ".tmp.iter_0000009"
    try:
        trainer.train_step()
        trainer.save()
        assert trainer.saver.finish() == run.checkpoint(1)
        leftover.mkdir()
        before = _listing(run)
        fence = _Fence("publish", "evict", "remove")
        trainer.saver = CheckpointSaver(run, keep_last=1, fence=fence)
        assert trainer.saver.remove_leftovers() == [] and leftover.is_dir()
        trainer.train_step()
        trainer.save()
        assert trainer.saver.finish() is None  # not published
        staged = run.checkpoints / ".tmp.iter_0000002"  # written before the publish; the next start removes it
        assert {k: v for k, v in _listing(run).items() if not k.startswith(str(staged.relative_to(root)))} == before
        assert _steps(root) == [1] and run.latest_file.read_text() == "1"
        assert fence.asked == ["remove leftovers", "publish iter_0000002"]
        fence.refused = ("evict",)  # published and named latest, but iter_1 may not be evicted
        trainer.train_step()
        trainer.save()
        assert trainer.saver.finish() == run.checkpoint(3)
        assert fence.asked[2:] == ["publish iter_0000003", "name iter_0000003 latest", "evict iter_0000001"]
        assert _steps(root) == [1, 3] and run.latest_file.read_text() == "3"
    finally:
        trainer.saver.close()
        trainer._release(failed=False)
