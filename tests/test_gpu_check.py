"""scripts/gpu_check.py on the CPU: its pure parts (nemo_anchor.gpu_check) and its clean skip without CUDA."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from nemo_anchor import gpu_check as check
from nemo_anchor.attention import MODES, anchor_attention
from nemo_anchor.attention.layout import PackLayout, layout_blocks, lognormal_documents
from nemo_anchor.attention.reference import dense_mask

from layout_strategies import packed_layouts  # tests/layout_strategies.py

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_lognormal_documents_tile_the_window_reproducibly():
    bounds = lognormal_documents(32768, seed=3, mean_tokens=1024)
    assert bounds[0] == 0 and bounds[-1] == 32768
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    assert bounds == lognormal_documents(32768, seed=3, mean_tokens=1024)
    assert bounds != lognormal_documents(32768, seed=4, mean_tokens=1024)
    assert 8 <= len(bounds) - 1 <= 128  # about 32 documents of mean 1024


def test_conformance_cases_cover_what_the_issue_lists():
    cases = check.conformance_cases(1024)
    assert {c.mode for c in cases} == set(MODES)
    assert any(c.heads != c.kv_heads for c in cases) and any(c.heads == c.kv_heads for c in cases)
    assert any(c.q_offset > 0 for c in cases)
    assert any(1 in [b - a for a, b in zip(c.doc_bounds, c.doc_bounds[1:])] for c in cases)  # 1-token documents
    assert {len(c.window_bounds) - 1 for c in cases} >= {1, 2, 4}
    assert any(c.doc_bounds[1] == 1 for c in cases)  # a window whose first document is the BOS alone
    assert {c.total for c in cases} == {1024}
    for c in cases:  # every layout is valid input of anchor_attention
        layout_blocks(torch.tensor(c.doc_bounds), torch.tensor(c.window_bounds), c.mode, c.total, c.q_offset, c.q_len)


@settings(max_examples=50, deadline=None)
@given(packed_layouts(max_docs=8, max_doc_len=40, query_range=False))
def test_kept_pairs_count_the_reference_mask(layout):
    bounds, windows, mode, _, _ = layout
    blocks = layout_blocks(torch.tensor(bounds), torch.tensor(windows), mode, bounds[-1], 0, bounds[-1])
    assert PackLayout.of(bounds, windows).kept_pairs(mode) == int(dense_mask(blocks, 0, bounds[-1], CPU).sum())


def test_kept_pairs_of_full_causal_and_the_tflops_arithmetic():
    assert PackLayout.of((0, 8192)).kept_pairs("full") == 8192 * 8193 // 2
    # 4 flops per pair, head and head_dim unit forward; 3.5x that forward+backward
    assert check.attention_tflops(10**9, heads=2, head_dim=128, seconds=0.5, backward=False) == pytest.approx(2.048)
    assert check.attention_tflops(10**9, heads=2, head_dim=128, seconds=0.5, backward=True) == pytest.approx(2.048 * 3.5)


def test_low_precision_attention_is_the_reference_in_fp32_and_rounds_in_bf16():
    case = check.conformance_cases(256, head_shapes=((4, 2, 16),))[2]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(case.q_len, 4, 16, generator=g)
    k, v = (torch.randn(case.total, 2, 16, generator=g) for _ in range(2))
    blocks = check.case_blocks(case)
    reference = anchor_attention(q, k, v, torch.tensor(case.doc_bounds, dtype=torch.int32),
                                 cu_windows=torch.tensor(case.window_bounds, dtype=torch.int32), mode=case.mode,
                                 backend="reference", softmax_scale=0.25)
    plain = check.low_precision_attention(q, k, v, blocks, 0, 0.25)
    torch.testing.assert_close(plain, reference, atol=1e-5, rtol=1e-5)
    rounded = check.low_precision_attention(*(x.bfloat16() for x in (q, k, v)), blocks, 0, 0.25)
    error = (rounded.float() - reference).abs().max().item()
    assert rounded.dtype == torch.bfloat16 and 1e-4 < error < 0.1


def test_acceptance_rule_allows_twice_the_baseline_error_plus_atol():
    reference = torch.zeros(8)
    baseline = torch.full((8,), 0.1)
    within = torch.full((8,), 0.2 + 0.5 * check.ATOL)
    beyond = torch.full((8,), 0.2 + 2 * check.ATOL)
    assert check.compare("out", within, baseline, reference)["ok"]
    result = check.compare("out", beyond, baseline, reference)
    assert not result["ok"] and result["bound"] == pytest.approx(0.2 + check.ATOL)
    assert not check.compare("out", torch.full((8,), math.nan), baseline, reference)["ok"]
    # the atol grows with the reference's magnitude
    assert check.compare("dk", torch.full((8,), 100.0 + 0.05), torch.full((8,), 100.0), torch.full((8,), 100.0))["ok"]


def test_report_has_a_table_per_section_and_a_line_per_failure():
    bad = {"tensor": "dq", "error": 0.5, "baseline_error": 0.1, "bound": 0.2, "ok": False}
    good = {"tensor": "out", "error": 0.01, "baseline_error": 0.01, "bound": 0.03, "ok": True}
    results = {
        "environment": {"gpu": "NVIDIA H100", "torch": "2.11.0"},
        "conformance": [
            {"backend": "torch_varlen", "dtype": "bf16", "mode": "anchor", "case": "1 window", "tensors": [good, bad]},
            {"backend": "flex", "dtype": "fp16", "mode": "full", "case": "1 window", "tensors": [good]},
            {"backend": "te", "dtype": "all", "mode": "all", "case": "all", "status": "skipped: not installed"},
            {"backend": "flex block mask", "dtype": "-", "mode": "anchor", "case": "c", "status": "FAIL: tiles differ"},
        ],
        "speed": [{"tokens": 8192, "documents": 3, "method": "anchor_attention flex", "status": "FAIL: OOM"},
                  {"tokens": 8192, "documents": 3, "method": "full-causal SDPA (flash)", "status": "ok",
                   "fwd_ms": 1.5, "fwd_bwd_ms": 5.0, "fwd_tflops": 300.0, "fwd_bwd_tflops": 250.0, "peak_gib": 2.0}],
        "training": [{"run": "anchor, 16384 tokens, 1 GPU", "status": "ok", "tokens_per_s": 123456.0,
                      "loss_first": 7.7, "loss_last": 5.1, "loss_falling": True}],
    }
    lines = check.failure_lines(results)
    assert len(lines) == 3
    assert lines[0].startswith("conformance torch_varlen bf16 anchor [1 window] dq: error 0.5 > bound 0.2")
    assert any("tiles differ" in line for line in lines) and any("speed 8192 tokens anchor_attention flex" in line
                                                                   for line in lines)
    text = check.markdown_report(results)
    assert "NVIDIA H100" in text and "FAIL (dq)" in text and "123456" in text
    for heading in ("## Conformance", "## Speed", "## Training", "## Failures"):
        assert heading in text
    assert check.markdown_report({"skipped": "no CUDA"}).strip().endswith("Skipped: no CUDA")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--quick", "--output", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "gpu_check: skipped: no CUDA device" in done.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"].startswith("no CUDA device")
    assert "Skipped: no CUDA device" in (tmp_path / "gpu_check.md").read_text()


# --- scripts/gpu_suite.sh ---------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_gpu_suite_without_cuda_says_so_in_one_line_and_runs_nothing(tmp_path):
    out = tmp_path / "suite"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_suite.sh"), str(out)], capture_output=True, text=True,
                          timeout=120, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"gpu_suite: skipped: {check.cuda_unavailable_reason()}"]
    assert not out.exists()  # no part started


def _suite_merge():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", REPO / "scripts" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_suite_records_each_broken_part_and_keeps_the_others(tmp_path, capsys):
    """A part that timed out, one that crashed before writing results and one that never ran become FAIL rows;
    the finished part's rows and the environment stay, and the JSON and markdown are written."""
    smollm2_rows = [{"shape": "smollm2", "tree": "current", "attention_type": "anchor", "length": 8192,
                     "requested_backend": "auto", "anchor_path": "merge", "note": "", "status": "ok",
                     "backend": "torch_varlen", "layers": 30, "recompute": 0, "step_s": 0.16, "tokens_per_s": 51200.0,
                     "tflops": 120.0, "mfu": 0.121, "hfu": 0.121, "peak_gib": 10.4}]
    (tmp_path / "smollm2.json").write_text(json.dumps({"rows": smollm2_rows}))
    (tmp_path / "smollm2.rc").write_text("0 61 110\n")
    (tmp_path / "conformance").mkdir()
    (tmp_path / "conformance" / "gpu_check.json").write_text(json.dumps({"environment": {"gpu": "NVIDIA H100 80GB HBM3"}}))
    (tmp_path / "speed.rc").write_text("124 200 200\n")
    (tmp_path / "speed.log").write_text("gpu_check: compiling flex at 131072\n")
    (tmp_path / "conformance.rc").write_text("1 12 100\n")
    (tmp_path / "conformance.log").write_text("Traceback ...\nRuntimeError: CUDA error: illegal memory access\n")
    status = _suite_merge().main([str(tmp_path)])
    assert status == 1
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert results["environment"] == {"gpu": "NVIDIA H100 80GB HBM3"}
    assert results["smollm2"] == [{**smollm2_rows[0], "part": "smollm2"}]
    assert results["speed"][0]["status"] == "FAIL: timed out after 200 s (gpu_check: compiling flex at 131072)"
    assert results["conformance"][0]["status"].startswith("FAIL: exit 1, no results (RuntimeError: CUDA error")
    assert results["cp2"][0]["status"] == "FAIL: the part did not run"
    assert results["suite"]["smollm2"] == {"exit": 0, "seconds": 61, "limit_s": 110}
    text = (tmp_path / "gpu_suite.md").read_text()
    assert text.startswith("# gpu_suite: NVIDIA H100 80GB HBM3") and "| MFU | HFU |" in text and "12.1%" in text
    parts_that_never_ran = {"preflight", "previous", "llama8b_32k", "llama8b_64k", "cp2"}
    assert len(_suite_merge().failure_lines(results)) == 2 + len(parts_that_never_ran)
