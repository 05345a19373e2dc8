"""Launches per attention layer: the anchor against intra_doc, forward and backward, at 8K, 32K and 128K.

The anchor costs one extra key per query (:mod:`nemo_anchor.attention.anchor_merge`); this counts
what that key costs in launches, the fixed price a layer pays whatever the sequence length. One
``anchor_attention`` call is one layer; it runs once first (the per-micro-batch plan is built and
cached there, as the first layer builds it for the others), then its forward and its backward are
counted apart: every aten op dispatched (a ``TorchDispatchMode``), each call of the attention
library (flash-attn's forward or backward) and each Triton kernel counted as one launch,
whatever it does inside.

On the CPU the library is the stand-in of ``tests/varlen_standins.py`` (its math through torch's
CPU flash kernel: launches are counted here, not digits), and no time is printed: a stand-in's time
says nothing about a GPU. With CUDA the named backend runs for real and each pass is also timed
(the median of ``--repeats``), in bf16 at a Llama-3-8B layer's heads unless told otherwise.

    python scripts/bench_launches.py                              # CPU, stand-ins, T = 8K, 32K, 128K
    python scripts/bench_launches.py --tokens 1024 4096 --paths merge kv_copy
    python scripts/bench_launches.py --backend fa3                # on a GPU

``--paths kv_copy`` adds the previous anchor path (``NEMO_ANCHOR_ANCHOR_PATH=kv_copy``: the anchor
copied in front of every document's keys) as a column.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_anchor import gpu
from nemo_anchor.attention import anchor_attention, fa3, fa4, flash
from nemo_anchor.attention.functional import backend_choice
from nemo_anchor.attention.layout import PackLayout, lognormal_documents

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import attention_path, positive_float, positive_int  # noqa: E402  (scripts/bench_args.py)

REPO = Path(__file__).resolve().parents[1]
ANCHOR_PATH_VARIABLE = "NEMO_ANCHOR_ANCHOR_PATH"


class LaunchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active; a call wrapped by :meth:`one_launch` counts once."""

    def __init__(self):
        super().__init__()
        self.launches = 0
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            self.launches += 1
        return func(*args, **(kwargs or {}))

    def one_launch(self, function):
        def call(*args, **kwargs):
            if not self._inside:
                self.launches += 1
            self._inside += 1
            try:
                return function(*args, **kwargs)
            finally:
                self._inside -= 1
        return call


class _CountedTriton:
    """A Triton kernel whose every launch (``kernel[grid](...)``) counts once."""

    def __init__(self, kernel, counter: LaunchCounter):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        return self.counter.one_launch(self.kernel[grid])


@contextlib.contextmanager
def counted_libraries(counter: LaunchCounter, backend: str, standins: bool):
    """The backend's library calls (stand-ins on the CPU) and our Triton kernels, each counted as one launch."""
    saved = {}

    def patch(owner, name, value):
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    accessors = {"flash": ("flash_attn_varlen_func", "flash_attn_varlen_backward"),
                 "fa3": ("flash_attn_3_varlen_func", "flash_attn_3_backward"),
                 "fa4": ("flash_attn_4_varlen_func", "flash_attn_4_backward")}
    if standins:
        sys.path.insert(0, str(REPO / "tests"))
        import varlen_standins  # tests/varlen_standins.py

        functions = {"flash": (varlen_standins.with_autograd(varlen_standins.flash_attn_varlen_func),
                               varlen_standins.flash_attn_varlen_backward),
                     "fa3": (varlen_standins.with_autograd(varlen_standins.fa3_varlen_func),
                             varlen_standins.fa3_backward),
                     "fa4": (varlen_standins.with_autograd(varlen_standins.fa4_varlen_func),
                             varlen_standins.fa4_backward)}[backend]
        for module in (flash, fa3, fa4):
            patch(module, "unavailable_reason", lambda q, needs_grad: None)
        math = varlen_standins.cpu_flash_math(counter.one_launch)
    else:
        functions = tuple(getattr(gpu, name)()[0] for name in accessors.get(backend, ()))
        math = contextlib.nullcontext()
    for name, function in zip(accessors.get(backend, ()), functions):
        patch(gpu, name, lambda counted=counter.one_launch(function): (counted, None))
    triton_kernels, _ = gpu.anchor_key_triton()
    for name in getattr(triton_kernels, "KERNELS", ()):
        patch(triton_kernels, name, _CountedTriton(getattr(triton_kernels, name), counter))
    try:
        with math:
            yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def anchor_path(path: str):
    previous = os.environ.get(ANCHOR_PATH_VARIABLE)
    os.environ[ANCHOR_PATH_VARIABLE] = path
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ANCHOR_PATH_VARIABLE]
        else:
            os.environ[ANCHOR_PATH_VARIABLE] = previous


