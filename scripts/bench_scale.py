"""Per-rank memory and step time of the trainer's engine across parallel layouts, next to the planner.

    python scripts/bench_scale.py                 # both tables
    python scripts/bench_scale.py --steps 3 --seq-length 1024
    python scripts/bench_scale.py --steps 6 --save-every 2    # and what saving checkpoints costs the loop
    python scripts/bench_scale.py --stop --layouts 1:1         # and how long a SIGTERM takes to exit

Table 1: a small Llama-shaped model on this machine (gloo, one process per rank) at data parallel 1
and 2 and tensor parallel 1 and 2: each rank's measured bytes of weights, gradients and optimizer
state (the engine's own tensors), the planner's prediction for the same rank, and the step time.
With ``--save-every N`` the same runs save a checkpoint every N steps through the trainer's
``CheckpointSaver``, and a second table gives, measured in that run, the time the loop was blocked per
save beside the write's own time (until every shard was on disk), the time until the checkpoint was
published (checksummed in the background, renamed, named latest) and the step time.
With ``--stop``, a table for SIGTERM: a real ``nemo-anchor train`` of the same model (4 micro-batches a step,
a checkpoint every 2 steps, synthetic data packed here) gets a SIGTERM to its process group after its first
scheduled save, and the time from the signal to the process's exit (status 75) is printed beside a plain save's
time (write, checksums, publish: ``Trainer.save`` then ``saver.finish()``, the same model and config, its
second save, measured in another process of the same invocation). Both are wall-clock seconds on whatever else this machine runs.
The last table: ``nemo-anchor plan`` for every file in configs/paper/ on the paper's hardware (8x H100 80GB:
79.11 GiB usable, 5% left to the allocator), unfused and with Megatron's fusions.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import attention_path, non_negative_int, positive_int  # noqa: E402  (scripts/bench_args.py)

REPO = Path(__file__).resolve().parents[1]
MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8, num_query_groups=4)
VOCAB = 4096
LAYOUTS = [(1, 1), (2, 1), (2, 2)]  # (processes, tensor parallel)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from nemo_anchor.model.config import ModelConfig
    from nemo_anchor.parallel.distributed import initialize_parallel
    from nemo_anchor.training.config import RunConfig, TrainerConfig
    from nemo_anchor.training.engine import build_engine, train_step
    from nemo_anchor.training.memory import Layout, planned_state_bytes, state_bytes

    T = args.seq_length
    model = ModelConfig(**MODEL, seq_length=T, tensor_model_parallel_size=args.tensor, attention_backend="cpu")
    ctx = initialize_parallel(tensor_parallel_size=args.tensor)
    config = RunConfig(model=model, trainer=TrainerConfig(precision=args.precision,
                                                         global_batch_size=ctx.data_parallel_size))
    engine = build_engine(config, ctx, VOCAB)
    g = torch.Generator().manual_seed(ctx.data_parallel_rank)
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    batch = dict(tokens=tokens, labels=tokens.roll(-1, 1), loss_mask=torch.ones(1, T),
                 position_ids=torch.arange(T)[None], cu_seqlens=torch.tensor([0, T // 4, T // 2, T], dtype=torch.int32),
                 cu_windows=torch.tensor([0, T], dtype=torch.int32))
    saver = None
    if args.save_every:
        import tempfile

        from nemo_anchor.run_dir import RunDir
        from nemo_anchor.training.checkpoint_saver import CheckpointSaver, async_save_available

        folder = [tempfile.mkdtemp(prefix="bench_scale.") if ctx.rank == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        saver = CheckpointSaver(RunDir(folder[0]), keep_last=1, asynchronous=async_save_available(ctx.device))
    times = []
    for step in range(args.steps + 1):  # step 0 warms up
        dist.barrier()
        start = time.perf_counter()
        train_step(engine, config, [batch])
        if saver is not None:
            saver.poll()  # as the trainer does after every step
        times.append(time.perf_counter() - start)
        if saver is not None and step and step % args.save_every == 0:
            saver.save(step, engine, {"step": step}, "")
    saves = []
    if saver is not None:
        saver.close()
        saves = [[t.blocked, t.written, t.published] for t in saver.times]
        dist.barrier()
        if ctx.rank == 0:
            import shutil

            shutil.rmtree(folder[0])
    measured = state_bytes(engine)
    planned = planned_state_bytes(model, VOCAB, Layout(ctx.world_size, tensor=args.tensor), bf16=args.precision == "bf16",
                                  distributed_optimizer=True)  # the busiest rank
    print("ROW " + json.dumps({"rank": ctx.rank, "measured": [measured.weights, measured.gradients, measured.optimizer],
                               "planned": [planned.weights, planned.gradients, planned.optimizer],
                               "step_s": min(times[1:]), "saves": saves,
                               "async_save": bool(saver and saver.asynchronous)}), flush=True)


def _stop_config(root: Path, seq_length: int, output_dir: Path) -> Path:
    """A trainer config for the bench model on synthetic bytes packed under ``root``; its path."""
    import random

    import yaml

    from nemo_anchor.data import PackOptions, pack

    data = root / "data"
    if not data.exists():
        rng = random.Random(0)
        corpus = root / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": "".join(rng.choice("abcdefgh ij.") for _ in range(3000))}) + "\n"
                                  for _ in range(48)))
        pack([corpus], "byte", data, PackOptions(seq_length=seq_length))
    config = {"output_dir": str(output_dir), "data": {"path": str(data)},
              "model": {**MODEL, "seq_length": seq_length, "vocab_size": VOCAB, "attention_backend": "cpu"},
              "trainer": {"max_steps": 100_000, "global_batch_size": 4, "micro_batch_size": 1, "precision": "fp32",
                          "progress_bar": False},
              "checkpoint": {"save_every": 2, "keep_last": 1}}
    path = root / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def plain_save(config_path: str) -> None:
    """Worker: a step and a save (Megatron starts its writer's helper processes), then a step and a plain save,
    timed until published (as the trainer's later saves, and its stop save, run)."""
    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.loop import Trainer

    trainer = Trainer(load_config(config_path))
    try:
        trainer.train_step()
        trainer.save()
        trainer.saver.finish()
        trainer.train_step()
        start = time.perf_counter()
        trainer.save()
        trainer.saver.finish()
        total = time.perf_counter() - start
        times = trainer.saver.times[-1]
        size = sum(p.stat().st_size for p in trainer.run.checkpoint(2).rglob("*") if p.is_file())
        print("ROW " + json.dumps({"total": total, "written": times.written, "bytes": size}), flush=True)
    finally:
        trainer.saver.close()
        trainer._release(failed=False)


def stop_table(args, env: dict) -> None:
    """SIGTERM to a training run's process group: seconds to its exit, beside a plain save's."""
    import shutil
    import signal
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="bench_stop."))
    try:
        plain = subprocess.run([sys.executable, __file__, "--plain-save", str(_stop_config(root, args.seq_length,
                                                                                            root / "plain"))],
                               capture_output=True, text=True, env=env, check=True)
        row = json.loads(re.search(r"ROW (\{[^{}]*\})", plain.stdout).group(1))
        run = root / "stopped"
        process = subprocess.Popen([sys.executable, "-u", "-m", "nemo_anchor.cli", "train", "--config",
                                    str(_stop_config(root, args.seq_length, run))],
                                   env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        while not (run / "metrics.jsonl").is_file() or \
                sum('"loss"' in line for line in (run / "metrics.jsonl").read_text().splitlines()) < 3:
            if process.poll() is not None:
                raise SystemExit(f"the training run ended before its third step:\n{process.stdout.read()[-3000:]}")
            time.sleep(0.05)
        signalled = time.perf_counter()
        os.killpg(process.pid, signal.SIGTERM)
        lines, to_saved = [], None
        for line in process.stdout:  # the stop line is printed once the checkpoint is published
            lines.append(line)
            if to_saved is None and "stop requested" in line:
                to_saved = time.perf_counter() - signalled
        process.wait()
        to_exit, output = time.perf_counter() - signalled, "".join(lines)
        if process.returncode != 75:
            raise SystemExit(f"the stopped run exited {process.returncode}:\n{output[-3000:]}")
        stop_save = re.search(r"at step (\d+) in ([\d.]+) s", output)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nSIGTERM to a training run (model {MODEL}, vocab {VOCAB}, window {args.seq_length}, 4 micro-batches a "
          f"step; a checkpoint is {row['bytes'] / 2**20:.1f} MiB), seconds")
    print(f"{'signal to saved':>15} {'stop save':>9} {'signal to exit':>14} {'saved step':>10} {'plain save: write':>17} "
          f"{'published':>9} {'saved/plain':>11}")
    print(f"{to_saved:>15.2f} {float(stop_save.group(2)):>9.2f} {to_exit:>14.2f} {stop_save.group(1):>10} "
          f"{row['written']:>17.2f} {row['total']:>9.2f} {to_saved / row['total']:>11.2f}")
    print("(signal to saved: until the trainer's stop line, printed once the checkpoint is published and before the "
          "lease is released; signal to exit adds the interpreter's teardown (module GC, Megatron's gloo groups). "
          "plain save: Trainer.save() then saver.finish(), the write, the CRC-32 pass reading it back, the publish)")


def scale_table(args) -> None:
    import torch

    from nemo_anchor.attention.paradigms import get_attention_type
    from nemo_anchor.model.config import ModelConfig

    kind = ModelConfig.attention_type  # the runs' attention type: the model's default
    print(f"attention: {kind}: {attention_path('cpu', get_attention_type(kind).mask, torch.device('cpu'))}")
    print(f"Small model {MODEL}, window {args.seq_length}, {args.precision}, distributed optimizer; bytes per rank "
          f"(measured / planned)")
    print(f"{'layout':>12} {'rank':>4} {'weights KiB':>17} {'gradients KiB':>17} {'optimizer KiB':>17} {'step s':>7}")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2)), "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(REPO)}
    saves = []
    for processes, tensor in args.layouts:
        launcher = [sys.executable] if processes == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        out = subprocess.run([*launcher, __file__, "--worker", "--tensor", str(tensor), "--steps", str(args.steps),
                              "--seq-length", str(args.seq_length), "--precision", args.precision,
                              "--save-every", str(args.save_every)],
                             capture_output=True, text=True, env=env, check=True)
        # ranks print concurrently, so a row may share a line with another rank's output
        rows = sorted((json.loads(m.group(1)) for m in re.finditer(r"ROW (\{[^{}]*\})", out.stdout)),
                      key=lambda r: r["rank"])
        name = f"DP{processes // tensor} TP{tensor}"
        for row in rows:
            cells = [f"{m / 1024:>8.0f} / {p / 1024:<6.0f}" for m, p in zip(row["measured"], row["planned"])]
            print(f"{name:>12} {row['rank']:>4} {cells[0]:>17} {cells[1]:>17} {cells[2]:>17} {row['step_s']:>7.3f}")
        saves.append((name, rows[0]))
    if args.save_every:
        save_table(saves, args.save_every)
    if args.stop:
        stop_table(args, env)


