"""Benchmark AnchorAttention against the ways of masking packed documents with plain PyTorch.

One packed window (document lengths drawn from a seeded log-normal, like real corpora; the
window's first token is the anchor), every method side by side, forward and forward+backward:

  full causal SDPA        the cost of ignoring documents (the ratio column's denominator)
  dense-mask SDPA         SDPA with a [T, T] boolean anchor mask (what a 4-D mask does in HF)
  per-doc masked SDPA     SDPA per document over [anchor, document] keys with an explicit mask
  anchor_attention ...    our backends that run here (flex: forward only on the CPU)

Times are the fastest of ``--repeats`` runs after a warm-up, the methods interleaved run by run
so that load from other processes falls on all of them alike. Peak memory is measured apart,
one fresh subprocess per method and pass: the peak RSS of a run after the warm-up minus the RSS
once the inputs exist. GFLOP/s counts useful work only, the (query, key) pairs the method's mask
allows (4 * D flops per pair and head forward, 3.5x that forward+backward): a method that
computes masked-out scores shows a low rate. ``FLOP/s x SDPA`` divides that rate by full causal
SDPA's on contiguous ``[1, H, T, D]`` input in the same run (the CPU backend's target: >= 0.8).

    python scripts/bench_attention.py                        # T=8192, 8 heads, d=64, 16 docs, fp32
    python scripts/bench_attention.py --peak-rss --tokens 131072 --heads 4   # memory target only
    python scripts/bench_attention.py --kernel-scaling --threads 1           # the kernel's own ceiling

``--kernel-scaling`` times torch's CPU flash-attention kernel alone (causal, forward+backward)
on batches of equal-length sequences that fill the window, from 64 tokens up to T. The CPU
backend runs every document through that kernel, so the kernel's rate at a layout's document
lengths bounds the backend's rate on that layout.
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
from tqdm import tqdm

from nemo_anchor.attention import anchor_attention
from nemo_anchor.attention.layout import layout_blocks, lognormal_documents, pack_layout
from nemo_anchor.attention.reference import dense_mask
from nemo_anchor.cpu_bf16 import bf16_matmuls_in_fp32

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import attention_path, positive_float, positive_int  # noqa: E402  (scripts/bench_args.py)

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
    """int32 cu_seqlens of about ``docs`` documents with log-normal lengths (mean ``tokens / docs``) filling ``tokens``."""
    return torch.tensor(lognormal_documents(tokens, seed, mean_tokens=tokens / docs), dtype=torch.int32)


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


def make_inputs(config: dict):
    """The packed window's q, k, v (requiring grad) and cu_seqlens; a function of the seed."""
    torch.manual_seed(config["seed"])
    dtype = getattr(torch, config["dtype"])
    shape_q = (config["tokens"], config["heads"], config["head_dim"])
    shape_kv = (config["tokens"], config["kv_heads"], config["head_dim"])
    q, k, v = (torch.randn(s, dtype=dtype, requires_grad=True) for s in (shape_q, shape_kv, shape_kv))
    return q, k, v, document_bounds(config["tokens"], config["docs"], config["seed"])


def runner(name: str, phase: str, q, k, v, cu_seqlens):
    """One forward (no autograd graph) or forward+backward of method ``name``.

    bf16 runs on a CPU without BF16 units compute their products as training does there
    (``nemo_anchor.cpu_bf16``), for every method alike.
    """
    run = method_function(name, q, k, v, cu_seqlens)

    def once() -> None:
        with bf16_matmuls_in_fp32(q.dtype, q.device):
            if phase == "forward":
                with torch.no_grad():
                    run()
                return
            out = run()
            out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    return once


def time_round_robin(measurements, q, k, v, cu_seqlens, repeats: int) -> dict:
    """Fastest wall time of each (method, phase), the runs interleaved so that load from other
    processes falls on all methods alike."""
    runs, results = {}, {}
    for name, phase in measurements:
        try:
            runs[(name, phase)] = runner(name, phase, q, k, v, cu_seqlens)
            runs[(name, phase)]()  # warm-up: thread pools, allocator, FlexAttention compilation
        except Exception as error:  # noqa: BLE001 - reported in the table
            runs.pop((name, phase), None)
            results[(name, phase)] = {"error": f"{type(error).__name__}: {error}"}
    times = {key: [] for key in runs}
    for _ in tqdm(range(repeats), desc="timing rounds", file=sys.stderr):
        for key, once in runs.items():
            times[key].append(timed(once))
    return {**results, **{key: {"seconds": min(samples)} for key, samples in times.items()}}


