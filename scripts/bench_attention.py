"""Benchmark AnchorAttention against the ways of masking packed documents with plain PyTorch.

One packed window (document lengths drawn from a seeded log-normal, like real corpora; the
window's first token is the anchor), every method side by side, forward and forward+backward:

  full causal SDPA        the cost of ignoring documents (the ratio column's denominator)
  dense-mask SDPA         SDPA with a [T, T] boolean anchor mask (what a 4-D mask does in HF)
  per-doc masked SDPA     SDPA per document over [anchor, document] keys with an explicit mask
  anchor_attention ...    our backends that run here (flex: forward only on the CPU)

Each measurement runs in its own subprocess, so its peak memory is clean: the peak RSS during
the timed runs (after one warm-up run) minus the RSS once the inputs exist. GFLOP/s counts the useful work, the (query,
key) pairs the method's mask allows (4 * D flops each per head forward, 3.5x that forward +
backward), so a method that computes masked-out scores shows a low rate.

    python scripts/bench_attention.py                        # T=8192, 8 heads, d=64, 16 docs, fp32
    python scripts/bench_attention.py --peak-rss --tokens 131072 --heads 4   # memory target only
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from nemo_anchor.attention import anchor_attention
from nemo_anchor.attention.layout import layout_blocks
from nemo_anchor.attention.reference import dense_mask

# name -> (mask whose allowed pairs count as useful work, supports backward on the CPU)
METHODS = {
    "full causal SDPA": ("full", True),
    "dense-mask SDPA": ("anchor", True),
    "per-doc masked SDPA": ("anchor", True),
    "anchor_attention cpu": ("anchor", True),
    "anchor_attention cpu, intra_doc": ("intra_doc", True),
    "anchor_attention flex": ("anchor", False),
    "anchor_attention reference": ("anchor", True),
}
DENSE_METHODS = ("dense-mask SDPA", "anchor_attention reference")  # O(T^2) memory


def document_bounds(tokens: int, docs: int, seed: int) -> torch.Tensor:
    """int32 cu_seqlens of ``docs`` documents with log-normal lengths summing to ``tokens``."""
    weights = torch.randn(docs, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).exp()
    lengths = (weights / weights.sum() * (tokens - docs)).long() + 1  # every document >= 1 token
    lengths[-1] += tokens - lengths.sum()
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).int()


def allowed_pairs(cu_seqlens: torch.Tensor, mode: str) -> int:
    tokens = int(cu_seqlens[-1])
    blocks = layout_blocks(cu_seqlens, None, mode, tokens, 0, tokens)
    return sum((b.end - b.start) * (b.end - b.start + 1) // 2 + (b.end - b.start) * (b.anchor is not None) for b in blocks)


def method_function(name: str, q, k, v, cu_seqlens):
    """A closure computing ``name`` on [T, H, D] inputs; returns [T, H, D] or [1, H, T, D]."""
    bhsd = [x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
    if name == "full causal SDPA":
        return lambda: F.scaled_dot_product_attention(*bhsd, is_causal=True, enable_gqa=True)
    if name == "dense-mask SDPA":
        tokens = q.shape[0]
        mask = dense_mask(layout_blocks(cu_seqlens, None, "anchor", tokens, 0, tokens), 0, tokens, q.device)
        return lambda: F.scaled_dot_product_attention(*bhsd, attn_mask=mask, enable_gqa=True)
    if name == "per-doc masked SDPA":
        return lambda: per_document_masked_sdpa(q, k, v, cu_seqlens.tolist())
    backend, _, mode = name.removeprefix("anchor_attention ").partition(", ")
    return lambda: anchor_attention(q, k, v, cu_seqlens, mode=mode or "anchor", backend=backend)


def per_document_masked_sdpa(q, k, v, bounds: list[int]) -> torch.Tensor:
    """Anchor attention the straightforward way: per document, keys [anchor, document], a mask."""
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        n, rows = end - start, slice(start, end)
        if start == 0:
            keys, values, mask = k[rows], v[rows], torch.ones(n, n, dtype=torch.bool).tril()
        else:
            keys, values = torch.cat([k[:1], k[rows]]), torch.cat([v[:1], v[rows]])
            mask = torch.cat([torch.ones(n, 1, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
        out = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, enable_gqa=True
        )
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def memory_status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(config: dict) -> dict:
    """Time one method and pass in this (fresh) process."""
    torch.manual_seed(config["seed"])
    torch.set_num_threads(config["threads"])
    dtype = getattr(torch, config["dtype"])
    cu_seqlens = document_bounds(config["tokens"], config["docs"], config["seed"])
    backward = config["pass"] == "fwd+bwd"
    shape_q = (config["tokens"], config["heads"], config["head_dim"])
    shape_kv = (config["tokens"], config["kv_heads"], config["head_dim"])
    q, k, v = (torch.randn(s, dtype=dtype, requires_grad=backward) for s in (shape_q, shape_kv, shape_kv))
    run = method_function(config["method"], q, k, v, cu_seqlens)
    rss_with_inputs = memory_status("VmRSS")

    def once() -> float:
        start = time.perf_counter()
        if backward:
            out = run()
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                run()
        return time.perf_counter() - start

    if config["warmup"]:
        once()  # thread pools, allocator, FlexAttention compilation
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # restart the peak-RSS counter (VmHWM) after the warm-up
    times = [once() for _ in range(config["repeats"])]
    return {"seconds": min(times), "peak_bytes": memory_status("VmHWM") - rss_with_inputs,
            "process_peak_bytes": memory_status("VmHWM")}


def measure(config: dict) -> dict:
    result = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)], capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_table(args, cu_seqlens, results) -> None:
    lengths = cu_seqlens.diff().tolist()
    full_pairs = allowed_pairs(cu_seqlens, "full")
    print(f"\nT={args.tokens} heads={args.heads} kv_heads={args.kv_heads} d={args.head_dim} {args.dtype} "
          f"threads={args.threads} docs={len(lengths)} (lengths {min(lengths)}..{max(lengths)}, seed {args.seed}); "
          f"anchor mask allows {allowed_pairs(cu_seqlens, 'anchor') / full_pairs:.4f} of the causal pairs")
    header = f"| {'method':34s} | pass    | {'time ms':>9s} | {'x full causal':>13s} | {'GFLOP/s':>8s} | {'peak MB':>8s} |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for (name, phase), result in results.items():
        if "seconds" not in result:
            print(f"| {name:34s} | {phase:7s} | {result.get('error', '')[:60]} |")
            continue
        baseline = results[("full causal SDPA", phase)].get("seconds")
        flops = 4 * args.head_dim * args.heads * allowed_pairs(cu_seqlens, METHODS[name][0]) * (3.5 if phase == "fwd+bwd" else 1)
        ratio = f"{result['seconds'] / baseline:.4f}" if baseline else "-"
        print(f"| {name:34s} | {phase:7s} | {result['seconds'] * 1e3:9.1f} | {ratio:>13s} | "
              f"{flops / result['seconds'] / 1e9:8.1f} | {result['peak_bytes'] / 2**20:8.0f} |")


def check_targets(results) -> None:
    ours = results.get(("anchor_attention cpu", "fwd+bwd"), {}).get("seconds")
    full = results.get(("full causal SDPA", "fwd+bwd"), {}).get("seconds")
    per_doc = results.get(("per-doc masked SDPA", "fwd+bwd"), {}).get("seconds")
    if ours and full and per_doc:
        print(f"\nanchor cpu fwd+bwd: {ours / full:.4f}x full causal SDPA (target <= 0.04), "
              f"{per_doc / ours:.2f}x faster than per-doc masked SDPA (target >= 1.5)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192, help="T, tokens in the packed window")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (the fastest is reported: load only adds time)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--max-dense-gb", type=float, default=4.0,
                        help="skip the O(T^2) methods when one fp32 [H, T, T] score tensor exceeds this")
    parser.add_argument("--peak-rss", action="store_true",
                        help="only anchor_attention cpu forward+backward; print the process's total peak RSS")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    args.kv_heads = args.kv_heads or args.heads
    config = {key: getattr(args, key) for key in ("tokens", "heads", "kv_heads", "head_dim", "docs", "dtype", "seed", "repeats", "threads")}
    config["warmup"] = not args.peak_rss
    cu_seqlens = document_bounds(args.tokens, args.docs, args.seed)

    if args.peak_rss:
        result = measure({**config, "method": "anchor_attention cpu", "pass": "fwd+bwd", "repeats": 1})
        if "error" in result:
            print(result["error"], file=sys.stderr)
            return 1
        print(f"anchor_attention cpu fwd+bwd, T={args.tokens} heads={args.heads} d={args.head_dim} docs={args.docs} "
              f"{args.dtype}: {result['seconds']:.1f} s, process peak RSS {result['process_peak_bytes'] / 2**30:.2f} GB")
        return 0

    dense_gb = 4 * args.heads * args.tokens**2 / 2**30
    results = {}
    for name in args.methods:
        for phase in ("forward", "fwd+bwd"):
            if name in DENSE_METHODS and dense_gb > args.max_dense_gb:
                results[(name, phase)] = {"error": f"skipped: [H, T, T] scores would take {dense_gb:.0f} GB"}
            elif phase == "fwd+bwd" and not METHODS[name][1]:
                results[(name, phase)] = {"error": "n/a: no backward on the CPU"}
            else:
                print(f"measuring {name}, {phase}", file=sys.stderr, flush=True)
                results[(name, phase)] = measure({**config, "method": name, "pass": phase})
    print_table(args, cu_seqlens, results)
    check_targets(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
