"""The GPU suite's own steps (``scripts/gpu_suite.sh`` runs them): the preflight before the parts, the merge after.

    python scripts/gpu_suite.py --preflight OUTPUT_DIR        # every package the parts import, up front
    python scripts/gpu_suite.py OUTPUT_DIR [--started EPOCH]  # merge the parts, judge the targets

The preflight imports every package of ``nemo_anchor.gpu_check.SUITE_PACKAGES`` and writes
``OUTPUT_DIR/preflight.json``: a package that does not import is a FAIL row naming it and where the lent
machine gets it (exit 1). The parts still run, so what needs only torch is measured anyway.

The merge reads each part's rows (``OUTPUT_DIR/<part>.json`` from ``scripts/bench_train.py``,
``OUTPUT_DIR/<part>/gpu_check.json`` from ``scripts/gpu_check.py``: the conformance part's holds the paths
section too) and ``OUTPUT_DIR/<part>.rc``
(exit status, seconds, limit); a part that crashed, timed out or wrote nothing becomes a FAIL row with the
last line of its log instead of ending the suite. It judges issue 35's targets (:data:`TARGETS`) on the
rows, each a PASS or FAIL row with the measured value, and writes ``gpu_suite.json``, ``gpu_suite.md``
(every table) and ``results.md`` (the GPU's name and the date, the tables for docs/results.md and the rows
for the README's GPU table, ready to paste). Exit status: 1 when a part failed, else 0 (a missed target is
a measurement, not a failure of the suite).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from nemo_anchor import gpu_check as check
from nemo_anchor.atomic import atomic_file
from nemo_anchor.attention.functional import kernel_family

# part: the sections of its gpu_check.json (the first the part's own, where a crash is said), or None for a
# bench_train / preflight part (OUTPUT_DIR/<part>.json)
PARTS = {"preflight": None, "smollm2": None, "previous": None, "llama8b_32k": None, "llama8b_64k": None,
         "speed": ("speed",), "conformance": ("conformance", "paths"), "cp2": ("cp2",)}
MODEL_PARTS = ("smollm2", "previous", "llama8b_32k", "llama8b_64k")
TIMED_OUT = (124, 137)  # timeout(1): the limit, then the kill
# the shapes the targets are judged at: (part, window)
SMOLLM2_8K, LLAMA8B_32K, LLAMA8B_64K = ("smollm2", 8192), ("llama8b_32k", 32768), ("llama8b_64k", 65536)
KERNEL_LENGTHS = (32768, 65536, 131072)
TARGETS = (  # issue 35, item 7
    "anchor tokens/s >= 0.97x intra_doc at every shape",
    "anchor tokens/s >= full at 8K (SmolLM2)",
    "anchor step time <= 0.5x full at 64K (8B layer shape)",
    "anchor MFU >= 40% at 64K (8B layer shape)",
    "anchor kernel fwd+bwd TFLOP/s >= 0.95x intra_doc at 32K-128K",
)


# --- preflight ----------------------------------------------------------------------------------------

def preflight(output: Path) -> int:
    rows = []
    for module, source in check.SUITE_PACKAGES.items():
        try:
            importlib.import_module(module)
            rows.append({"package": module, "source": source, "status": "ok"})
        except Exception as error:  # noqa: BLE001 - any failure to import is the same finding
            rows.append({"package": module, "source": source,
                         "status": f"FAIL: {module} does not import ({type(error).__name__}: {error}); the lent "
                                   f"machine gets it from {source}"})
    for module, source in check.SUITE_OPTIONAL_PACKAGES.items():  # judged by the parts themselves
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001
            print(f"gpu_suite: preflight: optional {module} does not import ({type(error).__name__}); the lent "
                  f"machine gets it from {source}")
    results = {"environment": check.environment(), "rows": rows}
    output.mkdir(parents=True, exist_ok=True)
    with atomic_file(output / "preflight.json") as tmp:
        tmp.write_text(json.dumps(results, indent=1, default=str))
    for row in rows:
        if row["status"] != "ok":
            print(f"gpu_suite: FAILED preflight: {row['status']}")
    print(f"gpu_suite: preflight: {sum(r['status'] == 'ok' for r in rows)} of {len(rows)} packages import")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


# --- merge --------------------------------------------------------------------------------------------

def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "empty log"


def _failure_row(part: str, status: str) -> dict:
    return {"backend": part, "run": part, "tokens": "-", "method": part, "attention_type": part, "length": "-",
            "package": part, "check": part, "status": status}


def merge(output: Path, started: float | None = None) -> dict:
    results: dict = {"suite": {}}
    for part, sections in PARTS.items():
        try:
            code, seconds, limit = (int(x) for x in (output / f"{part}.rc").read_text().split())
        except (OSError, ValueError):
            code, seconds, limit = None, None, None
        source = output / part / "gpu_check.json" if sections else output / f"{part}.json"
        try:
            found = json.loads(source.read_text())
        except (OSError, ValueError):
            found = {}
        if found.get("environment") and "environment" not in results:
            results["environment"] = found["environment"]
        results["suite"][part] = {"exit": code, "seconds": seconds, "limit_s": limit}
        keys = sections or ("rows",)  # where the part's rows lie in its JSON
        by_key = {key: [{**row, "part": part} for row in found.get(key) or []] for key in keys}
        rows = [row for key_rows in by_key.values() for row in key_rows]
        if code is None:
            status = "FAIL: the part did not run"
        elif code in TIMED_OUT:
            status = f"FAIL: timed out after {limit} s ({_last_line(output / f'{part}.log')})"
        elif not rows:
            status = f"FAIL: exit {code}, no results ({_last_line(output / f'{part}.log')})"
        else:
            status = None
        results[part] = by_key[keys[0]] + ([_failure_row(part, status)] if status else [])
        for section in keys[1:]:  # the part's other sections: one it ended before is a FAIL row too
            results[section] = by_key[section] or ([] if status else [_failure_row(
                section, f"FAIL: exit {code}, no {section} rows ({_last_line(output / f'{part}.log')})")])
    results["targets"] = targets(results)
    if started is not None:
        results["suite"]["total_seconds"] = round(time.time() - started)
    return results


def failure_lines(results: dict) -> list[str]:
    """Every failed check: gpu_check's sections, the preflight and the model runs (not the targets)."""
    lines = check.failure_lines(results)
    for part in ("preflight", *MODEL_PARTS):
        for r in results.get(part, []):
            if r["status"].startswith("FAIL"):
                what = r["package"] if part == "preflight" else _run_name(r)
                lines.append(f"{part} {what}: {r['status']}")
    return lines


