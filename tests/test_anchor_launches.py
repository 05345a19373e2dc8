"""The anchor costs a layer the same number of launches at every length (scripts/bench_launches.py's count).

Through the flash-attn stand-ins, each library call counted as one launch and every other aten op
dispatched as one: the launches the anchor adds over ``intra_doc``, forward and backward, are the
same at 1K and at 4K tokens, with windows of 512 (four times the anchors at 4K). The chunked merge
this replaced added launches with every 2048 query rows.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_launches import LaunchCounter, counted_libraries, measure, parse_args  # noqa: E402


def added_launches(tokens: int) -> dict[str, int]:
    args = parse_args(["--tokens", str(tokens), "--backend", "flash", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "8", "--dtype", "float32", "--mean-document", "96", "--window", "512"])
    counter, cpu = LaunchCounter(), torch.device("cpu")
    with counted_libraries(counter, "flash", standins=True):
        intra = measure(args, counter, tokens, "intra_doc", cpu)
        anchor = measure(args, counter, tokens, "anchor", cpu)
    return {phase: anchor[phase] - intra[phase] for phase in ("forward", "backward")}


def test_the_anchor_adds_the_same_launches_at_every_length(monkeypatch):
    monkeypatch.delenv("NEMO_ANCHOR_ANCHOR_PATH", raising=False)
    short, long = added_launches(1024), added_launches(4096)
    assert short == long
    assert 0 < short["forward"] and 0 < short["backward"]  # the anchor is merged, not skipped


def test_the_benchmarks_stand_in_math_is_the_exact_stand_ins():
    """``cpu_flash_math`` (torch's CPU flash kernel) computes what the fp64 stand-ins do, sequences with more
    keys than queries (bottom-right) included, forward and backward from a given output and log-sum-exp."""
    import varlen_standins  # tests/varlen_standins.py

    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = torch.tensor([0, 3, 10, 11], dtype=torch.int32), torch.tensor([0, 5, 12, 14], dtype=torch.int32)
    q, dout = (torch.randn(11, 4, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(14, 2, 8, generator=g) for _ in range(2))
    out, lse = varlen_standins.forward(q, k, v, cu_q, cu_k, 0.3)
    fast_out, fast_lse = varlen_standins.cpu_flash_forward(q, k, v, cu_q, cu_k, 0.3)
    torch.testing.assert_close(fast_out, out)
    torch.testing.assert_close(fast_lse, lse)
    for name, fast, exact in zip(("dq", "dk", "dv"),
                                 varlen_standins.cpu_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, 0.3),
                                 varlen_standins.backward(dout, q, k, v, out, lse, cu_q, cu_k, 0.3)):
        torch.testing.assert_close(fast, exact, msg=name)


def test_the_benchmark_prints_its_table(monkeypatch, capsys):
    """One row per length and pass; the added launches and the ratio follow from the counts printed beside them."""
    from bench_launches import main

    threads = torch.get_num_threads()
    try:
        assert main(["--tokens", "256", "512", "--window", "128", "--mean-document", "40", "--paths", "merge",
                     "kv_copy", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    # which path it measured, and why (without triton here: the torch fallback)
    assert "\nattention: flash (FlashAttention-2); anchor merge: torch fallback (" in printed
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in printed.splitlines()
            if line.startswith("| ") and not line.startswith("| T ") and not set(line) <= set("|- ")]
    assert [(row[0], row[1]) for row in rows] == [(t, p) for t in ("256", "512") for p in ("forward", "backward")]
    for _, _, intra, *paths in rows:
        for anchor, added, ratio in zip(paths[0::3], paths[1::3], paths[2::3]):
            assert int(added) == int(anchor) - int(intra) and float(ratio) == round(int(anchor) / int(intra), 2)
