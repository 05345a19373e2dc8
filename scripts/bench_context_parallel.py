"""Context-parallel attention: communication volume per strategy, and measured CPU step times.

    python scripts/bench_context_parallel.py                # computed table (Llama-3-8B heads, bf16)
    python scripts/bench_context_parallel.py --measure      # plus gloo runs on this machine

Computed: bytes each rank receives from the others for one attention layer in one training step
(forward + backward, no recompute), per strategy, as the window length and cp grow:

- a2a: q, k, v to head shards and the output back, then the same two exchanges of gradients in
  the backward: ``2 * (cp-1)/cp * t * (2*Hq + 2*Hkv) * D * bytes`` for t = tokens per rank.
- all_gather: k, v gathered (``(cp-1) * t * 2*Hkv * D * bytes``), their gradients
  reduce-scattered in the backward (the same again).

Measured: ``context_parallel_attention`` forward + backward (AnchorAttention mask, packed
documents) under torchrun with gloo on this CPU, and the bytes counted in the collectives it
actually called. Absolute CPU timings of gloo are not a scaling claim: the ranks share the
machine's cores, and gloo over loopback is nothing like NVLink or InfiniBand.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import attention_path, positive_int, positive_ints  # noqa: E402  (scripts/bench_args.py)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
STRATEGIES = ("a2a", "all_gather")


def bytes_per_layer_step(strategy: str, window: int, windows: int, cp: int, heads: int, kv_heads: int,
                         head_dim: int, element_bytes: int) -> float:
    """Bytes one rank receives from the others in one layer's forward + backward (formulas above)."""
    local_tokens = windows * window / cp
    if strategy == "a2a":
        return 2 * (cp - 1) / cp * local_tokens * (2 * heads + 2 * kv_heads) * head_dim * element_bytes
    return 2 * (cp - 1) * local_tokens * 2 * kv_heads * head_dim * element_bytes


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def computed_table(args) -> None:
    element_bytes = DTYPES[args.dtype].itemsize
    print(f"Computed: MiB received per rank per layer per step (fwd+bwd), 1 window, Hq={args.heads}, "
          f"Hkv={args.query_groups}, D={args.head_dim}, {args.dtype}")
    rows = []
    for window in args.windows:
        for cp in args.cp:
            a2a, gather = (bytes_per_layer_step(s, window, 1, cp, args.heads, args.query_groups, args.head_dim,
                                                element_bytes) for s in STRATEGIES)
            if args.heads % cp or args.query_groups % cp:
                rows.append([f"{window:,}", str(cp), "n/a (heads % cp)", _mib(gather), "-"])
            else:
                rows.append([f"{window:,}", str(cp), _mib(a2a), _mib(gather), f"{a2a / gather:.2f}"])
    _print_table(["window", "cp", "a2a", "all_gather", "a2a/all_gather"], rows)


# ------------------------------------------------------------------ measured (torchrun workers)
def _count_bytes(counter: dict) -> None:
    """Count what each collective brings in from the other ranks ((cp-1)/cp of the gathered data)."""
    import torch.distributed as dist

    def counting(name, gathered_argument):
        original = getattr(dist, name)

        def wrapper(*args, **kwargs):
            size = dist.get_world_size(kwargs.get("group"))
            tensor = args[gathered_argument]
            counter["bytes"] += tensor.numel() * tensor.element_size() * (size - 1) / size
            return original(*args, **kwargs)

        setattr(dist, name, wrapper)

    counting("all_to_all_single", 1)  # (output, input)
    counting("all_gather_into_tensor", 0)  # (output, input): the gathered output
    counting("reduce_scatter_tensor", 1)  # (output, input): the input to be summed


def _worker(spec: dict) -> None:
    import torch.distributed as dist

    from nemo_anchor.attention import anchor_attention
    from nemo_anchor.parallel.context_parallel import context_parallel_attention
    from nemo_anchor.attention.layout import lognormal_documents
    from nemo_anchor.parallel.load_balance import rank_positions

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)  # more threads than cores per rank makes CPU timings meaningless
    counter = {"bytes": 0.0}
    _count_bytes(counter)
    dtype, total = DTYPES[spec["dtype"]], spec["window"] * spec["windows"]
    g = torch.Generator().manual_seed(0)
    docs = torch.tensor(lognormal_documents(total, seed=0, mean_tokens=spec["window"] / 8, window=spec["window"]),
                        dtype=torch.int32)
    windows = torch.arange(0, total + 1, spec["window"], dtype=torch.int32)
    positions = rank_positions(tuple(windows.tolist()), cp, rank)
    full = {name: torch.randn(total, heads, spec["head_dim"], generator=g).to(dtype)
            for name, heads in (("q", spec["heads"]), ("k", spec["kv_heads"]), ("v", spec["kv_heads"]))}
    inputs = [full[name][positions].requires_grad_() for name in "qkv"]
    grad = torch.randn_like(inputs[0])

    def step():
        if cp == 1:
            out = anchor_attention(*inputs, docs, cu_windows=windows, mode="anchor", backend=spec["backend"])
        else:
            out = context_parallel_attention(*inputs, docs, windows, mask="anchor", backend=spec["backend"],
                                             cp_group=dist.group.WORLD, comm_type=spec["strategy"])
        out.backward(grad)

    step()  # warm-up: layout caches, first-call allocations
    counter["bytes"], times = 0.0, []
    for _ in range(spec["repeats"]):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"seconds": statistics.median(times),
                                                 "bytes": counter["bytes"] / spec["repeats"]}))
    dist.destroy_process_group()


