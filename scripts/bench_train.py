"""Training throughput, MFU, HFU and peak memory per attention_type and window length, side by side.

    python scripts/bench_train.py                       # tiny model, 4K/8K/16K windows, every attention type
    python scripts/bench_train.py --lengths 4096 --steps 3
    python scripts/bench_train.py --model smollm2 --kinds anchor intra_doc full --lengths 8192
    python scripts/bench_train.py --model llama3-8b-layers --layers auto --lengths 32768 65536 \\
        --kinds anchor intra_doc full --anchor-paths merge kv_copy --same-family --json out.json
    python scripts/bench_train.py --model smollm2 --lengths 8192 --tree .previous   # an older source tree

Each run is one fresh subprocess (clean peak memory): Megatron's GPT through the trainer's own engine
(Megatron DDP, fp32 master weights, Megatron AdamW), bf16 on a GPU, one packed window per step whose
documents have seeded log-normal lengths (``--mean-doc``), random tokens, random weights (their values
do not change the time). Shapes (``--model``): ``tiny``, a small Llama-shaped model; ``smollm2``,
SmolLM2-135M's; ``llama3-8b-layers``, Llama-3-8B's layer and vocabulary with ``--layers auto``: as
many layers as the memory planner (``nemo_anchor.training.memory``, what ``nemo-anchor plan`` runs) fits
on one GPU of ``--gpu-memory`` (default: this GPU's memory). Every run uses the planner's recompute: none
when the run fits without, else full recompute of the fewest layers that fit.

Rows: tokens/s, the ratio against ``full`` at the same window and tree, model TFLOP/s, MFU and HFU
(``nemo_anchor.model.flops`` over the best timed step, against the published bf16 peak of the GPU, or
the fastest matmul this CPU has shown; HFU adds the recomputed forward), peak memory (allocated, GPU;
RSS, CPU). ``--anchor-paths merge kv_copy`` adds anchor runs with ``NEMO_ANCHOR_ANCHOR_PATH=kv_copy``
(the previous K/V-copy path, so progress is told from run-to-run noise in one session);
``--same-family`` adds, where ``auto`` put another attention type on another kernel family than the
anchor, that type on the anchor's backend too. ``--tree DIR`` runs the workers on the source tree in
DIR (e.g. ``git archive ebc4ccd | tar -x -C .previous``) while FLOPs and the plan come from this one.
``--json PATH`` writes every row after each run. ``--deadline S`` stops starting runs after S seconds
and marks the rest not run, so a part's own time limit never loses the finished rows.

``--precision auto`` (the default) trains in bf16 on a GPU and, on the CPU, in the precision whose
matmuls run faster there (measured first and printed). ``--profile`` adds one step under
torch.profiler per row and prints its most expensive operators.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_args import attention_path, non_negative_int, positive_float, positive_int  # noqa: E402
KINDS = ("full", "intra_doc", "intra_doc_reset", "anchor")
# which anchor path attention/anchor_merge.py takes: merge (the default) | kv_copy (the previous path)
ANCHOR_PATH_ENV = "NEMO_ANCHOR_ANCHOR_PATH"
ANCHOR_PATHS = ("merge", "kv_copy")
GIB = 1024 ** 3

# model fields and vocabulary of each shape; num_layers is the most ``--layers auto`` plans
SHAPES = {
    "tiny": (dict(num_layers=4, hidden_size=256, ffn_hidden_size=640, num_attention_heads=4, num_query_groups=2),
             4096),
    # HuggingFaceTB/SmolLM2-135M's config.json
    "smollm2": (dict(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9, num_query_groups=3,
                     tie_embeddings=True, rotary_base="100000"), 49152),
    # meta-llama/Meta-Llama-3-8B's config.json
    "llama3-8b-layers": (dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                              num_query_groups=8, rotary_base="500000"), 128256),
}


@dataclass(frozen=True)
class Run:
    kind: str  # attention_type
    length: int
    backend: str = "auto"
    anchor_path: str = "merge"
    note: str = ""  # why this run is there beyond the plain grid (same kernel family, previous path)


# --- the worker: one run in this process -----------------------------------------------------------

def worker(spec: dict) -> dict:
    """One run of ``spec`` (model fields, vocabulary, steps, documents) through the trainer's engine."""
    import resource

    import torch

    import nemo_anchor
    from nemo_anchor.attention.functional import select_backend
    from nemo_anchor.attention.layout import lognormal_documents
    from nemo_anchor.attention.paradigms import get_attention_type
    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.parallel.context_parallel import batch_for_this_rank
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.training.config import OptimConfig, RunConfig, TrainerConfig
    from nemo_anchor.training.engine import build_engine, train_step
    from nemo_anchor.training.throughput import resolve_peak_tflops

    model = ModelConfig(**spec["model"])
    steps, warmup, T, vocab = spec["steps"], spec["warmup"], model.seq_length, spec["vocab"]
    config = RunConfig(output_dir="unused", model=model,
                       trainer=TrainerConfig(precision=spec["precision"], global_batch_size=1, micro_batch_size=1,
                                             max_steps=warmup + steps),
                       optim=OptimConfig(lr=1e-4, warmup_steps=0)).validate()
    ctx = initialize_parallel()
    cuda = ctx.device.type == "cuda"
    engine = build_engine(config, ctx, vocab)  # the trainer's own engine: DDP + Megatron AdamW
    documents = lognormal_documents(T, seed=spec["seed"], mean_tokens=spec["mean_doc"])
    tokens = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(spec["seed"]))
    batch = batch_for_this_rank(dict(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(1, T),
                                     position_ids=torch.arange(T)[None],
                                     cu_seqlens=torch.tensor(documents, dtype=torch.int32),
                                     cu_windows=torch.tensor([0, T], dtype=torch.int32)),
                                model.attention_type, ctx.device)
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    probe = torch.zeros(1, model.num_attention_heads, model.kv_channels, dtype=dtype, device=ctx.device)
    backend = select_backend(model.attention_backend, probe, True, get_attention_type(model.attention_type).mask)

    def sync():
        if cuda:
            torch.cuda.synchronize(ctx.device)

    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times, losses = [], []
    for _ in range(warmup + steps):
        sync()
        start = time.perf_counter()
        losses.append(train_step(engine, config, [batch])["loss"])
        sync()
        times.append(time.perf_counter() - start)
    peak_tflops, peak_source = resolve_peak_tflops(None, ctx.device, spec["precision"])
    profile = profile_step(lambda: train_step(engine, config, [batch])) if spec.get("profile") else None
    return {"device": torch.cuda.get_device_name(ctx.device) if cuda else "cpu",
            "backend": backend.__name__.rsplit(".", 1)[-1], "documents": documents,
            "step_times": times, "step_s": min(times[warmup:]), "loss_first": losses[0], "loss_last": losses[-1],
            "peak_gib": (torch.cuda.max_memory_allocated(ctx.device) if cuda
                         else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / GIB,
            "peak_tflops": peak_tflops, "peak_source": peak_source,
            "source": str(Path(nemo_anchor.__file__).resolve().parents[1]), "torch": torch.__version__,
            "profile": profile}


def profile_step(run_step, rows: int = 12) -> str:
    """The operators of one training step by self CPU time, as torch.profiler tabulates them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# --- the plan: layers and recompute from the memory planner ----------------------------------------------

def planned_model(shape: str, run: Run, layers: str, gpu_bytes: int | None, *, bf16: bool, fusions: bool,
                  at_most: int | None = None):
    """(the run's ModelConfig, None) with the planner's layers and recompute, or (None, why nothing fits).

    ``layers``: a count, or ``auto``: the most of the shape's layers (and of ``at_most``) that fit one GPU of
    ``gpu_bytes`` with the fewest fully recomputed layers. Without ``gpu_bytes`` (a CPU run and no
    ``--gpu-memory``) nothing is planned: the shape's layers, no recompute."""
    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.training import memory

    fields, vocab = SHAPES[shape]
    most = min(fields["num_layers"], at_most or fields["num_layers"]) if layers == "auto" else int(layers)
    model = ModelConfig(**{**fields, "num_layers": most}, attention_type=run.kind, seq_length=run.length,
                        attention_backend=run.backend)
    if gpu_bytes is None:
        if layers == "auto":
            raise ValueError("--layers auto plans against a GPU: run on one or give --gpu-memory")
        return model, None
    options = dict(gpu_bytes=gpu_bytes, micro_batch_size=1, bf16=bf16, distributed_optimizer=True, fusions=fusions)
    layout = memory.Layout(1)
    for count in range(most, 0, -1) if layers == "auto" else [most]:
        candidate = replace(model, num_layers=count)
        if memory.plan_memory(candidate, vocab, layout, **options).fits:
            return candidate, None
        recomputed = memory.fewest_recomputed_layers(candidate, vocab, layout, **options)
        if recomputed is not None:
            return replace(candidate, recompute="full", recompute_num_layers=recomputed), None
    one = memory.plan_memory(replace(model, num_layers=1, recompute="full"), vocab, layout, **options)
    return None, (f"does not fit one GPU of {gpu_bytes / GIB:.1f} GiB even as 1 recomputed layer: the planner "
                  f"counts {one.total / GIB:.1f} GiB + {one.headroom / GIB:.1f} GiB headroom, of which logits and "
                  f"loss {one.logits / GIB:.1f} GiB; it suggests: "
                  f"{memory.suggest(replace(model, num_layers=1), vocab, layout, **options)}")


def device_memory() -> int | None:
    """Bytes PyTorch sees on GPU 0, asked in a short subprocess so that this one never holds a CUDA context
    (the planned runs fill the GPU); None without CUDA."""
    probe = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1]) or None


