"""``nemo-anchor plan`` on absurd input: closed-form work, every input validated, the whole layout search."""
import json
import math
import random
import signal
from pathlib import Path

import pytest

from nemo_anchor.cli import main as cli
from nemo_anchor.training import memory

PAPER = str(Path(__file__).resolve().parents[1] / "configs" / "paper" / "llama2-7b-128k.yaml")


def _walk_every_parameter(groups, data_parallel):
    """Megatron's ``_ParamAndGradBuffer`` layout, one parameter at a time (reverse order, 64-aligned
    starts, buckets closed at bucket_size and padded to lcm(dp, 128)): the reference for the closed form."""
    bucket_size = max(memory._BUCKET_BASE, memory._BUCKET_PER_RANK * data_parallel)
    divisor = math.lcm(data_parallel, 128)
    numels = [n for pattern, repeats in groups for _ in range(repeats) for n in pattern]
    start = bucket_start = 0
    for numel in reversed(numels):
        start = -(-start // 64) * 64 + numel
        if start - bucket_start >= bucket_size:
            start = bucket_start = -(-start // divisor) * divisor
    return -(-start // divisor) * divisor if start > bucket_start else start


@pytest.mark.parametrize("seed", range(40))
def test_closed_form_buffer_equals_the_parameter_by_parameter_layout(monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(memory, "_BUCKET_BASE", rng.choice([500, 3_000, 20_000, 10 ** 9]))
    monkeypatch.setattr(memory, "_BUCKET_PER_RANK", rng.choice([0, 7, 100]))
    layer = [rng.choice([1, 63, 64, 65, 200, 1_000, 4_096, 9_000]) for _ in range(rng.randint(1, 8))]
    groups = [([rng.randint(1, 5_000)], 1), (layer, rng.randint(1, 300)), ([rng.randint(1, 300), 7], 1)]
    data_parallel = rng.choice([1, 2, 3, 8, 96, 1000])
    assert memory._padded_buffer_elements(groups, data_parallel) == _walk_every_parameter(groups, data_parallel)


def _hang_guard(seconds: int):
    def fail(*_):
        raise TimeoutError(f"nemo-anchor plan took more than {seconds} s")
    signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)


@pytest.mark.parametrize("argv", [["--gpus", "8000000"], ["--gpus", "8", "model.num_layers=100000"],
                                  ["--gpus", "64", "model.num_layers=100000", "model.pipeline_model_parallel_size=8",
                                   "model.recompute=none", "model.recompute_num_layers=null"]])
def test_plan_answers_absurd_sizes_at_once(argv, capsys):
    """The work does not grow with the data-parallel size or the layer count (on main these never answered)."""
    _hang_guard(20)
    try:
        status = cli(["plan", "--config", PAPER, "--gpu-memory", "80", *argv])
    finally:
        signal.alarm(0)
    out = capsys.readouterr().out
    assert status in (0, 1) and "total" in out


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "0"], "argument --gpus: '0' is not a positive whole number of GPUs"),
    (["--gpus", "-8"], "argument --gpus: '-8' is not a positive whole number of GPUs"),
    (["--gpu-memory", "nan"], "argument --gpu-memory: 'nan' is neither a GPU (h100-80gb, a100-80gb, h200, b200) nor a finite size in GB greater than 0"),
    (["--gpu-memory", "inf"], "argument --gpu-memory: 'inf' is neither a GPU (h100-80gb, a100-80gb, h200, b200) nor a finite size in GB greater than 0"),
    (["--gpu-memory", "-1"], "argument --gpu-memory: '-1' is neither a GPU (h100-80gb, a100-80gb, h200, b200) nor a finite size in GB greater than 0"),
    (["--gpu-memory", "1e308"], "argument --gpu-memory: '1e308' GB is more bytes than a float holds"),
    (["--gpu-memory", "1e300"], "argument --gpu-memory: '1e300' GB is more bytes than a float holds"),
    (["model.vocab_size=-5"], "model.vocab_size=-5: must be a positive integer"),
    (["model.hidden_size=0"], "model.hidden_size=0: must be a positive integer"),
    (["model.num_layers=-2"], "model.num_layers=-2: must be a positive integer"),
])
def test_plan_refuses_nonsense_naming_the_option(argv, message, capsys):
    options = {"--gpus": "8", "--gpu-memory": "80"}
    for flag, value in zip(argv[::2], argv[1::2]):
        options[flag] = value
    overrides = [a for a in argv if "=" in a]
    try:
        status = cli(["plan", "--config", PAPER, *[x for kv in options.items() for x in kv], *overrides])
    except SystemExit as exit_:  # argparse's own one-line error
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err


def test_suggestion_searches_tensor_times_context_with_recompute(capsys):
    """N-PL24: at 14 GB only tensor 8 x context 4 with full recompute on 4x the GPUs fits; main said nothing did."""
    assert cli(["plan", "--config", PAPER, "--gpus", "8", "--gpu-memory", "14"]) == 1
    line = capsys.readouterr().out.splitlines()[-1]
    assert "smallest change that fits: 32 GPUs with " in line
    change = line.split("32 GPUs with ", 1)[1].split()
    assert "model.tensor_model_parallel_size=8" in change and "model.context_parallel_size=4" in change
    assert cli(["plan", "--config", PAPER, "--gpus", "32", "--gpu-memory", "14", *change]) == 0
    capsys.readouterr()
    # and a smaller change is not missed: with 17 GB, 32 GPUs at context 2 (data parallel 2) already fit
    assert cli(["plan", "--config", PAPER, "--gpus", "8", "--gpu-memory", "17", "--json"]) == 1
    assert "model.context_parallel_size=2" in json.loads(capsys.readouterr().out)["suggestion"]
