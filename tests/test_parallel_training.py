"""The trainer under torchrun (gloo): every parallel layout reproduces the single-process run.

Data parallelism with the distributed optimizer, tensor parallelism (with sequence parallelism),
pipeline parallelism, context x data parallelism, and resuming with another data-parallel size.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_anchor.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
PRETRAIN = str(REPO / "scripts" / "pretrain.py")
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "a", "Pack my box with five dozen liquor jugs! " * 2,
         "How vexingly quick daft zebras jump; ", "Sphinx of black quartz, judge my vow. " * 5] * 8
STEPS = 5


def _child_environment() -> dict:
    """os.environ without the rendezvous variables that initialize_parallel() (run by other tests in
    this process) leaves behind: a child would otherwise try to join this process's group."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in launch}, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_training")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    packed = root / "packed"
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "64", "--output", str(packed)]) == 0
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump({
        # vocab_size as Megatron pads the byte tokenizer's for tensor_model_parallel_size=2
        "model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 64, "attention_backend": "cpu", "vocab_size": 384},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False},
        "optim": {"lr": 3e-3, "schedule": "constant", "clip_grad": 1.0},
        "checkpoint": {"save_every": 0},
    }))
    return path


@pytest.fixture(scope="module")
def start(config, tmp_path_factory):
    """Starting weights for every run (``model.init_from_hf``): a random init depends on the layout
    (each tensor-parallel rank draws its own SwiGLU halves), loading one checkpoint does not."""
    run = tmp_path_factory.mktemp("start") / "run"
    _train(config, run, 1, ["trainer.max_steps=1"])
    return f"model.init_from_hf={run}"


def _train(config: Path, output_dir: Path, processes: int, overrides: list[str]) -> dict[int, float]:
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    proc = subprocess.run([*launcher, PRETRAIN, "--config", str(config), f"output_dir={output_dir}", *overrides],
                          capture_output=True, text=True, timeout=600, env=_child_environment())
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def single(config, start, tmp_path_factory):
    """The reference: one process, per attention type."""
    cache = {}

    def losses(attention_type: str) -> dict[int, float]:
        if attention_type not in cache:
            out = tmp_path_factory.mktemp(f"single_{attention_type}")
            cache[attention_type] = _train(config, out / "run", 1, [f"model.attention_type={attention_type}", start])
            assert sorted(cache[attention_type]) == list(range(1, STEPS + 1))
            assert cache[attention_type][STEPS] < cache[attention_type][1]  # it trains: later steps see new weights
        return cache[attention_type]
    return losses


def _close(parallel: dict, single: dict, atol: float) -> None:
    assert sorted(parallel) == sorted(single)
    worst = max(abs(parallel[s] - single[s]) for s in single)
    assert worst <= atol, f"per-step loss differs by {worst:.3g} (parallel {parallel}, single {single})"


def test_data_parallel_with_distributed_optimizer(tmp_path, config, start, single):
    losses = _train(config, tmp_path / "dp2", 2, ["model.attention_type=anchor", start])
    _close(losses, single("anchor"), 1e-6)
    memory = [json.loads(line) for line in (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    state = next(r["memory"] for r in memory if "memory" in r)
    total = sum(state["optimizer_bytes"])  # fp32 Adam moments, sharded over the two ranks
    assert len(state["optimizer_bytes"]) == 2 and max(state["optimizer_bytes"]) <= 0.6 * total


def test_tensor_parallel(tmp_path, config, start, single):
    losses = _train(config, tmp_path / "tp2", 2, ["model.attention_type=anchor", start,
                                                  "model.tensor_model_parallel_size=2"])
    _close(losses, single("anchor"), 1e-5)


def test_pipeline_parallel(tmp_path, config, start, single):
    losses = _train(config, tmp_path / "pp2", 2, ["model.attention_type=anchor", start,
                                                  "model.pipeline_model_parallel_size=2"])
    _close(losses, single("anchor"), 1e-5)


# both context-parallel strategies and both layouts: window chunks (anchor) and padded documents
@pytest.mark.parametrize("attention_type,comm_type,processes", [("anchor", "a2a", 4), ("intra_doc_reset", "all_gather", 2)])
def test_context_parallel(tmp_path, config, start, single, attention_type, comm_type, processes):
    losses = _train(config, tmp_path / "cp", processes, [start,
        f"model.attention_type={attention_type}", "model.context_parallel_size=2", f"model.cp_comm_type={comm_type}"])
    _close(losses, single(attention_type), 1e-5)


def test_resume_with_another_data_parallel_size(tmp_path, config, start, single):
    run = tmp_path / "run"
    _train(config, run, 2, ["model.attention_type=anchor", start, "trainer.max_steps=3"])  # saves at its last step
    resumed = _train(config, run, 1, ["model.attention_type=anchor", start])
    _close(resumed, single("anchor"), 1e-6)