def _run_name(r: dict) -> str:
    parts = [str(r.get("attention_type", "")), str(r.get("length", ""))]
    if r.get("requested_backend", "auto") != "auto":
        parts.append(f"on {r['requested_backend']}")
    if r.get("anchor_path", "merge") != "merge":
        parts.append(r["anchor_path"])
    return " ".join(parts)


# --- targets ------------------------------------------------------------------------------------------

def _model_row(results: dict, part: str, length: int, kind: str, family: str | None = None,
               path: str = "merge") -> dict | None:
    """The finished run of ``kind`` at (``part``, ``length``): on that kernel family if given, else ``auto``'s choice."""
    for r in results.get(part, []):
        if (r["status"] == "ok" and r["attention_type"] == kind and r["length"] == length and r["anchor_path"] == path
                and (kernel_family(r["backend"]) == family if family else r["requested_backend"] == "auto")):
            return r
    return None


def _why_missing(results: dict, part: str, length: int, kind: str) -> str:
    for r in results.get(part, []):
        if r.get("attention_type") in (kind, part) and r.get("length") in (length, "-") and r["status"] != "ok":
            return f"not measured: {r['status']}"
    return f"not measured: no {kind} run at {length} in part {part}"


def _pairs(results: dict, shape: tuple[str, int], other: str) -> list[tuple[str, dict | None, dict | None, str]]:
    """(basis, anchor row, other row, why missing) comparisons of the anchor with ``other`` at ``shape``: on the
    anchor's kernel family, and each on its best where auto put them on different families."""
    part, length = shape
    anchor = _model_row(results, part, length, "anchor")
    if anchor is None:
        return [("same kernel family", None, None, _why_missing(results, part, length, "anchor"))]
    same = _model_row(results, part, length, other, family=kernel_family(anchor["backend"]))
    best = _model_row(results, part, length, other)
    out = [(f"both on {anchor['backend']}", anchor, same, _why_missing(results, part, length, other))]
    if best is not None and kernel_family(best["backend"]) != kernel_family(anchor["backend"]):
        out.append((f"each on its best: {anchor['backend']} / {best['backend']}", anchor, best, ""))
    return out


