"""scripts/gpu_suite.sh on the CPU: its merge and targets on known rows, its preflight, the layer plan of the 8B
shape, and one ``--cpu-smoke`` run of every part end to end (the plumbing a GPU session relies on)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from nemo_anchor import gpu_check as check
from nemo_anchor.training import memory

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def _script(name: str):
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _model_row(part, kind, length, tokens_per_s, backend="fa4", **more):
    return {"shape": "smollm2" if part == "smollm2" else "llama3-8b-layers", "tree": "current", "attention_type": kind,
            "length": length, "requested_backend": more.pop("requested_backend", "auto"),
            "anchor_path": more.pop("anchor_path", "merge"), "note": "", "status": "ok", "backend": backend,
            "layers": 30, "recompute": 0, "documents": [0, length], "step_s": length / tokens_per_s,
            "tokens_per_s": tokens_per_s, "tflops": 1.0, "mfu": more.pop("mfu", 0.1), "hfu": 0.12, "peak_gib": 9.0,
            **more}


def _write_parts(out: Path, parts: dict) -> None:
    for part, rows in parts.items():
        if part in ("speed", "conformance", "cp2"):
            (out / part).mkdir()
            (out / part / "gpu_check.json").write_text(json.dumps({"environment": ENV, part: rows}))
        else:
            (out / f"{part}.json").write_text(json.dumps({"rows": rows}))
        (out / f"{part}.rc").write_text("0 10 60\n")


ENV = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-27"}


def _speed(length, anchor, intra):
    return [{"tokens": length, "method": "anchor (fa4, auto)", "mode": "anchor", "backend": "fa4", "status": "ok",
             "fwd_bwd_ms": 1.0, "fwd_bwd_tflops": anchor},
            {"tokens": length, "method": "intra_doc (fa4, auto)", "mode": "intra_doc", "backend": "fa4",
             "status": "ok", "fwd_bwd_ms": 1.0, "fwd_bwd_tflops": intra}]


def test_merge_judges_every_target_on_the_rows_and_says_what_was_not_measured(tmp_path):
    suite = _script("gpu_suite")
    parts = {
        "preflight": [{"package": "torch", "source": "its image", "status": "ok"}],
        "smollm2": [_model_row("smollm2", "anchor", 8192, 50_000), _model_row("smollm2", "full", 8192, 49_000),
                    _model_row("smollm2", "intra_doc", 8192, 52_000),
                    _model_row("smollm2", "anchor", 8192, 40_000, anchor_path="kv_copy")],
        "previous": [_model_row("smollm2", "anchor", 8192, 45_000, tree=".previous@ebc4ccd")],
        "llama8b_32k": [_model_row("llama8b_32k", "anchor", 32768, 10_000),
                        _model_row("llama8b_32k", "full", 32768, 6_000, backend="te"),
                        _model_row("llama8b_32k", "full", 32768, 5_000, requested_backend="fa4"),
                        _model_row("llama8b_32k", "intra_doc", 32768, 10_200)],
        "llama8b_64k": [_model_row("llama8b_64k", "anchor", 65536, 8_000, mfu=0.41),
                        _model_row("llama8b_64k", "full", 65536, 3_000)],  # no intra_doc run
        "speed": _speed(32768, 480.0, 500.0) + _speed(65536, 470.0, 500.0),  # nothing at 128K
    }
    _write_parts(tmp_path, parts)
    assert suite.main([str(tmp_path)]) == 1  # conformance and cp2 did not run
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    judged = {(t["target"], t["shape"], t["basis"]): (t["status"], t.get("value"), t["measured"])
              for t in results["targets"]}
    t = suite.TARGETS
    assert judged[(t[0], "smollm2, 30 layers, 8K", "both on fa4")][:2] == ("FAIL", pytest.approx(50 / 52))
    assert judged[(t[0], "llama3-8b-layers, 30 layers, 32K", "both on fa4")][:2] == ("PASS", pytest.approx(10 / 10.2))
    missing = judged[(t[0], "llama3-8b-layers, 30 layers, 64K", "both on fa4")]
    assert missing[0] == "FAIL" and missing[2] == "not measured: no intra_doc run at 65536 in part llama8b_64k"
    assert judged[(t[1], "smollm2, 30 layers, 8K", "both on fa4")][:2] == ("PASS", pytest.approx(50 / 49))
    # 64K: full's step is 8/3 of the anchor's: 0.375 <= 0.5
    assert judged[(t[2], "llama3-8b-layers, 30 layers, 64K", "both on fa4")][:2] == ("PASS", pytest.approx(3 / 8))
    assert judged[(t[3], "llama3-8b-layers, 30 layers, 64K", "fa4")][:2] == ("PASS", pytest.approx(0.41))
    assert judged[(t[4], "kernel, 32K", "fa4")][:2] == ("PASS", pytest.approx(0.96))
    assert judged[(t[4], "kernel, 64K", "fa4")][:2] == ("FAIL", pytest.approx(0.94))
    assert judged[(t[4], "kernel, 128K", "")][0] == "FAIL"
    # 32K: auto put full on te; the anchor is compared on its own family (fa4) and each on its best too
    assert not any(k[0] == t[1] and "each on its best" in k[2] for k in judged)
    text = (tmp_path / "gpu_suite.md").read_text()
    assert "| smollm2 | 8192 | fa4 | 50000 | 40000 | 1.250 |" in text  # merge against kv_copy
    assert "| smollm2 | 8192 | anchor | fa4 | 50000 | fa4 (.previous@ebc4ccd) | 45000 | 1.111 |" in text
    assert "cp2 cp2: FAIL: the part did not run" in text
    paste = (tmp_path / "results.md").read_text()
    assert "## The GPU suite on one NVIDIA H100 80GB HBM3 (2026-11-27, `bash scripts/gpu_suite.sh`)" in paste
    assert "| NVIDIA H100 80GB HBM3, 2026-11-27 | anchor tokens/s >= full at 8K (SmolLM2) |" in paste


def test_each_on_its_best_is_judged_beside_the_same_family(tmp_path):
    suite = _script("gpu_suite")
    rows = [_model_row("smollm2", "anchor", 8192, 50_000), _model_row("smollm2", "full", 8192, 60_000, backend="te"),
            _model_row("smollm2", "full", 8192, 45_000, requested_backend="fa4")]
    _write_parts(tmp_path, {"smollm2": rows})
    targets = suite.merge(tmp_path)["targets"]
    full = [(r["basis"], r["status"], r["value"]) for r in targets if r["target"] == suite.TARGETS[1]]
    assert full == [("both on fa4", "PASS", pytest.approx(50 / 45)),
                    ("each on its best: fa4 / te", "FAIL", pytest.approx(50 / 60))]


def test_the_paths_rows_come_with_the_conformance_part_and_a_fail_is_a_failure(tmp_path):
    """Issue 45's paths ride in the conformance part's JSON: a FAIL row (CUDA running the torch merge fallback) is a
    failure of the suite; a SKIP is not; a conformance part that ended before its paths says so in a FAIL row."""
    suite = _script("gpu_suite")
    paths = [{"check": "anchor merge path", "status": "FAIL", "backend": "fa3",
              "detail": "anchor merge: torch fallback (`import triton` failed: ModuleNotFoundError)"},
             {"check": "no host sync, anchor forward on a prebuilt layout", "status": "SKIP", "backend": "-",
              "detail": "needs CUDA"}]
    (tmp_path / "conformance").mkdir()
    (tmp_path / "conformance" / "gpu_check.json").write_text(json.dumps(
        {"environment": ENV, "conformance": [{"backend": "fa3", "status": "skipped: x"}], "paths": paths}))
    (tmp_path / "conformance.rc").write_text("1 10 90\n")
    results = suite.merge(tmp_path)
    assert [(r["check"], r["status"]) for r in results["paths"]] == [(p["check"], p["status"]) for p in paths]
    failures = [line for line in suite.failure_lines(results) if line.startswith("paths")]
    assert failures == ["paths anchor merge path: FAIL: anchor merge: torch fallback (`import triton` failed: "
                        "ModuleNotFoundError)"]
    assert "| anchor merge path | FAIL | fa3 | anchor merge: torch fallback" in suite.markdown(results)
    (tmp_path / "conformance" / "gpu_check.json").write_text(json.dumps(
        {"environment": ENV, "conformance": [{"backend": "fa3", "status": "skipped: x"}]}))
    (tmp_path / "conformance.log").write_text("RuntimeError: CUDA error: an illegal memory access\n")
    [row] = suite.merge(tmp_path)["paths"]
    assert row["status"] == "FAIL: exit 1, no paths rows (RuntimeError: CUDA error: an illegal memory access)"


def test_a_type_auto_put_on_another_kernel_family_runs_again_on_the_anchors():
    bench = _script("bench_train")
    rows = [_model_row("smollm2", "full", 8192, 60_000, backend="te"), _model_row("smollm2", "anchor", 8192, 50_000),
            _model_row("smollm2", "intra_doc", 8192, 52_000),
            _model_row("smollm2", "full", 32768, 9_000, backend="te")]  # another window: no anchor run there
    assert bench.same_family_runs(rows, 8192) == [
        bench.Run("full", 8192, backend="fa4", note="same kernel family as anchor")]
    assert bench.same_family_runs(rows, 32768) == []


def test_runs_go_on_with_one_layer_fewer_when_the_planned_count_runs_out_of_memory(tmp_path, monkeypatch):
    """The planner's 6 layers at 32K on an H100: a worker that runs out of memory above 5 layers leaves its FAIL row,
    and that run and every later one at the window use 5."""
    bench = _script("bench_train")
    tried = []

    def worker(spec, env, timeout):
        layers = spec["model"]["num_layers"]
        tried.append((spec["model"]["attention_type"], layers))
        if layers > 5:
            return {"status": "FAIL: exit 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.9 GiB"}
        return {"status": "ok", "backend": "fa4", "documents": [0, 16384, 32768], "step_s": 2.0, "peak_tflops": 989.0,
                "source": str(REPO), "peak_gib": 70.0}

    monkeypatch.setattr(bench, "run_worker", worker)
    bench.main(["--model", "llama3-8b-layers", "--layers", "auto", "--gpu-memory", "h100-80gb", "--lengths", "32768",
                "--kinds", "full", "anchor", "--precision", "bf16", "--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert tried == [("full", 6), ("full", 5), ("anchor", 5)]
    assert [(r["attention_type"], r["layers"], r["status"][:4]) for r in rows] == [
        ("full", 6, "FAIL"), ("full", 5, "ok"), ("anchor", 5, "ok")]
    assert rows[1]["note"] == "6 planned layers ran out of memory"


def test_preflight_fails_naming_the_package_and_where_it_comes_from(tmp_path, monkeypatch):
    suite = _script("gpu_suite")
    monkeypatch.setattr(check, "SUITE_PACKAGES", {"json": check.IMAGE, "no_such_package_xyz": check.WHEELS})
    assert suite.preflight(tmp_path) == 1
    rows = json.loads((tmp_path / "preflight.json").read_text())["rows"]
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"].startswith("FAIL: no_such_package_xyz does not import (ModuleNotFoundError")
    assert rows[1]["status"].endswith(f"the lent machine gets it from {check.WHEELS}")


@pytest.mark.parametrize("card, length", [("h100-80gb", 32768), ("h200", 32768), ("h200", 65536)])
def test_the_8b_layer_shape_gets_as_many_layers_as_the_planner_fits(card, length):
    bench = _script("bench_train")
    gpu_bytes = memory.gpu_memory(card)[0]
    model, why = bench.planned_model("llama3-8b-layers", bench.Run("anchor", length), "auto", gpu_bytes,
                                     bf16=True, fusions=False)
    assert why is None and model.hidden_size == 4096 and model.num_query_groups == 8
    options = dict(gpu_bytes=gpu_bytes, micro_batch_size=1, bf16=True, distributed_optimizer=True)
    one_more = replace(model, num_layers=model.num_layers + 1, recompute="full", recompute_num_layers=None)
    assert memory.plan_memory(model, 128256, memory.Layout(1), **options).fits
    assert not memory.plan_memory(one_more, 128256, memory.Layout(1), **options).fits  # even all recomputed
    if model.recompute == "full":  # the fewest recomputed layers: one fewer does not fit
        fewer = replace(model, recompute_num_layers=model.recompute_num_layers - 1) \
            if model.recompute_num_layers > 1 else replace(model, recompute="none", recompute_num_layers=None)
        assert not memory.plan_memory(fewer, 128256, memory.Layout(1), **options).fits


def test_a_shape_that_fits_no_layer_says_why_with_the_planners_suggestion():
    bench = _script("bench_train")
    model, why = bench.planned_model("llama3-8b-layers", bench.Run("anchor", 65536), "auto",
                                     memory.gpu_memory("h100-80gb")[0], bf16=True, fusions=False)
    assert model is None
    assert why.startswith("does not fit one GPU of 79.1 GiB even as 1 recomputed layer") and "suggests: " in why


def test_fewest_recomputed_layers_counts_the_allocator_headroom():
    """One recomputed layer under the GPU's bytes but over them with the headroom: the count was 0 (a ValueError)."""
    model = memory.ModelConfig(num_layers=12, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                               num_query_groups=8, seq_length=32768)
    options = dict(gpu_bytes=memory.gpu_memory("h200")[0], micro_batch_size=1, bf16=True,
                   distributed_optimizer=True, fusions=True)
    layers = memory.fewest_recomputed_layers(model, 128256, memory.Layout(1), **options)
    plan = lambda n: memory.plan_memory(replace(model, recompute="full", recompute_num_layers=n), 128256,  # noqa: E731
                                        memory.Layout(1), **options)
    assert plan(layers).fits and (layers == 1 or not plan(layers - 1).fits)


