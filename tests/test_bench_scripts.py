"""The benchmark scripts run end to end at toy sizes and print the tables the README quotes.

Timings are not asserted (they belong to the printed tables); what is checked is that every
row is there, the FLOP/s columns follow from the printed times and the pair counts of the mask,
and the derived ratios are consistent with the rows they are computed from. bench_train.py's table is checked
where the GPU suite's CPU smoke prints it (tests/test_gpu_suite.py), which runs the same rows and more.
"""
import importlib
import re
import subprocess
import sys
from math import inf
from pathlib import Path

import pytest
import torch

from nemo_anchor.attention.layout import layout_blocks, pack_layout
from nemo_anchor.attention.reference import dense_mask

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench_attention import document_bounds  # noqa: E402


def _run(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not set(line) <= set("|- ")]


def test_kept_pairs_of_the_benchmark_layout_match_the_dense_mask():
    cu_seqlens = document_bounds(300, 7, seed=3)
    for mode in ("full", "intra_doc", "anchor"):
        blocks = layout_blocks(cu_seqlens, None, mode, 300, 0, 300)
        expected = int(dense_mask(blocks, 0, 300, torch.device("cpu")).sum())
        assert pack_layout(cu_seqlens).kept_pairs(mode) == expected, mode


def test_bench_attention_prints_rates_from_its_times():
    tokens, heads, head_dim = 512, 2, 16
    out = _run("bench_attention.py", "--tokens", str(tokens), "--heads", str(heads), "--head-dim", str(head_dim),
               "--docs", "8", "--repeats", "1", "--threads", "1",
               "--methods", "full causal SDPA", "anchor_attention cpu")
    rows = {(r[0], r[1]): r for r in _table_rows(out)[1:]}
    assert set(rows) == {(m, p) for m in ("full causal SDPA", "anchor_attention cpu") for p in ("forward", "fwd+bwd")}
    cu_seqlens = document_bounds(tokens, 8, seed=0)
    for (method, phase), (_, _, ms, _, gflops, _, _) in rows.items():
        pairs = pack_layout(cu_seqlens).kept_pairs("full" if method.startswith("full") else "anchor")
        flops = 4 * head_dim * heads * pairs * (3.5 if phase == "fwd+bwd" else 1)
        rate = flops / (float(ms) / 1e3) / 1e9
        # both printed rounded to 0.1: the time behind the printed rate lies within ms +- 0.05
        low, high = flops / ((float(ms) + 0.05) / 1e3) / 1e9, flops / ((float(ms) - 0.05) / 1e3) / 1e9
        assert low - 0.05 <= float(gflops) <= high + 0.05, (rate, gflops, ms)
    line = re.search(r"anchor cpu fwd\+bwd: ([\d.]+)x .*; (\d+)% of its time inside", out)
    assert line, out
    ours, full = rows[("anchor_attention cpu", "fwd+bwd")], rows[("full causal SDPA", "fwd+bwd")]
    assert abs(float(line.group(1)) - float(ours[4]) / float(full[4])) <= 0.02 + 0.02 * float(line.group(1))
    assert 0 < int(line.group(2)) <= 100


def test_bench_attention_kernel_scaling_covers_64_to_the_window():
    out = _run("bench_attention.py", "--kernel-scaling", "--tokens", "256", "--heads", "2", "--head-dim", "16",
               "--repeats", "1", "--threads", "1")
    rows = _table_rows(out)[1:]
    assert [int(r[0]) for r in rows] == [64, 128, 256]
    assert [int(r[1]) for r in rows] == [4, 2, 1]
    assert float(rows[-1][4]) == 1.0
    # The rates are whatever this machine measured (a busy machine gives 0.1 GFLOP/s, printed rounded to
    # 0.1): check each printed figure against the interval the others allow after rounding, at any speed.
    rates = []
    for length, sequences, ms, gflops, _ in rows:
        flops = 4 * 16 * 2 * int(sequences) * int(length) * (int(length) + 1) // 2 * 3.5
        by_time = (flops / (float(ms) + 0.05) / 1e6, flops / (float(ms) - 0.05) / 1e6 if float(ms) > 0.05 else inf)
        low, high = max(by_time[0], float(gflops) - 0.05), min(by_time[1], float(gflops) + 0.05)
        assert low <= high, (length, ms, gflops)  # the rate follows from the time
        rates.append((low, high))
    (window_low, window_high) = rates[-1]
    for (low, high), row in zip(rates, rows):
        ratio = float(row[4])
        assert low / window_high - 0.005 <= ratio <= (high / window_low if window_low > 0 else inf) + 0.005, row


def test_bench_scale_prints_what_a_save_blocks_beside_the_write_and_the_step():
    out = _run("bench_scale.py", "--layouts", "1:1", "--steps", "2", "--save-every", "1", "--seq-length", "128")
    header = next(i for i, line in enumerate(out.splitlines()) if "loop blocked s/save" in line)
    name, tensor, saves, step_s, blocked, written, published = out.splitlines()[header + 1].split()
    assert (name, tensor, saves) == ("DP1", "TP1", "2")
    assert float(step_s) > 0 and 0 < float(written) <= float(published)
    assert float(blocked) > 0  # synchronous on the CPU: the loop waits for the write, not for the checksums


