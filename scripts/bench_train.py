"""Training throughput and peak memory per attention_type and window length, side by side.

    python scripts/bench_train.py                       # 4K, 8K, 16K windows, every attention type
    python scripts/bench_train.py --lengths 4096 --steps 3
    python scripts/bench_train.py --model smollm2 --kinds full anchor --lengths 2048 4096
    python scripts/bench_train.py --model smollm2 --kinds anchor --lengths 4096 --precision bf16 --profile

Each (attention_type, window) runs in a fresh subprocess (clean peak RSS): a Megatron GPT through
the trainer's engine (Megatron DDP, fp32 master weights, Megatron AdamW), one packed window per
step whose documents have seeded log-normal lengths. ``--model tiny`` is a small Llama-shaped
model; ``--model smollm2`` is SmolLM2-135M's shape (30 layers, hidden 576, vocabulary 49152, read
from the directory ``nemo_anchor.export.pretrained`` prepares), randomly initialised: the
weights' values do not change the time. Prints tokens/s, the ratio against `full` at the same
window, achieved TFLOP/s, MFU and HFU (the step's model and hardware FLOPs from nemo_anchor.model.flops
over the step time, against the trainer's peak; HFU adds the recomputed forward: the fastest matmul in the training precision this CPU has shown, measured
in the same process and remembered across runs), and peak RSS.

``--precision auto`` (the default) trains in the precision whose matmuls run faster on this
machine (measured first and printed). ``--profile`` adds one step under torch.profiler per row and
prints its most expensive operators.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

KINDS = ("full", "intra_doc", "intra_doc_reset", "anchor")


def worker(args) -> dict:
    import torch

    from nemo_anchor.attention.layout import lognormal_documents
    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.training.config import RunConfig, TrainerConfig
    from nemo_anchor.model.flops import train_step_flops
    from nemo_anchor.training.engine import build_engine, train_step
    from nemo_anchor.training.throughput import rates as throughput_rates
    from nemo_anchor.training.throughput import resolve_peak_tflops

    T = args.length
    if args.model == "smollm2":
        import transformers

        from nemo_anchor.convert.hf_mapping import model_config_from_hf
        from nemo_anchor.export.pretrained import prepare_smollm2

        hf_config = transformers.AutoConfig.from_pretrained(prepare_smollm2())
        model, vocab = model_config_from_hf(hf_config, attention_type=args.kind, seq_length=T), hf_config.vocab_size
    else:
        model, vocab = ModelConfig(attention_type=args.kind, seq_length=T, num_layers=4, hidden_size=256,
                                   ffn_hidden_size=640, num_attention_heads=4, num_query_groups=2), 4096
    config = RunConfig(model=model, trainer=TrainerConfig(precision=args.precision, global_batch_size=1,
                                                          micro_batch_size=1))
    engine = build_engine(config, initialize_parallel(), vocab)  # the trainer's own engine: DDP + Megatron AdamW
    documents = lognormal_documents(T, seed=0, mean_tokens=600 * math.exp(0.5))  # median 600 tokens
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (1, T), generator=g)
    batch = dict(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(1, T), position_ids=torch.arange(T)[None],
                 cu_seqlens=torch.tensor(documents, dtype=torch.int32),
                 cu_windows=torch.tensor([0, T], dtype=torch.int32))
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        train_step(engine, config, [batch])
        times.append(time.perf_counter() - start)
    step = min(times[args.warmup:])
    profile = profile_step(lambda: train_step(engine, config, [batch])) if args.profile else None
    flops = train_step_flops(config.model, vocab, [batch["cu_seqlens"]])
    peak, _ = resolve_peak_tflops(None, torch.device("cpu"), args.precision)  # as the trainer's MFU
    rates = throughput_rates(flops, step, 1, peak)
    return {"kind": args.kind, "length": T, "documents": len(batch["cu_seqlens"]) - 1, "step_s": step,
            "tokens_per_s": T / step, "tflops": rates["tflops_per_device"], "mfu": rates["mfu"],
            "hfu": rates["hfu"], "peak_tflops": peak,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "profile": profile}


def profile_step(run_step, rows: int = 12) -> str:
    """The operators of one training step by self CPU time, as torch.profiler tabulates them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny", help="model shape (default: tiny)")
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                        help="training precision; auto: the one whose matmuls are faster here (measured)")
    parser.add_argument("--profile", action="store_true", help="profile one more step per row (torch.profiler)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.precision == "auto":
        from nemo_anchor.training.throughput import faster_cpu_precision

        args.precision, measured = faster_cpu_precision(seconds=0.5)
        print("matmul TFLOP/s on this CPU: " + ", ".join(f"{p} {t:.4f}" for p, t in measured.items())
              + f" -> training in {args.precision}")
    print(f"model {args.model}, {args.precision}, {args.steps} timed step(s) after {args.warmup} warm-up (best kept)")
    print(f"{'window':>7} {'attention_type':>16} {'docs':>5} {'step s':>8} {'tokens/s':>9} {'x full':>7} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'HFU':>6} {'peak RSS MB':>12}")
    for length in args.lengths:
        full = None
        for kind in args.kinds:
            out = subprocess.run([sys.executable, __file__, "--worker", "--kind", kind, "--length", str(length),
                                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
                                  "--precision", args.precision, *(["--profile"] if args.profile else [])],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            full = row["tokens_per_s"] if kind == "full" else full
            ratio = f"{row['tokens_per_s'] / full:.2f}" if full else "-"
            print(f"{length:>7} {kind:>16} {row['documents']:>5} {row['step_s']:>8.3f} {row['tokens_per_s']:>9.0f} "
                  f"{ratio:>7} {row['tflops']:>8.4f} {row['mfu']:>6.1%} {row['hfu']:>6.1%} {row['peak_rss_mb']:>12.0f}", flush=True)
            if row["profile"]:
                print(row["profile"], flush=True)


if __name__ == "__main__":
    main()
