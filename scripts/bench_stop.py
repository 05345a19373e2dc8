"""A stop as a user pays it: signal to exit of each front door's own command, beside a plain save.

Each door runs its real command line, a process of its own (not forked from a process that imported it):
``nemo-anchor train``, NeMo's ``nemo llm pretrain --factory nemo_anchor.nemo.recipes.anchor_smollm2_135m`` and
``python -m nemo_anchor.bridge.pretrain`` (in ``.venv-bridge``), each on the tests' tiny model over packed byte
windows of 64 tokens. Twice per door:

- first save included: no scheduled save before the signal, so the stop's save is the run's first (Megatron's
  checkpoint writer starts the processes it keeps then);
- after scheduled saves: ``--save-every`` steps, the signal after ``--scheduled-saves`` of them.

SIGTERM goes to the whole process group (as Slurm and Kubernetes send it) once the metrics show step
``--signal-after`` (or the last scheduled save's step + 1); signal to exit is the time until the process has
exited, with status 75 (anything else stops the benchmark with the run's last lines). A plain save's seconds
are measured in the second run of the same door, from the times its metrics rows appeared: the two step gaps
around a scheduled save that is not the first, less two ordinary step gaps (medians). The ratio is signal to
exit over that plain save.

    python scripts/bench_stop.py                                  # every door
    python scripts/bench_stop.py --doors nemo --signal-after 4
    python scripts/bench_stop.py --bridge-python /path/to/.venv-bridge/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOORS = ("train", "nemo", "bridge")
EXIT_PREEMPTED = 75
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4,
         "How vexingly quick daft zebras jump; " * 9, "Waltz, bad nymph, for quick jigs vex. " * 12] * 6
NEMO_RECIPE = "nemo_anchor.nemo.recipes.anchor_smollm2_135m"
NEVER = 100_000  # a save interval no run reaches
DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NEMO_ANCHOR_ALLOW_CPU", "SLURM_GPUS", "SLURM_GPUS_ON_NODE",
                    "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doors", nargs="+", choices=DOORS, default=list(DOORS))
    parser.add_argument("--signal-after", type=int, default=3,
                        help="the step whose metrics row starts the signal, when no save came before (>= 2)")
    parser.add_argument("--save-every", type=int, default=4,
                        help="the scheduled saves' interval, in steps (>= 3: steps away from a save are timed too)")
    parser.add_argument("--scheduled-saves", type=int, default=2,
                        help="scheduled saves before the signal in the second run (>= 2: the first one is cold)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take in all (> 0)")
    parser.add_argument("--bridge-python", type=Path, default=REPO / ".venv-bridge" / "bin" / "python",
                        help="the interpreter with Megatron-Bridge (default: .venv-bridge/bin/python)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs write (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.signal_after < 2:
        parser.error(f"argument --signal-after: {args.signal_after} is below 2 (a step after the first is needed)")
    if args.save_every < 3:
        parser.error(f"argument --save-every: {args.save_every} is below 3 (no step between two saves to time)")
    if args.scheduled_saves < 2:
        parser.error(f"argument --scheduled-saves: {args.scheduled_saves} is below 2 (the first save is cold)")
    if not args.timeout > 0:
        parser.error(f"argument --timeout: {args.timeout} is not a positive number of seconds")
    if "bridge" in args.doors and not os.access(args.bridge_python, os.X_OK):
        parser.error(f"argument --bridge-python: {args.bridge_python} is not an executable (the door bridge needs "
                     f"Python with Megatron-Bridge; leave it out with --doors)")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        parser.error(f"argument --workdir: {args.workdir} is not empty")
    return args


class Door:
    """One front door's command line for a run in ``root`` that saves every ``save_every`` steps."""

    def __init__(self, name: str, data: Path, bridge_python: Path):
        self.name, self.data, self.bridge_python = name, data, bridge_python

    def command(self, root: Path, save_every: int) -> list[str]:
        bin_dir = Path(sys.executable).parent
        if self.name == "train":
            config = self._run_config(root, output_dir=root / "run")
            return [str(bin_dir / "nemo-anchor"), "train", "--config", str(config),
                    f"checkpoint.save_every={save_every}"]
        if self.name == "nemo":  # the arguments of tests/test_nemo_run.py's SIGTERM run
            return [str(bin_dir / "nemo"), "llm", "pretrain", "--factory", NEMO_RECIPE, f"data.path={self.data}",
                    "data.seq_length=64", "model.config.seq_length=64", "model.config.num_layers=1",
                    "trainer.devices=1", "data.global_batch_size=1", "data.micro_batch_size=1",
                    f"trainer.max_steps={NEVER}", f"log.log_dir={root / 'log'}",
                    f"log.ckpt.every_n_train_steps={save_every}", "log.ckpt.train_time_interval=None", "-y"]
        config = self._run_config(root, output_dir=root / "unused")  # tests/bridge/test_bridge_signals.py's
        return [str(self.bridge_python), "-m", "nemo_anchor.bridge.pretrain", "--config", str(config),
                f"checkpoint.save={root / 'run'}", f"checkpoint.load={root / 'run'}", "--peak-tflops", "1",
                f"checkpoint.save_interval={save_every}"]

    def metrics(self, root: Path) -> Path:
        return root / "log" / "anchor_smollm2_135m" / "metrics.jsonl" if self.name == "nemo" else \
            root / "run" / "metrics.jsonl"

    def _run_config(self, root: Path, output_dir: Path) -> Path:
        config = root / "run.yaml"
        config.write_text(json.dumps({
            "output_dir": str(output_dir),
            "model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                      "num_query_groups": 2, "seq_length": 64, "attention_type": "anchor", "rotary_base": "10000"},
            "data": {"path": str(self.data)},
            "trainer": {"max_steps": NEVER, "global_batch_size": 1, "micro_batch_size": 1, "precision": "fp32",
                        "progress_bar": False, "eval_batches": 0},
            "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        }))
        return config


def environment() -> dict:
    """This environment, with this checkout first on the path, one thread, no GPU asked for and no rendezvous
    variables of another run."""
    env = {k: v for k, v in os.environ.items() if k not in DEVICE_VARIABLES + RENDEZVOUS}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def stopped_run(door: Door, root: Path, save_every: int, signal_after: int, timeout: float) -> tuple[float, dict]:
    """Run ``door`` in ``root`` until its metrics show ``signal_after``, SIGTERM its process group; the seconds from
    the signal to its exit and when each step's metrics row appeared (time.monotonic())."""
    root.mkdir(parents=True)
    log = root / "output.log"
    metrics, seen = door.metrics(root), {}
    with open(log, "w") as out:
        run = subprocess.Popen(door.command(root, save_every), env=environment(), cwd=REPO, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while signal_after not in seen:
            if run.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench_stop.py: error: {door.name} did not reach step {signal_after} "
                                 f"({'exited ' + str(run.returncode) if run.poll() is not None else 'timed out'}); "
                                 f"its output, {log}:\n{log.read_text()[-3000:]}")
            now = time.monotonic()
            rows = metrics.read_text().splitlines() if metrics.is_file() else []
            for row in rows:
                if '"loss"' in row and row.endswith("}"):
                    seen.setdefault(json.loads(row)["step"], now)
            time.sleep(0.02)
        signalled = time.monotonic()
        os.killpg(run.pid, signal.SIGTERM)
        status = run.wait(timeout=max(1.0, deadline - time.monotonic()))
        exited = time.monotonic()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    if status != EXIT_PREEMPTED:
        raise SystemExit(f"bench_stop.py: error: {door.name} exited {status} after SIGTERM, not {EXIT_PREEMPTED}; "
                         f"its output, {log}:\n{log.read_text()[-3000:]}")
    return exited - signalled, seen


def plain_save_seconds(seen: dict, save_every: int, first_save: int) -> float:
    """A warm scheduled save's seconds from when the metrics rows appeared: the two gaps around each save after
    the first, less two ordinary gaps (medians; a door may log a step before or after saving it)."""
    gaps = {step: seen[step] - seen[step - 1] for step in seen if step - 1 in seen and step > 2}
    saves = [step for step in seen if step > first_save and step % save_every == 0 and step + 1 in gaps
             and step in gaps]
    ordinary = [gap for step, gap in gaps.items() if step % save_every not in (0, 1)]
    if not saves or not ordinary:
        return float("nan")
    step_gap = statistics.median(ordinary)
    return statistics.median(gaps[step] + gaps[step + 1] - 2 * step_gap for step in saves)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        from nemo_anchor.data import PackOptions, pack

        corpus = workdir / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
        pack([corpus], "byte", workdir / "packed", PackOptions(seq_length=64))
        print(f"{'door':8} {'first save':>11} {'signal to exit s':>17} {'plain save s':>13} {'ratio':>7}", flush=True)
        for name in args.doors:
            door = Door(name, workdir / "packed", args.bridge_python)
            last_save = args.save_every * args.scheduled_saves
            cold, _ = stopped_run(door, workdir / name / "first", NEVER, args.signal_after, args.timeout)
            warm, seen = stopped_run(door, workdir / name / "scheduled", args.save_every, last_save + 1, args.timeout)
            save = plain_save_seconds(seen, args.save_every, first_save=args.save_every)
            for included, seconds in (("included", cold), ("not", warm)):
                print(f"{name:8} {included:>11} {seconds:17.1f} {save:13.2f} {seconds / save:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