def _measure(spec: dict, cp: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {**spec, "out": str(Path(tmp) / "result.json")}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
                   __file__, "--worker", json.dumps(spec)]
        proc = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise RuntimeError(f"worker failed (cp={cp}, {spec}):\n{proc.stderr[-3000:]}")
        return json.loads(Path(spec["out"]).read_text())


def measured_table(args) -> None:
    element_bytes = DTYPES[args.dtype].itemsize
    print(f"\nMeasured on this CPU ({os.cpu_count()} cores shared by the ranks, one thread each, gloo): one layer fwd+bwd, "
          f"{args.measure_windows_per_step} windows, AnchorAttention, Hq={args.measure_heads}, "
          f"Hkv={args.measure_query_groups}, D={args.measure_head_dim}, {args.dtype}, median of {args.repeats}")
    print(f"attention: {attention_path(args.backend, 'anchor', torch.device('cpu'))}")
    rows = []
    for window in args.measure_windows:
        for cp in args.measure_cp:
            for strategy in (("single process",) if cp == 1 else STRATEGIES):
                spec = dict(window=window, windows=args.measure_windows_per_step, heads=args.measure_heads,
                            kv_heads=args.measure_query_groups, head_dim=args.measure_head_dim, dtype=args.dtype,
                            strategy=strategy, backend=args.backend, repeats=args.repeats)
                result = _measure(spec, cp)
                computed = 0.0 if cp == 1 else bytes_per_layer_step(
                    strategy, window, args.measure_windows_per_step, cp, args.measure_heads,
                    args.measure_query_groups, args.measure_head_dim, element_bytes)
                rows.append([f"{window:,}", str(cp), strategy, _mib(computed), _mib(result["bytes"]),
                             f"{result['seconds'] * 1e3:,.0f}"])
                print("  ".join(rows[-1]), file=sys.stderr)
    _print_table(["window", "cp", "strategy", "MiB computed", "MiB counted", "step ms"], rows)
    print("CPU/gloo timings are not a scaling claim: ranks share the same cores and loopback gloo is not a GPU "
          "interconnect; they show that both strategies run, not how they scale.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from nemo_anchor.attention.functional import BACKENDS

    parser.add_argument("--heads", type=positive_int, default=32, help="query heads (default: Llama-3-8B's 32)")
    parser.add_argument("--query-groups", type=positive_int, default=8, help="key/value heads (default 8)")
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--windows", type=positive_ints, default=[8192, 32768, 131072, 262144], help="window lengths")
    parser.add_argument("--cp", type=positive_ints, default=[2, 4, 8, 16], help="context-parallel sizes")
    parser.add_argument("--measure", action="store_true", help="also time gloo runs on this machine")
    parser.add_argument("--measure-windows", type=positive_ints, default=[2048, 8192])
    parser.add_argument("--measure-windows-per-step", type=positive_int, default=1)
    parser.add_argument("--measure-cp", type=positive_ints, default=[1, 2, 4])
    parser.add_argument("--measure-heads", type=positive_int, default=8)
    parser.add_argument("--measure-query-groups", type=positive_int, default=4)
    parser.add_argument("--measure-head-dim", type=positive_int, default=64)
    parser.add_argument("--backend", choices=BACKENDS, default="cpu",
                        help="anchor_attention backend of the measured runs")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for heads, groups, name in ((args.heads, args.query_groups, ""), (args.measure_heads, args.measure_query_groups,
                                                                       "measure-")):
        if heads % groups:
            parser.error(f"--{name}heads {heads} is not a multiple of --{name}query-groups {groups}")
    for window in args.measure_windows if args.measure else ():
        for cp in args.measure_cp:
            if cp > 1 and window % (2 * cp):
                parser.error(f"--measure-windows {window} does not split into 2 x --measure-cp {cp} equal chunks")
    if args.worker:
        _worker(json.loads(args.worker))
        return 0
    computed_table(args)
    if args.measure:
        measured_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