def gpu_bytes_of(text: str) -> int:
    """``--gpu-memory``: the bytes PyTorch can allocate on that GPU (``nemo_anchor.training.memory.gpu_memory``)."""
    from nemo_anchor.training.memory import gpu_memory

    try:
        return gpu_memory(text)[0]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def te_fusions() -> bool:
    """Whether the engine runs Megatron's fused cross entropy and bias-SwiGLU (the planner's ``fusions``)."""
    from nemo_anchor import launch

    on = launch.model_settings(rope_allowed=False)
    return on["cross_entropy_loss_fusion"] and on["bias_activation_fusion"]


# --- the parent: runs, rows, the table ------------------------------------------------------------

def tree_environment(tree: Path | None, anchor_path: str) -> dict:
    """The worker's environment: the anchor path, and PYTHONPATH with ``tree`` in place of this repository."""
    env = {**os.environ, ANCHOR_PATH_ENV: anchor_path}
    if tree is not None:
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
        env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve()), *rest])
    return env


def run_worker(spec: dict, env: dict, timeout: float | None) -> dict:
    """The worker's result, or ``{"status": "FAIL: ..."}`` with the last line it wrote."""
    try:
        done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"FAIL: timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = [line for line in done.stderr.splitlines() if line.strip()] or ["no output"]
        return {"status": f"FAIL: exit {done.returncode}: {tail[-1]}"[:300]}
    return {"status": "ok", **json.loads(lines[-1])}


