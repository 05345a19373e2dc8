"""A resume compares the training data by content: pack records the XXH3-128 of every file it writes, computed
from the bytes as they are written, and the fingerprint a checkpoint saves covers them."""
import json
import shutil

import pytest
import xxhash

from nemo_anchor.data.layout import METADATA_FILE
from nemo_anchor.run_dir import RunDir
from tiny_runs import pack_texts, train_tiny  # tests/tiny_runs.py

DOCUMENT = "Sphinx of black quartz, judge my vow. " * 50  # 1,900 bytes: 98 documents pass the 64 KiB ends twice over


def _texts(middle: str) -> list[str]:
    texts = [DOCUMENT] * 98
    texts[49] = middle
    return texts


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Two packings of the same input file that differ only in one document in the middle (same length)."""
    root = tmp_path_factory.mktemp("fingerprint")
    first = pack_texts(root, _texts(DOCUMENT), name="first")
    second = pack_texts(root, _texts(DOCUMENT.upper()), name="second")
    return root, first, second


def test_pack_records_every_file_it_writes_with_its_size_and_digest(packed):
    _, first, _ = packed
    recorded = json.loads((first / METADATA_FILE).read_text())["checksums"]
    on_disk = {str(p.relative_to(first)) for p in first.rglob("*") if p.is_file()}
    # the rest describe the whole dataset (statistics, histogram, the output marker), not the split's data
    expected = on_disk - {METADATA_FILE, "stats.json", "document_lengths.png", ".nemo-anchor-output.json"}
    assert set(recorded) == expected
    recomputed = {name: [(first / name).stat().st_size,
                         f"xxh3-128:{xxhash.xxh3_128((first / name).read_bytes()).hexdigest()}"]
                  for name in sorted(expected)}
    assert recorded == recomputed  # recomputed from the files as they are on disk


def test_a_resume_on_data_changed_only_in_the_middle_is_refused(packed, tmp_path, capsys):
    root, first, second = packed
    assert (first / "tokens.bin").stat().st_size > 4 * 65536  # the change lies outside the first and last 64 KiB
    head = (first / "tokens.bin").read_bytes(), (second / "tokens.bin").read_bytes()
    assert head[0][:65536] == head[1][:65536] and head[0][-65536:] == head[1][-65536:] and head[0] != head[1]
    assert train_tiny(tmp_path / "run", first, max_steps=2) == 0
    capsys.readouterr()
    assert train_tiny(tmp_path / "run", second, f"data.path={second}", max_steps=4) == 2
    assert f"data.path={second} is not the packed dataset it was trained on" in capsys.readouterr().err


def test_a_moved_dataset_resumes_and_the_new_data_path_is_reported(packed, tmp_path, capsys):
    _, first, _ = packed
    moved = shutil.copytree(first, tmp_path / "moved")
    assert train_tiny(tmp_path / "run", first, max_steps=2) == 0
    capsys.readouterr()
    assert train_tiny(tmp_path / "run", moved, f"data.path={moved}", "data.valid_path=" + str(moved), max_steps=4) == 0
    out = capsys.readouterr().out
    resumed = next(line for line in out.splitlines() if line.startswith("resuming"))
    assert f"data.path: '{first}' -> '{moved}'" in resumed and f"data.valid_path: None -> '{moved}'" in resumed
    assert RunDir(tmp_path / "run").latest_file.read_text() == "4"
