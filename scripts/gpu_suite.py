"""Merge the parts of ``scripts/gpu_suite.sh`` into ``gpu_suite.json`` and ``gpu_suite.md``.

    python scripts/gpu_suite.py OUTPUT_DIR [--started EPOCH]

Each part left ``OUTPUT_DIR/<part>/gpu_check.json`` (what it finished, written after each section) and
``OUTPUT_DIR/<part>.rc`` (exit status, seconds, limit). A part that crashed, timed out or wrote nothing
becomes one FAIL row of its section, with the last line of its log, instead of ending the suite.
Exit status: 1 when anything failed, else 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nemo_anchor import gpu_check as check
from nemo_anchor.atomic import atomic_file

PARTS = ("conformance", "speed", "smollm2", "cp2")
TIMED_OUT = (124, 137)  # timeout(1): the limit, then the kill


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "empty log"


def _failure_row(part: str, status: str) -> dict:
    return {"backend": part, "run": part, "tokens": "-", "method": part, "status": status}


def merge(output: Path, started: float | None = None) -> dict:
    results: dict = {"suite": {}}
    for part in PARTS:
        try:
            code, seconds, limit = (int(x) for x in (output / f"{part}.rc").read_text().split())
        except (OSError, ValueError):
            code, seconds, limit = None, None, None
        try:
            found = json.loads((output / part / "gpu_check.json").read_text())
        except (OSError, ValueError):
            found = {}
        if found.get("environment") and "environment" not in results:
            results["environment"] = found["environment"]
        results["suite"][part] = {"exit": code, "seconds": seconds, "limit_s": limit}
        rows = found.get(part)
        if code is None:
            status = "FAIL: the part did not run"
        elif code in TIMED_OUT:
            status = f"FAIL: timed out after {limit} s ({_last_line(output / f'{part}.log')})"
        elif not rows:
            status = f"FAIL: exit {code}, no results ({_last_line(output / f'{part}.log')})"
        else:
            status = None
        results[part] = (rows or []) + ([_failure_row(part, status)] if status else [])
    if started is not None:
        results["suite"]["total_seconds"] = round(time.time() - started)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--started", type=float, help="when the suite began (seconds since the epoch)")
    args = parser.parse_args(argv)
    results = merge(args.output, args.started)
    report = check.markdown_report(results, title="gpu_suite")
    with atomic_file(args.output / "gpu_suite.json") as tmp:
        tmp.write_text(json.dumps(results, indent=1, default=str))
    with atomic_file(args.output / "gpu_suite.md") as tmp:
        tmp.write_text(report)
    print(report)
    failures = check.failure_lines(results)
    print(f"gpu_suite: {len(failures)} failure(s); {args.output}/gpu_suite.json and gpu_suite.md")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