def measure(row: dict, model, vocab: int) -> dict:
    """The row's tokens/s, model TFLOP/s, MFU and HFU: this tree's FLOPs of the worker's best step."""
    import torch

    from nemo_anchor.model.flops import train_step_flops
    from nemo_anchor.training.throughput import rates

    flops = train_step_flops(model, vocab, [torch.tensor(row["documents"])])
    achieved = rates(flops, row["step_s"], 1, row["peak_tflops"])
    return {"tokens_per_s": model.seq_length / row["step_s"], "tflops": achieved["tflops_per_device"],
            "mfu": achieved["mfu"], "hfu": achieved["hfu"]}


def tree_label(tree: Path | None) -> str:
    if tree is None:
        return "current"
    commit = tree / "COMMIT"  # written beside the unpacked archive (docs/results.md says how)
    return f"{tree.name}@{commit.read_text().strip()[:10]}" if commit.is_file() else tree.name


def runs_of(length: int, kinds: list[str], anchor_paths: list[str]) -> tuple[list[Run], list[Run]]:
    """The plain grid at one window, full (the ratios' baseline) and anchor first; the anchor on each other path."""
    order = sorted(kinds, key=lambda k: ("full", "anchor").index(k) if k in ("full", "anchor") else 2)
    other_paths = [Run("anchor", length, anchor_path=p, note=f"{ANCHOR_PATH_ENV}={p}")
                   for p in anchor_paths if p != "merge"] if "anchor" in kinds else []
    return [Run(kind, length) for kind in order], other_paths