def test_bench_data_prints_pack_throughput_with_and_without_the_digest():
    out = _run("bench_data.py", "--tables", "4", "--sizes", "200000", "--repeats", "1")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("tokens") and "digest cost" in line)
    tokens, off_s, on_s, off_rate, on_rate, cost, _, _ = lines[header + 2].split()
    count = float(tokens.rstrip("M")) * 1e6
    for seconds, rate in ((float(off_s), off_rate), (float(on_s), on_rate)):  # printed rounded: 0.1M, 1 ms
        assert abs(float(rate.rstrip("M")) * 1e6 - count / seconds) <= 0.05e6 + count / seconds * 0.0006 / seconds
    off, on = float(off_s), float(on_s)
    rounding = 100 * 0.0005 * (1 / off + on / off**2)  # the seconds are printed to 3 decimals
    assert abs(float(cost.rstrip("%")) - (on / off - 1) * 100) <= 0.1 + rounding


@pytest.mark.parametrize("script, argv, option", [
    ("bench_launches", ["--tokens", "0"], "argument --tokens: must be a positive whole number, got 0"),
    ("bench_launches", ["--tokens", "1024", "--window", "4096"], "--window 4096 does not divide --tokens 1024"),
    ("bench_launches", ["--heads", "3", "--kv-heads", "2"], "--heads 3 is not a multiple of --kv-heads 2"),
    ("bench_launches", ["--mean-document", "-1"], "argument --mean-document: must be a positive finite number"),
    ("bench_attention", ["--tokens", "0"], "argument --tokens: must be a positive whole number, got 0"),
    ("bench_attention", ["--tokens", "64", "--docs", "100"], "--docs 100 is more documents than --tokens 64"),
    ("bench_host", ["--layers", "0"], "argument --layers: must be a positive whole number, got 0"),
    ("bench_train", ["--lengths", "256", "0"], "argument --lengths: must be a positive whole number, got 0"),
    ("bench_train", ["--warmup", "-1"], "argument --warmup: must be a whole number >= 0, got -1"),
    ("bench_train", ["--layers", "many"], "argument --layers: 'many' is not a whole number"),
    ("bench_train", ["--mean-doc", "nan"], "argument --mean-doc: must be a positive finite number, got nan"),
    ("bench_context_parallel", ["--cp", "2,x"], "argument --cp: 'x' is not a whole number"),
    ("bench_context_parallel", ["--heads", "6", "--query-groups", "4"],
     "--heads 6 is not a multiple of --query-groups 4"),
    ("bench_context_parallel", ["--measure", "--measure-windows", "100"],
     "--measure-windows 100 does not split into 2 x --measure-cp 4 equal chunks"),
    ("bench_context_parallel", ["--backend", "fa5"], "argument --backend: invalid choice: 'fa5'"),
    ("bench_cp_copies", ["--cp", "1"], "--cp 1: context parallelism needs 2 or more ranks"),
    ("bench_cp_copies", ["--tokens", "6"], "--tokens 6 is not a multiple of 4"),
    ("bench_data", ["--sizes", "0"], "argument --sizes: must be a positive finite number, got 0"),
    ("bench_data", ["--repeats", "0"], "argument --repeats: must be a positive whole number, got 0"),
    ("bench_scale", ["--layouts", "3:2"], "argument --layouts: 3:2: 3 processes do not split into tensor-parallel"),
    ("bench_scale", ["--save-every", "-2"], "argument --save-every: must be a whole number >= 0, got -2"),
])
def test_benchmarks_refuse_bad_arguments_in_one_line_naming_the_option(script, argv, option, capsys):
    """In-process, before any work: well under a CPU second for all of them."""
    module = importlib.import_module(script)
    with pytest.raises(SystemExit) as stop:
        (module.parse_args if hasattr(module, "parse_args") else module.main)(argv)
    assert stop.value.code == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert option in line.partition("error: ")[2], line


@pytest.mark.parametrize("args, named", [
    (["--doors", "train", "--signal-after", "1"], "--signal-after: 1 is below 2"),
    (["--doors", "train", "--save-every", "2"], "--save-every: 2 is below 3"),
    (["--doors", "train", "--scheduled-saves", "1"], "--scheduled-saves: 1 is below 2"),
    (["--doors", "train", "--timeout", "0"], "--timeout: 0.0 is not a positive number of seconds"),
    (["--doors", "bridge", "--bridge-python", "/nonexistent/python"], "--bridge-python: /nonexistent/python is not"),
    (["--doors", "nemo", "--workdir", str(SCRIPTS)], f"--workdir: {SCRIPTS} is not empty"),
])
def test_bench_stop_refuses_a_bad_option_in_one_line_naming_it(args, named, capsys):
    """Only the arguments: the benchmark's runs (about 3 minutes) are not part of the suite."""
    import bench_stop

    with pytest.raises(SystemExit) as stopped:
        bench_stop.parse_args(args)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert stopped.value.code == 2 and len(errors) == 1 and f"error: argument {named}" in errors[0], errors