def save_table(runs, save_every: int) -> None:
    """Rank 0's saves of each run: what the loop waited for against what the save took."""
    kind = "asynchronous (Megatron)" if runs[0][1]["async_save"] else "synchronous"
    print(f"\nCheckpoint every {save_every} steps, {kind} write, CRC-32s in a background thread (rank 0, seconds, "
          f"mean over the saves)")
    print(f"{'layout':>12} {'saves':>5} {'step s':>7} {'loop blocked s/save':>19} {'write s':>8} {'published s':>11}")
    for name, row in runs:
        blocked, written, published = (sum(save[i] for save in row["saves"]) / len(row["saves"]) for i in range(3))
        print(f"{name:>12} {len(row['saves']):>5} {row['step_s']:>7.3f} {blocked:>19.3f} {written:>8.3f} "
              f"{published:>11.3f}")


def paper_table() -> None:
    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.memory import GIB, Layout, gpu_memory, plan_memory

    gpu_bytes, described = gpu_memory("h100-80gb")
    print(f"\nnemo-anchor plan on the paper's hardware (8 GPUs, {described}), GiB per GPU")
    print(f"{'config':<28} {'layout':<16} {'fusions':>7} {'weights':>7} {'grads':>6} {'optim':>6} {'activ':>6} "
          f"{'logits':>6} {'other':>6} {'total':>6}  verdict")
    for path in sorted((REPO / "configs" / "paper").glob("*.yaml")):
        config = load_config(path)
        m, t = config.model, config.trainer
        layout = Layout(8, m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size)
        for fusions in (False, True):
            p = plan_memory(m, m.vocab_size, layout, gpu_bytes=gpu_bytes, micro_batch_size=t.micro_batch_size,
                            bf16=t.precision == "bf16", distributed_optimizer=t.distributed_optimizer, fusions=fusions)
            other = p.recompute_workspace + p.communication + p.reserved
            shape = f"TP{layout.tensor} CP{layout.context} DP{layout.data}"
            print(f"{path.name:<28} {shape:<16} {'on' if fusions else 'off':>7} " + " ".join(
                f"{v / GIB:>6.1f}" for v in (p.weights, p.gradients, p.optimizer, p.activations, p.logits, other,
                                             p.total)) + f"  {'fits' if p.fits else 'does not fit'}")


