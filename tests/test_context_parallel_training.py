"""The training script with ``model.context_parallel_size=2`` (torchrun, 2 gloo processes)
reproduces the single-process loss step by step."""
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
         "How vexingly quick daft zebras jump; ", "Sphinx of black quartz, judge my vow. " * 5] * 4
STEPS = 3


def _child_environment() -> dict:
    """os.environ without the rendezvous variables that initialize_parallel() (run by other tests in
    this process) leaves behind: a child would otherwise try to join this process's group."""
    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in launch}, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_training")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    packed = root / "packed"
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "64", "--output", str(packed)]) == 0
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 64, "attention_backend": "cpu"},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": STEPS, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False},
        "optim": {"lr": 3e-3, "schedule": "constant"},
    }))
    return path


def _losses(config: Path, output_dir: Path, processes: int, overrides: list[str]) -> list[float]:
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    proc = subprocess.run([*launcher, PRETRAIN, "--config", str(config), f"output_dir={output_dir}", *overrides],
                          capture_output=True, text=True, timeout=300,
                          env=_child_environment())
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted(records, key=lambda r: r["step"]) if "loss" in r]


# both strategies, and both layouts: window chunks (anchor) and padded documents (intra_doc_reset)
@pytest.mark.parametrize("attention_type,comm_type", [("anchor", "a2a"), ("intra_doc_reset", "all_gather")])
def test_cp2_training_reproduces_cp1_loss_per_step(tmp_path, config, attention_type, comm_type):
    kind = f"model.attention_type={attention_type}"
    single = _losses(config, tmp_path / "cp1", 1, [kind])
    parallel = _losses(config, tmp_path / "cp2", 2, [kind, "model.context_parallel_size=2",
                                                     f"model.cp_comm_type={comm_type}"])
    assert len(single) == len(parallel) == STEPS
    assert single[-1] < single[0]  # the runs train, so later steps compare updated weights
    assert parallel == pytest.approx(single, rel=1e-5)