def _judge(target: str, shape: str, basis: str, value: float | None, bound: float, at_most: bool, shown: str,
           why: str = "") -> dict:
    if value is None:
        return {"target": target, "shape": shape, "basis": basis, "measured": why, "status": "FAIL"}
    ok = value <= bound if at_most else value >= bound
    return {"target": target, "shape": shape, "basis": basis, "measured": shown, "value": value,
            "status": "PASS" if ok else "FAIL"}


def _tokens(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def _shape_name(results: dict, shape: tuple[str, int]) -> str:
    part, length = shape
    row = _model_row(results, part, length, "anchor")
    layers = f", {row['layers']} layers" if row else ""
    model = row["shape"] if row else part
    return f"{model}{layers}, {_tokens(length)}"


def targets(results: dict) -> list[dict]:
    """Issue 35's targets (:data:`TARGETS`) judged on the merged rows; a target nothing measured is a FAIL row
    that says why. Model ratios compare the anchor with the other type on the same kernel family (and, where
    auto chose another family for it, each on its best too); the kernel ratio compares anchor and intra_doc
    on the backend auto picks for intra_doc."""
    smoke = (results.get("environment") or {}).get("gpu") == "cpu"  # --cpu-smoke: toy windows
    shape_of = {(part, length): (part, next((r["length"] for r in results.get(part, []) if r["status"] == "ok"), length)
                                 if smoke else length) for part, length in (SMOLLM2_8K, LLAMA8B_32K, LLAMA8B_64K)}
    rows = []
    for shape in (SMOLLM2_8K, LLAMA8B_32K, LLAMA8B_64K):
        at = shape_of[shape]
        for basis, anchor, other, why in _pairs(results, at, "intra_doc"):
            ratio = anchor["tokens_per_s"] / other["tokens_per_s"] if anchor and other else None
            rows.append(_judge(TARGETS[0], _shape_name(results, at), basis, ratio, 0.97, False,
                               f"{ratio:.3f}x" if ratio else "", why))
    at = shape_of[SMOLLM2_8K]
    for basis, anchor, other, why in _pairs(results, at, "full"):
        ratio = anchor["tokens_per_s"] / other["tokens_per_s"] if anchor and other else None
        rows.append(_judge(TARGETS[1], _shape_name(results, at), basis, ratio, 1.0, False,
                           f"{ratio:.3f}x" if ratio else "", why))
    at = shape_of[LLAMA8B_64K]
    for basis, anchor, other, why in _pairs(results, at, "full"):
        ratio = anchor["step_s"] / other["step_s"] if anchor and other else None
        rows.append(_judge(TARGETS[2], _shape_name(results, at), basis, ratio, 0.5, True,
                           f"{ratio:.3f}x ({anchor['step_s']:.2f} s / {other['step_s']:.2f} s)" if ratio else "", why))
    anchor = _model_row(results, *at, "anchor")
    rows.append(_judge(TARGETS[3], _shape_name(results, at), anchor["backend"] if anchor else "",
                       anchor["mfu"] if anchor else None, 0.40, False,
                       f"{anchor['mfu']:.1%} (HFU {anchor['hfu']:.1%})" if anchor else "",
                       _why_missing(results, *at, "anchor")))
    speed = [r for r in results.get("speed", []) if r.get("status") == "ok"]
    lengths = sorted({r["tokens"] for r in speed}) if smoke else KERNEL_LENGTHS
    for length in lengths:
        at_length = [r for r in speed if r["tokens"] == length]
        intra = next((r for r in at_length if r.get("mode") == "intra_doc"), None)
        anchor = intra and next((r for r in at_length if r.get("mode") == "anchor" and r["backend"] == intra["backend"]),
                                None)
        ratio = anchor["fwd_bwd_tflops"] / intra["fwd_bwd_tflops"] if anchor and intra else None
        why = next((f"not measured: {r['status']}" for r in results.get("speed", [])
                    if r.get("tokens") in (length, "-") and r["status"].startswith("FAIL")),
                   f"not measured: no anchor and intra_doc rows on one backend at {length}")
        rows.append(_judge(TARGETS[4], f"kernel, {_tokens(length)}", intra["backend"] if intra else "", ratio, 0.95,
                           False, f"{ratio:.3f}x ({anchor['fwd_bwd_tflops']:.3g} / {intra['fwd_bwd_tflops']:.3g} "
                           "TFLOP/s)" if ratio else "", why))
    return rows


# --- the report ---------------------------------------------------------------------------------------

def _model_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r.get("part", ""), r.get("tree", "-"), r.get("shape", "-"), r.get("length", "-"),
                         r.get("attention_type", "-"), r.get("requested_backend", "-"), r.get("anchor_path", "-"),
                         "-", "-", "-", "-", "-", "-", "-", "-", r["status"]])
            continue
        body.append([r["part"], r["tree"], r["shape"], r["length"], r["attention_type"], r["backend"], r["anchor_path"],
                     r["layers"], r["recompute"], round(r["step_s"], 3), round(r["tokens_per_s"]), f"{r['mfu']:.1%}",
                     f"{r['hfu']:.1%}", round(r["peak_gib"], 1), round(r.get("planned_gib", float("nan")), 1),
                     "ok" + (f" ({r['note']})" if r.get("note") else "")])
    return check.table(["part", "tree", "shape", "tokens", "attention_type", "backend", "anchor path", "layers",
                        "recomputed", "step s", "tokens/s", "MFU", "HFU", "peak GiB", "planned GiB", "status"], body)