def memory_worker(config: dict) -> dict:
    """Peak memory of one method and phase, in this fresh process."""
    q, k, v, cu_seqlens = make_inputs(config)
    once = runner(config["method"], config["phase"], q, k, v, cu_seqlens)
    rss_with_inputs = memory_status("VmRSS")
    if config["warmup"]:
        once()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # restart the peak-RSS counter (VmHWM): the warm-up's compilation is not counted
    return {"seconds": timed(once), "peak_bytes": memory_status("VmHWM") - rss_with_inputs,
            "process_peak_bytes": memory_status("VmHWM")}


def measure_memory(config: dict) -> dict:
    result = subprocess.run([sys.executable, __file__, "--worker", json.dumps(config)], capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def print_table(args, cu_seqlens, results) -> None:
    lengths = cu_seqlens.diff().tolist()
    full_pairs = pack_layout(cu_seqlens).kept_pairs("full")
    print(f"\nT={args.tokens} heads={args.heads} kv_heads={args.kv_heads} d={args.head_dim} {args.dtype} "
          f"threads={args.threads} docs={len(lengths)} (lengths {min(lengths)}..{max(lengths)}, seed {args.seed}); "
          f"anchor mask allows {pack_layout(cu_seqlens).kept_pairs('anchor') / full_pairs:.4f} of the causal pairs")
    header = (f"| {'method':34s} | pass    | {'time ms':>9s} | {'x full causal':>13s} | {'GFLOP/s':>8s} | "
              f"{'FLOP/s x SDPA':>13s} | {'peak MB':>8s} |")
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for (name, phase), result in results.items():
        if "seconds" not in result:
            print(f"| {name:34s} | {phase:7s} | {result.get('error', '')[:60]} |")
            continue
        baseline = results.get(("full causal SDPA", phase), {}).get("seconds")
        rate = useful_flops(args, cu_seqlens, name, phase) / result["seconds"]
        ratio = f"{result['seconds'] / baseline:.4f}" if baseline else "-"
        rate_ratio = f"{rate / (useful_flops(args, cu_seqlens, 'full causal SDPA', phase) / baseline):.2f}" if baseline else "-"
        peak = f"{result['peak_bytes'] / 2**20:.0f}" if result.get("peak_bytes") is not None else "-"
        print(f"| {name:34s} | {phase:7s} | {result['seconds'] * 1e3:9.1f} | {ratio:>13s} | "
              f"{rate / 1e9:8.1f} | {rate_ratio:>13s} | {peak:>8s} |")


def kernel_scaling(args) -> None:
    """Torch's CPU flash kernel alone, causal fwd+bwd, on ``T / L`` sequences of ``L`` tokens, against ``L = T``."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    dtype, scale = getattr(torch, args.dtype), args.head_dim ** -0.5
    lengths = [2 ** i for i in range(6, args.tokens.bit_length()) if 2 ** i < args.tokens] + [args.tokens]
    rates = {}
    for length in tqdm(lengths, desc="kernel scaling", file=sys.stderr):
        count = args.tokens // length
        q, k, v, grad = (torch.randn(count, args.heads, length, args.head_dim, dtype=dtype) for _ in range(4))

        def once() -> None:
            with bf16_matmuls_in_fp32(dtype, q.device):
                out, lse = flash(q, k, v, 0.0, True, scale=scale)
                flash_backward(grad, q, k, v, out, lse, 0.0, True, scale=scale)

        once()
        seconds = min(timed(once) for _ in range(args.repeats))
        pairs = count * length * (length + 1) // 2
        rates[length] = (seconds, 4 * args.head_dim * args.heads * pairs * 3.5 / seconds)
    print(f"\ntorch's CPU flash kernel alone, causal fwd+bwd, T={args.tokens} tokens as T/L sequences of L, "
          f"heads={args.heads} d={args.head_dim} {args.dtype} threads={args.threads}")
    print("| L | sequences | time ms | GFLOP/s | x rate at L=T |")
    print("| --- | --- | --- | --- | --- |")
    for length, (seconds, rate) in rates.items():
        print(f"| {length} | {args.tokens // length} | {seconds * 1e3:.1f} | {rate / 1e9:.1f} | "
              f"{rate / rates[args.tokens][1]:.2f} |")


def kernel_share(q, k, v, cu_seqlens) -> float:
    """The share of one ``anchor_attention`` cpu fwd+bwd spent inside torch's flash kernel (torch.profiler)."""
    once = runner("anchor_attention cpu", "fwd+bwd", q, k, v, cu_seqlens)
    once()
    with torch.profiler.profile() as profiler:
        once()
    events = profiler.key_averages()
    kernel = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::_scaled_dot_product_flash_attention"))
    return kernel / sum(e.self_cpu_time_total for e in events)


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def useful_flops(args, cu_seqlens, name: str, phase: str) -> float:
    """FLOPs on the pairs the method's mask keeps: 4 D per pair and head forward, 3.5x that forward+backward."""
    pairs = pack_layout(cu_seqlens).kept_pairs(METHODS[name][0])
    return 4 * args.head_dim * args.heads * pairs * (3.5 if phase == "fwd+bwd" else 1)


def check_targets(args, cu_seqlens, results, in_kernel: float | None) -> None:
    ours = results.get(("anchor_attention cpu", "fwd+bwd"), {}).get("seconds")
    full = results.get(("full causal SDPA", "fwd+bwd"), {}).get("seconds")
    per_doc = results.get(("per-doc masked SDPA", "fwd+bwd"), {}).get("seconds")
    if ours and full:
        rate = (useful_flops(args, cu_seqlens, "anchor_attention cpu", "fwd+bwd") / ours) / (
            useful_flops(args, cu_seqlens, "full causal SDPA", "fwd+bwd") / full)
        print(f"\nanchor cpu fwd+bwd: {rate:.2f}x full causal SDPA's FLOP/s on the kept pairs (target >= 0.8)"
              + (f"; {in_kernel:.0%} of its time inside torch's flash kernel" if in_kernel is not None else ""))
    if ours and full and per_doc:
        print(f"\nanchor cpu fwd+bwd: {ours / full:.4f}x full causal SDPA (target <= 0.04), "
              f"{per_doc / ours:.2f}x faster than per-doc masked SDPA (target >= 1.5)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=8192, help="T, tokens in the packed window")
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--kv-heads", type=positive_int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--docs", type=positive_int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs after one warm-up (the fastest is reported: load only adds time)")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count())
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--max-dense-gb", type=positive_float, default=4.0,
                        help="skip the O(T^2) methods when one fp32 [H, T, T] score tensor exceeds this")
    parser.add_argument("--peak-rss", action="store_true",
                        help="only anchor_attention cpu forward+backward; print the process's total peak RSS")
    parser.add_argument("--kernel-scaling", action="store_true",
                        help="only torch's CPU flash kernel, causal fwd+bwd, at sequence lengths 64..T")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(memory_worker(json.loads(args.worker))))
        return 0
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.docs > args.tokens:
        parser.error(f"--docs {args.docs} is more documents than --tokens {args.tokens}")
    print("attention: " + "; ".join(attention_path(m.removeprefix("anchor_attention ").split(",")[0], "anchor",
                                                   torch.device("cpu"))
                                    for m in args.methods if m.startswith("anchor_attention")) + " (CPU)")
    if args.kernel_scaling:
        kernel_scaling(args)
        return 0
    config = {key: getattr(args, key) for key in ("tokens", "heads", "kv_heads", "head_dim", "docs", "dtype", "seed")}

    if args.peak_rss:  # one run in a fresh process: everything it ever held counts
        result = measure_memory({**config, "method": "anchor_attention cpu", "phase": "fwd+bwd", "warmup": False})
        if "error" in result:
            print(result["error"], file=sys.stderr)
            return 1
        print(f"anchor_attention cpu fwd+bwd, T={args.tokens} heads={args.heads} d={args.head_dim} docs={args.docs} "
              f"{args.dtype}: {result['seconds']:.1f} s, process peak RSS {result['process_peak_bytes'] / 2**30:.2f} GB")
        return 0

    dense_gb = 4 * args.heads * args.tokens**2 / 2**30
    skipped, measurements = {}, []
    for name in args.methods:
        for phase in ("forward", "fwd+bwd"):
            if name in DENSE_METHODS and dense_gb > args.max_dense_gb:
                skipped[(name, phase)] = {"error": f"skipped: [H, T, T] scores would take {dense_gb:.0f} GB"}
            elif phase == "fwd+bwd" and not METHODS[name][1]:
                skipped[(name, phase)] = {"error": "n/a: no backward on the CPU"}
            else:
                measurements.append((name, phase))
    q, k, v, cu_seqlens = make_inputs(config)
    results = {**skipped, **time_round_robin(measurements, q, k, v, cu_seqlens, args.repeats)}
    share = kernel_share(q, k, v, cu_seqlens) if "seconds" in results.get(("anchor_attention cpu", "fwd+bwd"), {}) else None
    del q, k, v
    for key in tqdm(measurements, desc="peak memory", file=sys.stderr):
        if "seconds" in results[key]:
            memory = measure_memory({**config, "method": key[0], "phase": key[1], "warmup": True})
            results[key]["peak_bytes"] = memory.get("peak_bytes")
    order = [(name, phase) for name in METHODS for phase in ("forward", "fwd+bwd")]
    results = {key: results[key] for key in sorted(results, key=order.index)}
    print_table(args, cu_seqlens, results)
    check_targets(args, cu_seqlens, results, share)
    return 0


if __name__ == "__main__":
    sys.exit(main())