def make_layer(args, tokens: int, device: torch.device):
    """q, k, v (requiring grad), the output gradient and the pack's layout: one window of log-normal documents."""
    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    def tensor(heads):
        return torch.randn(tokens, heads, args.head_dim, generator=generator).to(device, dtype).requires_grad_()

    q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
    grad = torch.randn(tokens, args.heads, args.head_dim, generator=generator).to(device, dtype)
    window = args.window or tokens
    bounds = lognormal_documents(tokens, args.seed, mean_tokens=args.mean_document, window=window)
    return q, k, v, grad, PackLayout.of(bounds, tuple(range(0, tokens + 1, window)))


def measure(args, counter: LaunchCounter, tokens: int, mode: str, device: torch.device) -> dict:
    """Launches of one layer's forward and backward, and (CUDA) their median times in ms."""
    q, k, v, grad, layout = make_layer(args, tokens, device)

    def forward():
        return anchor_attention(q, k, v, layout=layout, mode=mode, backend=args.backend)

    def backward(out):
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    backward(forward())  # the plan is built and cached here, once per micro-batch
    result = {}
    with counter:
        counter.launches = 0
        out = forward()
        result["forward"] = counter.launches
        counter.launches = 0
        backward(out)
        result["backward"] = counter.launches
    if device.type == "cuda":
        for phase in ("forward", "backward"):
            times = []
            for _ in range(args.repeats):
                out = forward() if phase == "backward" else None
                torch.cuda.synchronize()
                start = time.perf_counter()
                if phase == "forward":
                    out = forward()
                else:
                    backward(out)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            result[phase + " ms"] = statistics.median(times) * 1e3
    return result


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--backend", choices=["flash", "fa3", "fa4", "torch_varlen", "auto"],
                        default="auto" if cuda else "flash",
                        help="on the CPU: flash, fa3 or fa4 through their stand-ins")
    parser.add_argument("--heads", type=positive_int, default=32 if cuda else 2)
    parser.add_argument("--kv-heads", type=positive_int, default=8 if cuda else 1)
    parser.add_argument("--head-dim", type=positive_int, default=128 if cuda else 16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        default="bfloat16" if cuda else "float32")
    parser.add_argument("--mean-document", type=positive_float, default=1024, help="mean document length (log-normal)")
    parser.add_argument("--window", type=positive_int, default=None, help="tokens per window (default: one window)")
    parser.add_argument("--paths", nargs="+", choices=["merge", "kv_copy"], default=["merge"],
                        help=f"anchor paths ({ANCHOR_PATH_VARIABLE}) to count")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="timed runs per pass on CUDA (the median is printed)")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not cuda and args.backend not in ("flash", "fa3", "fa4"):
        parser.error(f"--backend {args.backend} has no CPU stand-in here; choose flash, fa3 or fa4")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    for tokens in args.tokens:
        if args.window is not None and (args.window > tokens or tokens % args.window):
            parser.error(f"--window {args.window} does not divide --tokens {tokens} into whole windows")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    counter = LaunchCounter()
    rows = []
    with counted_libraries(counter, args.backend, standins=not cuda):
        for tokens in args.tokens:
            intra = measure(args, counter, tokens, "intra_doc", device)
            anchors = {}
            for path in args.paths:
                with anchor_path(path):
                    anchors[path] = measure(args, counter, tokens, "anchor", device)
            rows.append((tokens, intra, anchors))

    where = (f"CUDA {torch.cuda.get_device_name()}" if cuda else "CPU, stand-in kernels (no times: not a GPU)")
    probe = torch.empty(1, args.heads, args.head_dim, dtype=getattr(torch, args.dtype), device=device)
    backend = args.backend if not cuda else backend_choice(args.backend, probe, True, "anchor")[0]
    print(f"\nattention: {attention_path(backend, 'anchor', device)}")
    print(f"launches per layer, backend {args.backend}, {where}; heads {args.heads}/{args.kv_heads}, "
          f"d={args.head_dim}, {args.dtype}, documents of mean {args.mean_document:.0f} tokens, "
          f"{'one window' if not args.window else f'windows of {args.window}'}")
    header = ["T", "pass", "intra_doc"]
    for path in args.paths:
        header += [f"anchor {path}", "added", "anchor / intra_doc"]
    if cuda:
        header += ["intra_doc ms"] + [f"anchor {path} ms" for path in args.paths] + \
                  [f"ms anchor {path} / intra_doc" for path in args.paths]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for tokens, intra, anchors in rows:
        for phase in ("forward", "backward"):
            cells = [str(tokens), phase, str(intra[phase])]
            for path in args.paths:
                count = anchors[path][phase]
                cells += [str(count), f"{count - intra[phase]:+d}", f"{count / intra[phase]:.2f}"]
            if cuda:
                key = phase + " ms"
                cells += [f"{intra[key]:.3f}"] + [f"{anchors[p][key]:.3f}" for p in args.paths]
                cells += [f"{anchors[p][key] / intra[key]:.3f}" for p in args.paths]
            print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
