"""Bytes that context parallelism's own plumbing writes per layer, forward and backward, on the CPU.

Two gloo processes run ``context_parallel_attention`` (a2a and all_gather) with the attention kernel stood in
by an op that writes only its output and gradients (like a real kernel), so what is counted is the
exchange's layout work: every aten op that writes memory outside the kernel, grouped by op, in units of
this rank's q+k+v bytes ("qkv"). Views are free; the collectives' receive buffers are listed apart.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cp_copies.py [--tokens 4096] [--cp 2]
"""
from __future__ import annotations

import argparse
import collections
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_anchor.attention.layout import PackLayout
from nemo_anchor.parallel import context_parallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import positive_int  # noqa: E402  (scripts/bench_args.py)

_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided"}


class WriteCounter(TorchDispatchMode):
    """Bytes each aten op writes, per op name: its outputs, or for an in-place op (``add_``, ``copy_``)
    the tensor it writes into. Views and other outputs that alias an input write nothing; allocations
    write nothing either (the collectives' receive buffers: they show as the collective's op)."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.paused or func.is_view or name in _ALLOCATIONS:
            return out
        inputs = {x.untyped_storage().data_ptr() for x in torch.utils._pytree.tree_leaves((args, kwargs))
                  if torch.is_tensor(x)}
        for x in torch.utils._pytree.tree_leaves(out):
            if torch.is_tensor(x) and (name.endswith("_") or x.untyped_storage().data_ptr() not in inputs):
                self.bytes[name] += x.numel() * x.element_size()
        return out


class KernelStandIn(torch.autograd.Function):
    """An attention kernel's footprint: it writes its output forward and dq, dk, dv backward; uncounted."""

    @staticmethod
    def forward(ctx, q, k, v, counter):
        ctx.counter, ctx.shapes = counter, (k.shape, v.shape)
        counter.paused = True
        out = q.clone(memory_format=torch.contiguous_format)
        counter.paused = False
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.paused = True
        dq = grad.clone(memory_format=torch.contiguous_format)
        dk, dv = (grad.new_zeros(shape) for shape in ctx.shapes)
        ctx.counter.paused = False
        return dq, dk, dv, None


def _worker(rank, world, port, tokens, heads, kv_heads, head_dim, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    total = tokens * world
    layout = PackLayout.of((0, total // 2, total), (0, total // 2, total))
    counter = WriteCounter()

    def kernel(q, k, v, *, layout, q_offset=0, **options):
        return KernelStandIn.apply(q, k, v, counter)

    context_parallel.anchor_attention = kernel  # this process measures the exchange only
    table = {}
    for comm_type in ("a2a", "all_gather"):
        q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        qkv_bytes = sum(x.numel() * x.element_size() for x in (q, k, v))

        def run():
            return context_parallel.context_parallel_attention(q, k, v, layout=layout, mask="anchor", cp_group=group,
                                                               comm_type=comm_type)

        torch.autograd.grad(run().sum(), (q, k, v))  # warm the caches (orders, chunk plans)
        counter.bytes.clear()
        with counter:
            out = run()
        forward = dict(counter.bytes)
        counter.bytes.clear()
        grad = torch.ones_like(out)
        with counter:
            torch.autograd.grad(out, (q, k, v), grad)
        backward = dict(counter.bytes)
        table[comm_type] = {"forward": {op: n / qkv_bytes for op, n in forward.items()},
                            "backward": {op: n / qkv_bytes for op, n in backward.items()}}
    if rank == 0:
        results.update(table)
    dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per rank")
    parser.add_argument("--cp", type=positive_int, default=2)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--kv-heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.cp < 2:
        parser.error(f"--cp {args.cp}: context parallelism needs 2 or more ranks")
    if args.tokens % 4:  # two windows of tokens x cp / 2, each cut into 2 x cp chunks
        parser.error(f"--tokens {args.tokens} is not a multiple of 4: the pack's two windows would not split into "
                     f"2 x --cp chunks each")
    return args


def main(argv=None):
    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.cp, port, args.tokens, args.heads, args.kv_heads, args.head_dim, results),
                 nprocs=args.cp)
        results = dict(results)
    print("attention: a stand-in kernel (writes its output and gradients only): no attention path is measured")
    print(f"bytes written outside the attention kernel per layer, in units of one rank's q+k+v "
          f"(cp={args.cp}, {args.tokens} tokens/rank, {args.heads}/{args.kv_heads} heads, head_dim {args.head_dim})")
    print(f"{'comm_type':<11} {'pass':<9} {'total':>6}  by op")
    for comm_type, passes in results.items():
        for name, ops in passes.items():
            detail = ", ".join(f"{op} {n:.2f}" for op, n in sorted(ops.items(), key=lambda item: -item[1]))
            print(f"{comm_type:<11} {name:<9} {sum(ops.values()):>6.2f}  {detail}")


if __name__ == "__main__":
    main()