def layout_of(text: str) -> tuple[int, int]:
    """``--layouts``: ``PROCESSES:TENSOR_PARALLEL``, the first a multiple of the second."""
    processes, colon, tensor = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"{text!r} is not PROCESSES:TENSOR_PARALLEL (e.g. 2:1)")
    processes, tensor = positive_int(processes), positive_int(tensor)
    if processes % tensor:
        raise argparse.ArgumentTypeError(f"{text}: {processes} processes do not split into tensor-parallel groups "
                                         f"of {tensor}")
    return processes, tensor


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--seq-length", type=positive_int, default=1024)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="fp32: the faster matmul precision on CPUs without bf16 units")
    parser.add_argument("--stop", action="store_true",
                        help="also time a SIGTERM to a training run until its exit, beside a plain save")
    parser.add_argument("--plain-save", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tensor", type=positive_int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--layouts", nargs="+", default=[f"{p}:{t}" for p, t in LAYOUTS], type=layout_of,
                        help="PROCESSES:TENSOR_PARALLEL of each run of table 1 (default: 1:1 2:1 2:2)")
    parser.add_argument("--save-every", type=non_negative_int, default=0,
                        help="save a checkpoint every N steps and print what it costs the loop (0: no saves)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.plain_save:
        plain_save(args.plain_save)
        return
    scale_table(args)
    paper_table()


if __name__ == "__main__":
    main()