# --- the whole suite on the CPU ------------------------------------------------------------------------

SITECUSTOMIZE = '''
import atexit, builtins, os
_roots = [r for r in os.environ["NEMO_ANCHOR_IMPORT_ROOTS"].split(os.pathsep) if r]
_seen, _original = set(), builtins.__import__
def _recording(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and globals and any((globals.get("__file__") or "").startswith(r) for r in _roots):
        _seen.add(name)
    return _original(name, globals, locals, fromlist, level)
def _write():
    with open(os.path.join(os.environ["NEMO_ANCHOR_IMPORT_LOG"], f"{os.getpid()}.txt"), "w") as out:
        out.write("\\n".join(sorted(_seen)))
builtins.__import__ = _recording
atexit.register(_write)
'''


def _outside_the_standard_library(names: set[str]) -> set[str]:
    ours = {"nemo_anchor", "gpu_check", "bench_train", "bench_args", "gpu_suite", "__main__"}
    return {n for n in names if n.split(".")[0] not in sys.stdlib_module_names | ours and not n.startswith("_")}


@pytest.mark.timeout(2400)  # about 10 processes that each import Megatron: minutes on a loaded 2-core CPU
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU smoke of a machine without CUDA")
def test_cpu_smoke_runs_every_part_and_imports_only_what_the_gpu_machine_has(tmp_path):
    """Every part of the suite runs end to end at toy sizes, the previous tree's workers import it, the targets
    are judged, and every package our code imports in any part is one the preflight checks."""
    previous, log, hook = tmp_path / "previous", tmp_path / "imports", tmp_path / "hook"
    for folder in (previous, log, hook):
        folder.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD", "nemo_anchor"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(previous)], input=archive, check=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": sys.executable, "PREVIOUS_TREE": str(previous), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(hook), "NEMO_ANCHOR_IMPORT_LOG": str(log),
           "NEMO_ANCHOR_IMPORT_ROOTS": os.pathsep.join(str(p) for p in (REPO / "nemo_anchor", SCRIPTS, previous))}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_suite.sh"), "--cpu-smoke", str(out)], capture_output=True,
                          text=True, env=env, timeout=2300)
    results = json.loads((out / "gpu_suite.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], _script("gpu_suite").failure_lines(results))
    assert all(results["suite"][part]["exit"] == 0 for part in _script("gpu_suite").PARTS)
    model_rows = [r for part in ("smollm2", "previous", "llama8b_32k", "llama8b_64k") for r in results[part]]
    # smollm2 the whole grid; the parts that run its code again the anchor (and at 64K full, for its targets)
    assert {(r["part"], r["attention_type"], r["anchor_path"]) for r in model_rows} == {
        ("smollm2", kind, "merge") for kind in ("anchor", "intra_doc", "full")} | {
        ("smollm2", "anchor", "kv_copy"), ("previous", "anchor", "merge"), ("llama8b_32k", "anchor", "merge"),
        ("llama8b_64k", "anchor", "merge"), ("llama8b_64k", "full", "merge")}
    assert {r["tree"] for r in results["previous"]} == {"previous"}
    assert all(r["layers"] == 4 and r["mfu"] > 0 and r["hfu"] >= r["mfu"] for r in model_rows)
    assert len(results["targets"]) == 3 + 1 + 1 + 1 + 1  # one kernel length in the smoke
    suite = _script("gpu_suite")
    assert {t["target"] for t in results["targets"] if "value" in t} == set(suite.TARGETS)  # each from real rows
    assert [(t["target"], t["measured"]) for t in results["targets"] if "value" not in t] == [
        (suite.TARGETS[0], f"not measured: no intra_doc run at {length} in part {part}")
        for part, length in (("llama8b_32k", 256), ("llama8b_64k", 512))]  # the runs the smoke leaves out
    assert {r["mode"] for r in results["speed"] if r["status"] == "ok"} >= {"anchor", "intra_doc", "full"}
    assert results["cp2"][0]["status"] == "ok" and results["conformance"]
    # issue 45's paths: what needs CUDA says SKIP and why, the rest runs on the CPU's backend
    assert {r["check"]: r["status"] for r in results["paths"]} == {
        "anchor merge path": "SKIP", "deterministic backward (auto)": "PASS",
        "Megatron's plain PackedSeqParams, anchor mask": "PASS",
        "no host sync, anchor forward on a prebuilt layout": "SKIP"}
    assert all("CUDA" in r["detail"] for r in results["paths"] if r["status"] == "SKIP")
    assert "## The GPU suite on one cpu (" in (out / "results.md").read_text()
    # bench_train.py's printed table (the one the README quotes), as the smollm2 part printed it: a row per run,
    # tokens/s from the step time, the ratio to full from the rows, then the attention path each type took
    printed = (out / "smollm2.log").read_text().splitlines()
    table = [line.split() for line in printed if line.strip().startswith("256 ")]
    assert [(row[1], row[3]) for row in table] == [("full", "merge"), ("anchor", "merge"), ("intra_doc", "merge"),
                                                   ("anchor", "kv_copy")], printed
    assert [line for line in printed if line.startswith("attention: ")] == [
        f"attention: {kind}: cpu (torch's CPU flash attention)" for kind in ("anchor", "full", "intra_doc")]
    full_tokens_per_s = float(table[0][8])
    for _, _, backend, _, layers, recompute, _, step_s, tokens_per_s, ratio, tflops, mfu, hfu, peak in table:
        assert (backend, layers, recompute) == ("cpu", "4", "0")
        assert abs(float(tokens_per_s) - 256 / float(step_s)) <= 1 + 0.01 * float(tokens_per_s)
        assert abs(float(ratio) - float(tokens_per_s) / full_tokens_per_s) <= 0.01 + 0.01 * float(ratio)
        assert float(tflops) > 0 and 0 < float(mfu.rstrip("%")) and float(peak) > 0
        assert float(hfu.rstrip("%")) >= float(mfu.rstrip("%"))  # HFU adds recomputation (none here: equal)
    imported = set().union(*(set(p.read_text().split()) for p in log.glob("*.txt")))
    needed = _outside_the_standard_library(imported)
    unchecked = {name for name in needed if not any(name == package or name.startswith(package + ".")
                                                    for package in {**check.SUITE_PACKAGES,
                                                                    **check.SUITE_OPTIONAL_PACKAGES})}
    assert needed and not unchecked, f"imported by the suite, not in SUITE_PACKAGES: {sorted(unchecked)}"


@pytest.mark.parametrize("argv, named", [(["--cpu-smok"], "unknown option --cpu-smok"),
                                         (["-x", "out"], "unknown option -x"),
                                         (["out", "--cpu-smoke", "more"], "a second OUTPUT_DIR more")])
def test_a_mistyped_option_is_refused_in_one_line_before_anything_runs(argv, named):
    """Before, ``--cpu-smok`` was taken for OUTPUT_DIR: the suite was "skipped" without CUDA, exit 0, nothing run."""
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_suite.sh"), *argv], env={**os.environ, "PYTHON": "false"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr.splitlines() == [done.stderr.strip()] and f"gpu_suite: error: {named}" in done.stderr
    assert not any((REPO / name).exists() for name in argv)