def _side_by_side(results: dict) -> list[str]:
    """The anchor's two paths at each shape, and each type on this tree and the previous one."""
    out = []
    paths = []
    for part in ("smollm2", "llama8b_32k", "llama8b_64k"):
        for r in results.get(part, []):
            if r["status"] == "ok" and r["attention_type"] == "anchor" and r["anchor_path"] != "merge":
                merged = _model_row(results, part, r["length"], "anchor")
                if merged:
                    paths.append([r["shape"], r["length"], merged["backend"], round(merged["tokens_per_s"]),
                                  round(r["tokens_per_s"]), f"{merged['tokens_per_s'] / r['tokens_per_s']:.3f}"])
    if paths:
        out += ["## The anchor's paths (same run, same GPU)", "",
                check.table(["shape", "tokens", "backend", "merge tokens/s", "kv_copy tokens/s", "merge / kv_copy"],
                            paths), ""]
    trees = []
    for r in results.get("previous", []):
        if r["status"] != "ok":
            continue
        part = next((p for p in ("smollm2", "llama8b_32k", "llama8b_64k") if any(
            c.get("shape") == r["shape"] and c.get("length") == r["length"] for c in results.get(p, []))), None)
        now = part and _model_row(results, part, r["length"], r["attention_type"], path=r["anchor_path"])
        if now:
            trees.append([r["shape"], r["length"], r["attention_type"], now["backend"], round(now["tokens_per_s"]),
                          f"{r['backend']} ({r['tree']})", round(r["tokens_per_s"]),
                          f"{now['tokens_per_s'] / r['tokens_per_s']:.3f}"])
    if trees:
        out += ["## This tree against the previous one (same run, same GPU)", "",
                check.table(["shape", "tokens", "attention_type", "backend", "tokens/s", "previous backend",
                             "previous tokens/s", "this / previous"], trees), ""]
    return out


