"""`nemo-anchor export-hf` as a user runs it: outputs that would swallow inputs, --overwrite, permissions."""
import json
import os

import pytest

from nemo_anchor.cli import main
from nemo_anchor.export.hf import import_hf


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_byte_llama):
    """runs/A (an import-hf run directory with a metrics file, as after training) and its neighbour runs/B."""
    root = tmp_path_factory.mktemp("robust_export")
    hf = root / "hf"
    tiny_byte_llama(hf, max_positions=32)
    for name in ("A", "B"):
        import_hf(hf, root / "runs" / name)
        (root / "runs" / name / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return root / "runs"


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_output_that_is_or_contains_the_checkpoint_is_refused(runs, capsys):
    before = snapshot(runs)
    assert main(["export-hf", str(runs / "A"), str(runs / "A"), "--overwrite"]) == 2
    assert f"output {runs / 'A'} is the input {runs / 'A'}" in capsys.readouterr().err
    assert main(["export-hf", str(runs / "A"), str(runs), "--overwrite"]) == 2
    assert f"output {runs} contains the input {runs / 'A'}" in capsys.readouterr().err
    assert main(["export-hf", str(runs / "A"), str(runs / "A" / "hf")]) == 2
    assert "lies inside the input" in capsys.readouterr().err
    assert snapshot(runs) == before  # every checkpoint and metrics file of both runs is still there


def test_overwrite_replaces_an_earlier_export_only(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert main(["export-hf", str(runs / "A"), str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}["model.safetensors"] == 0o644
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir())
    assert main(["export-hf", str(runs / "A"), str(out)]) == 2 and "already exists" in capsys.readouterr().err
    assert main(["export-hf", str(runs / "A"), str(out), "--overwrite", "--dtype", "bfloat16"]) == 0
    written = json.loads((out / "config.json").read_text())
    assert written.get("dtype", written.get("torch_dtype")) == "bfloat16"  # the new export replaced the old one
    (out / "README.md").write_text("my model card")
    assert main(["export-hf", str(runs / "A"), str(out), "--overwrite"]) == 2
    assert f"{out / 'README.md'}" in capsys.readouterr().err
    assert (out / "README.md").read_text() == "my model card" and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging left beside it


def test_output_parent_that_is_a_file(runs, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    assert main(["export-hf", str(runs / "A"), str(tmp_path / "afile" / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'afile'} is a file" in err and "Traceback" not in err


def test_overwrite_refuses_an_export_whose_content_was_edited(runs, tmp_path, capsys):
    """The marker records each file's size and SHA-256: an edit that keeps every name (and here the size) is seen."""
    out = tmp_path / "hf"
    assert main(["export-hf", str(runs / "A"), str(out)]) == 0
    marker = json.loads((out / ".nemo-anchor-output.json").read_text())["files"]
    assert marker["config.json"]["bytes"] == (out / "config.json").stat().st_size
    edited = (out / "config.json").read_text().replace('"silu"', '"gelu"')  # the user's own change, same size
    assert edited != (out / "config.json").read_text()
    (out / "config.json").write_text(edited)
    assert main(["export-hf", str(runs / "A"), str(out), "--overwrite"]) == 2
    assert f"{out / 'config.json'} changed since `nemo-anchor export-hf` wrote it" in capsys.readouterr().err
    assert (out / "config.json").read_text() == edited
    (out / "config.json").write_text(edited.replace('"gelu"', '"silu"'))  # put back as written: replaced again
    assert main(["export-hf", str(runs / "A"), str(out), "--overwrite"]) == 0