def same_family_runs(rows: list[dict], length: int) -> list[Run]:
    """Where ``auto`` put a type on another kernel family than the anchor at ``length``: that type on the anchor's
    backend (``nemo_anchor.attention.functional.kernel_family``)."""
    from nemo_anchor.attention.functional import kernel_family

    done = {r["attention_type"]: r["backend"] for r in rows if r["status"] == "ok" and r["length"] == length
            and r["requested_backend"] == "auto" and r["anchor_path"] == "merge"}
    anchor = done.get("anchor")
    if anchor is None:
        return []
    return [Run(kind, length, backend=anchor, note="same kernel family as anchor")
            for kind, backend in done.items() if kind != "anchor" and kernel_family(backend) != kernel_family(anchor)]


def layer_count(text: str) -> str:
    """``--layers``: ``auto`` or a positive whole number (kept as text: ``planned_model`` reads it)."""
    return text if text == "auto" else str(positive_int(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps (the best is kept)")
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--model", choices=tuple(SHAPES), default="tiny", help="model shape (default: tiny)")
    parser.add_argument("--layers", type=layer_count, default=None,
                        help="a layer count, or auto: as many as the planner fits one GPU (default: the shape's)")
    parser.add_argument("--gpu-memory", type=gpu_bytes_of, metavar="GB|CARD",
                        help="plan against this GPU: nominal GB or a card name (default: this machine's GPU)")
    parser.add_argument("--mean-doc", type=positive_float, default=600 * math.exp(0.5), help="mean document length")
    parser.add_argument("--anchor-paths", nargs="+", choices=ANCHOR_PATHS, default=["merge"])
    parser.add_argument("--same-family", action="store_true",
                        help="also run each type auto put on another kernel family on the anchor's backend")
    parser.add_argument("--tree", type=Path, help="run the workers on the source tree in this folder")
    parser.add_argument("--json", type=Path, help="write the rows here after each run")
    parser.add_argument("--deadline", type=float, help="start no run after this many seconds")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="training precision; auto: bf16 on a GPU, on the CPU the one whose matmuls are faster")
    parser.add_argument("--profile", action="store_true", help="profile one more step per row (torch.profiler)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    started = time.monotonic()
    import torch

    if args.tree is not None and not (args.tree / "nemo_anchor" / "__init__.py").is_file():
        print(f"bench_train: --tree {args.tree}: no nemo_anchor package there (docs/results.md says how to unpack one)")
        return 2
    cuda = torch.cuda.is_available()
    gpu_bytes = args.gpu_memory or (device_memory() if cuda else None)
    if args.precision == "auto" and cuda:
        args.precision = "bf16"
    elif args.precision == "auto":
        from nemo_anchor.training.throughput import faster_cpu_precision

        args.precision, measured = faster_cpu_precision(seconds=0.5)
        print("matmul TFLOP/s on this CPU: " + ", ".join(f"{p} {t:.4f}" for p, t in measured.items())
              + f" -> training in {args.precision}")
    layers = args.layers or str(SHAPES[args.model][0]["num_layers"])
    fusions = te_fusions()
    tree = tree_label(args.tree)
    print(f"model {args.model}, {args.precision}, tree {tree}, {args.steps} timed step(s) after {args.warmup} "
          f"warm-up (best kept), mean document {args.mean_doc:.0f} tokens"
          + (f", planned for {gpu_bytes / GIB:.1f} GiB" if gpu_bytes else ""))
    print(f"{'window':>7} {'attention_type':>16} {'backend':>12} {'path':>7} {'layers':>6} {'recomp':>6} {'docs':>5} "
          f"{'step s':>8} {'tokens/s':>9} {'x full':>7} {'TFLOP/s':>8} {'MFU':>6} {'HFU':>6} {'peak GiB':>9}", flush=True)
    rows: list[dict] = []

    at_most = None

    def do(run: Run) -> None:
        nonlocal at_most
        rows.append(one_run(args, run, layers, gpu_bytes, fusions, tree, started, at_most))
        print_row(rows[-1], rows)
        if args.json:
            write_json(args.json, rows)
        failed = rows[-1]
        if layers == "auto" and "out of memory" in failed["status"].lower() and failed["layers"] > 1:
            # the planner's count did not fit after all (its row stays, a FAIL): one layer fewer from here on
            at_most = failed["layers"] - 1
            do(replace(run, note=f"{failed['layers']} planned layers ran out of memory"))

    for length in args.lengths:
        at_most = None
        plain, other_paths = runs_of(length, args.kinds, args.anchor_paths)
        for run in plain:
            do(run)
        for run in same_family_runs(rows, length) if args.same_family else []:
            do(run)
        for run in other_paths:
            do(run)
    if args.tree is None:  # the path this tree's code takes (a previous tree's workers may lack it)
        from nemo_anchor.attention.paradigms import get_attention_type

        device = torch.device("cuda" if cuda else "cpu")
        measured = {(r["attention_type"], r["backend"]) for r in rows
                    if r["status"] == "ok" and r["anchor_path"] == "merge"}
        for kind, backend in sorted(measured):
            print(f"attention: {kind}: {attention_path(backend, get_attention_type(kind).mask, device)}")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def one_run(args, run: Run, layers: str, gpu_bytes: int | None, fusions: bool, tree: str, started: float,
            at_most: int | None = None) -> dict:
    fields, vocab = SHAPES[args.model]
    row = {"shape": args.model, "tree": tree, "attention_type": run.kind, "length": run.length,
           "requested_backend": run.backend, "anchor_path": run.anchor_path, "note": run.note}
    left = None if args.deadline is None else args.deadline - (time.monotonic() - started)
    if left is not None and left < 5:
        return {**row, "status": "FAIL: not run: the part's time ran out"}
    model, why = planned_model(args.model, run, layers, gpu_bytes, bf16=args.precision == "bf16", fusions=fusions,
                               at_most=at_most)
    if model is None:
        return {**row, "status": f"FAIL: {why}"}
    row.update(layers=model.num_layers,
               recompute=(model.recompute_num_layers or model.num_layers) if model.recompute == "full" else 0)
    if gpu_bytes is not None:  # what the planner expects, beside the measured peak
        from nemo_anchor.training.memory import Layout, plan_memory

        row["planned_gib"] = plan_memory(model, vocab, Layout(1), gpu_bytes=gpu_bytes, micro_batch_size=1,
                                         bf16=args.precision == "bf16", fusions=fusions).total / GIB
    spec = {"model": asdict(model), "vocab": vocab, "steps": args.steps,
            "warmup": args.warmup, "seed": 0, "mean_doc": args.mean_doc, "precision": args.precision,
            "profile": args.profile}
    result = run_worker(spec, tree_environment(args.tree, run.anchor_path), timeout=left)
    row.update(result)
    if row["status"] != "ok":
        return row
    expected = (args.tree or REPO).resolve()
    if Path(row["source"]) != expected:
        return {**row, "status": f"FAIL: the worker imported nemo_anchor from {row['source']}, not {expected}"}
    return {**row, **measure(row, model, vocab)}


def print_row(row: dict, rows: list[dict]) -> None:
    if row["status"] != "ok":
        print(f"{row['length']:>7} {row['attention_type']:>16} {row['requested_backend']:>12} "
              f"{row['anchor_path']:>7} {row['status']}", flush=True)
        return
    full = next((r for r in rows if r["status"] == "ok" and r["attention_type"] == "full" and r["length"] == row["length"]
                 and r["requested_backend"] == "auto"), None)
    ratio = f"{row['tokens_per_s'] / full['tokens_per_s']:.2f}" if full else "-"
    print(f"{row['length']:>7} {row['attention_type']:>16} {row['backend']:>12} {row['anchor_path']:>7} "
          f"{row['layers']:>6} {row['recompute']:>6} {len(row['documents']) - 1:>5} {row['step_s']:>8.4g} "
          f"{row['tokens_per_s']:>9.5g} {ratio:>7} {row['tflops']:>8.4g} {row['mfu']:>6.1%} {row['hfu']:>6.1%} "
          f"{row['peak_gib']:>9.3g}", flush=True)
    if row.get("profile"):
        print(row["profile"], flush=True)


def write_json(path: Path, rows: list[dict]) -> None:
    from nemo_anchor.atomic import atomic_file

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