def _targets_table(rows: list[dict]) -> str:
    return check.table(["target", "shape", "basis", "measured", "status"],
                       [[r["target"], r["shape"], r["basis"], r["measured"], r["status"]] for r in rows])


def _heading(results: dict) -> tuple[str, str]:
    env = results.get("environment") or {}
    return env.get("gpu", "unknown device"), env.get("date", time.strftime("%Y-%m-%d"))


def markdown(results: dict) -> str:
    gpu, date = _heading(results)
    env = results.get("environment") or {}
    out = [f"# gpu_suite: {gpu}, {date}", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
           "Parts (exit, seconds, limit): " + ", ".join(
               f"{p} ({s['exit']}, {s['seconds']}, {s['limit_s']})" for p, s in results["suite"].items()
               if isinstance(s, dict)) + f"; total {results['suite'].get('total_seconds', '-')} s", ""]
    pre = [r for r in results.get("preflight", []) if r["status"] != "ok"]
    out += ["## Preflight (every package the parts import)", "",
            "\n".join(f"- {r['status']}" for r in pre) or "every package imports", ""]
    out += ["## Targets (issue 35, item 7)", "", _targets_table(results["targets"]), ""]
    models = [r for part in MODEL_PARTS for r in results.get(part, [])]
    out += ["## Training steps (Megatron GPT through the trainer's engine, bf16, one packed window; MFU counts model "
            "FLOPs, HFU adds the recomputed forward)", "", _model_table(models), ""]
    out += _side_by_side(results)
    out += check.section_tables(results)
    failures = failure_lines(results)
    out += ["## Failures", ""] + ([f"- {line}" for line in failures] or ["none"]) + [""]
    return "\n".join(out)


def paste_ready(results: dict) -> str:
    """What docs/results.md and the README's GPU table take, with the GPU's name and the date."""
    gpu, date = _heading(results)
    models = [r for part in MODEL_PARTS for r in results.get(part, [])]
    kernels = [[r["tokens"], r["method"], round(r["fwd_bwd_ms"], 2), round(r["fwd_bwd_tflops"])]
               for r in results.get("speed", []) if r.get("status") == "ok" and r.get("mode") in ("anchor", "intra_doc")]
    readme = [[f"{gpu}, {date}", r["target"], r["shape"], r["measured"], r["status"]] for r in results["targets"]]
    return "\n".join([
        "<!-- docs/results.md -->", "",
        f"## The GPU suite on one {gpu} ({date}, `bash scripts/gpu_suite.sh`)", "",
        ", ".join(f"{k}: {v}" for k, v in (results.get("environment") or {}).items()), "",
        "**Targets** (issue 35, item 7):", "", _targets_table(results["targets"]), "",
        "**Training steps**:", "", _model_table(models), "",
        *_side_by_side(results),
        "**Attention kernels**, fwd+bwd:", "",
        check.table(["tokens", "method", "fwd+bwd ms", "fwd+bwd TFLOP/s"], kernels), "",
        "<!-- README.md, the GPU table -->", "",
        check.table(["GPU, date", "target", "shape", "measured", "status"], readme), ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--preflight", action="store_true", help="import every package the parts need, then stop")
    parser.add_argument("--started", type=float, help="when the suite began (seconds since the epoch)")
    args = parser.parse_args(argv)
    if args.preflight:
        return preflight(args.output)
    results = merge(args.output, args.started)
    report = markdown(results)
    with atomic_file(args.output / "gpu_suite.json") as tmp:
        tmp.write_text(json.dumps(results, indent=1, default=str))
    with atomic_file(args.output / "gpu_suite.md") as tmp:
        tmp.write_text(report)
    with atomic_file(args.output / "results.md") as tmp:
        tmp.write_text(paste_ready(results))
    print(report)
    failures = failure_lines(results)
    missed = [t for t in results["targets"] if t["status"] != "PASS"]
    print(f"gpu_suite: {len(failures)} failure(s), {len(missed)} of {len(results['targets'])} target rows missed; "
          f"{args.output}/gpu_suite.json, gpu_suite.md and results.md (ready to paste)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
