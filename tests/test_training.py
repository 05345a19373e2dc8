"""The trainer end to end on a tiny packed corpus: config, loss, metrics, checkpoints, resume."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from nemo_anchor.cli import main as cli
from nemo_anchor.convert.sources import read_checkpoint
from nemo_anchor.run_dir import RunDir, checkpoint_step, resolve_checkpoint
from nemo_anchor.training.preemption import EXIT_INTERRUPTED
from nemo_anchor.training.config import load_config

REPO = Path(__file__).resolve().parents[1]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Pack my box with five dozen liquor jugs! " * 4,
    "How vexingly quick daft zebras jump; " * 9,
    "Sphinx of black quartz, judge my vow. " * 3,
    "a",
    "Waltz, bad nymph, for quick jigs vex. " * 12,
] * 6


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = root / "packed"
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "64",
                "--output", str(out)]) == 0
    return out


def _config(tmp_path, packed, **overrides):
    base = {
        "output_dir": str(tmp_path / "run"),
        "model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 64, "attention_type": "anchor"},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": 6, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "schedule": "constant"},
        "checkpoint": {"save_every": 3, "keep_last": 2},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base))
    return path, [f"{k}={v}" for k, v in overrides.items()]


def _losses(output_dir):
    path = Path(output_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _train(config_path, overrides):
    return cli(["train", "--config", str(config_path), *overrides])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, packed, precision):
    path, _ = _config(tmp_path, packed)
    precision = f"trainer.precision={precision}"
    assert _train(path, [f"output_dir={tmp_path / 'straight'}", precision]) == 0
    straight = _losses(tmp_path / "straight")
    assert sorted(straight) == list(range(1, 7))

    assert _train(path, [f"output_dir={tmp_path / 'split'}", "trainer.max_steps=3", precision]) == 0
    assert _train(path, [f"output_dir={tmp_path / 'split'}", precision]) == 0
    assert _losses(tmp_path / "split") == straight  # bitwise: same data, weights, fp32 masters, optimizer state

    record = json.loads((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= set(record)
    assert (tmp_path / "straight" / "tensorboard").is_dir()
    saved = RunDir(tmp_path / "straight").list_checkpoints()
    assert [checkpoint_step(p) for p in saved] == [3, 6]  # keep_last=2
    assert load_config(tmp_path / "straight" / "config.yaml").model.vocab_size > 256
    # exports read full precision: a bf16 run saves bf16 parameters, and the exporter reads their fp32
    # masters from the optimizer state, which six steps moved off the bf16 grid
    state = read_checkpoint(tmp_path / "straight").state
    assert all(t.dtype == torch.float32 for t in state.values())
    assert sum(int((t != t.bfloat16().float()).sum()) for t in state.values()) > 0


def test_loss_falls_in_bf16(tmp_path, packed):
    path, overrides = _config(tmp_path, packed, **{"trainer.precision": "bf16", "trainer.max_steps": 25,
                                                   "checkpoint.save_every": 0})
    assert _train(path, overrides) == 0
    losses = _losses(tmp_path / "run")
    assert sum(losses[s] for s in range(21, 26)) / 5 < 0.75 * sum(losses[s] for s in range(1, 6)) / 5


def test_kill_and_sigterm_leave_a_loadable_checkpoint(tmp_path, packed, capsys):
    """The user's `nemo-anchor train` command: SIGTERM to its process group saves the step reached and exits 75,
    and the same command resumes from that checkpoint; after SIGKILL the last complete checkpoint resumes."""
    path, _ = _config(tmp_path, packed)
    out = tmp_path / "killed"
    args = ["train", "--config", str(path), f"output_dir={out}", "checkpoint.save_every=2"]
    cmd = [str(Path(sys.executable).with_name("nemo-anchor")), *args, "trainer.max_steps=400"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}

    def run_until(step, sig):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        deadline = time.time() + 600  # waits for the step: far above what a busy machine needs
        while max(_losses(out) or {0: 0}) < step:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.time() < deadline, f"the run did not reach step {step}"
            time.sleep(0.2)
        os.killpg(proc.pid, sig)  # the whole job, as Slurm and Kubernetes signal it
        return proc, proc.communicate(timeout=600)[0]

    run_until(3, signal.SIGKILL)
    (out / "checkpoints" / ".tmp.iter_9999999").mkdir()  # what a kill during a save leaves behind
    killed_at = max(_losses(out))
    proc, output = run_until(killed_at + 3, signal.SIGTERM)
    assert proc.returncode == EXIT_INTERRUPTED, output[-2000:]
    latest, reached = resolve_checkpoint(out), max(_losses(out))
    assert checkpoint_step(latest) == reached  # SIGTERM saved the step it finished
    assert f"saved {latest} at step {reached}" in output, output[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == sorted(set(steps)) == list(range(1, max(steps) + 1))  # replayed steps logged once
    # the same command resumes from the stop's checkpoint (here in this process: its start is not under test)
    capsys.readouterr()
    assert cli([*args, f"trainer.max_steps={reached + 1}"]) == 0
    assert f"resumed from {latest} at step {reached}" in capsys.readouterr().out
    assert max(_losses(out)) == reached + 1


@pytest.mark.parametrize("override,message", [
    ("model.attention_typo=anchor", "attention_typo"),
    ("model.attention_type=sliding", "attention_type"),
    ("trainer.precision=fp8", "trainer.precision"),
    ("trainer.max_steps=ten", "max_steps"),
    ("model.seq_length=63", "model.seq_length"),
    ("optim.schedule=exponential", "optim.schedule"),
    ("optim.warmup_steps=-1", "optim.warmup_steps"),
    ("trainer.distributed_timeout_minutes=0", r"trainer.distributed_timeout_minutes=0.0: must be a positive"),
    ("model.tensor_model_parallel_size=3", "model.num_attention_heads"),
    ("model.pipeline_model_parallel_size=3", "model.num_layers"),
    ("model.recompute_num_layers=1", "model.recompute_num_layers"),
])
def test_bad_config_names_the_key(tmp_path, packed, override, message):
    path, _ = _config(tmp_path, packed)
    with pytest.raises(ValueError, match=message):
        load_config(path, [override])


@pytest.mark.parametrize("overrides,message", [
    (["model.context_parallel_size=3", "model.cp_comm_type=all_gather"],
     "model.seq_length=64: must be divisible by 2 x model.context_parallel_size"),
    (["model.context_parallel_size=2", "model.num_attention_heads=8", "model.num_query_groups=8",
      "model.tensor_model_parallel_size=8", "model.cp_comm_type=all_gather", "model.ffn_hidden_size=64",
      "model.seq_length=40"], "model.seq_length=40: must be divisible by model.context_parallel_size x "
                                             "model.tensor_model_parallel_size = 16"),
    (["model.context_parallel_size=2", "model.attention_type=intra_doc_reset", "model.num_attention_heads=4",
      "model.num_query_groups=4", "model.tensor_model_parallel_size=4", "model.cp_comm_type=all_gather"],
     "model.tensor_model_parallel_size=4: at most 2"),
    (["model.context_parallel_size=4", "model.cp_comm_type=a2a"], "model.num_query_groups=2 is not divisible"),
    (["model.tensor_model_parallel_size=2", "model.num_query_groups=1"], "model.num_query_groups"),
])
def test_layouts_megatron_cannot_run_are_refused_before_launch(tmp_path, packed, overrides, message):
    path, _ = _config(tmp_path, packed)
    with pytest.raises(ValueError, match=message):
        load_config(path, overrides)


def test_dataset_window_must_match_model(tmp_path, packed, capsys):
    path, overrides = _config(tmp_path, packed, **{"model.seq_length": 128})
    assert _train(path, overrides) == 2
    assert "nemo-anchor train: error: model.seq_length=128" in capsys.readouterr().err


def test_paper_configs_load_and_validate():
    for path in sorted((REPO / "configs" / "paper").glob("*.yaml")):
        config = load_config(path)
        assert config.optim.lr == 2e-5 and config.trainer.max_steps == 2000 and config.trainer.global_batch_size == 8
        assert config.model.resolved_rotary_base() == {65536: 5e6, 131072: 1e7}[config.model.seq_length]


def test_continued_pretraining_from_an_imported_hf_model(tmp_path, packed):
    """The user flow: train, export to HF, import-hf into a fresh output_dir, continue training there."""
    path, overrides = _config(tmp_path, packed, **{"trainer.max_steps": 12, "checkpoint.save_every": 0})
    assert _train(path, overrides) == 0
    first = _losses(tmp_path / "run")
    assert cli(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert cli(["import-hf", str(tmp_path / "hf"), str(tmp_path / "continued")]) == 0
    assert _train(path, [f"output_dir={tmp_path / 'continued'}", "trainer.max_steps=1"]) == 0
    continued = _losses(tmp_path / "continued")
    assert continued[1] < first[1] - 0.5  # it starts from the trained weights, not from scratch


def test_init_from_a_checkpoint_of_another_shape_names_the_tensor(tmp_path, packed):
    from nemo_anchor.convert.megatron_state import build_model
    from nemo_anchor.convert.sources import read_model_config
    from nemo_anchor.training.init_from_hf import init_model_from_hf

    path, overrides = _config(tmp_path, packed, **{"trainer.max_steps": 1, "checkpoint.save_every": 0})
    assert _train(path, overrides) == 0
    config, _ = read_model_config(tmp_path / "run")
    with pytest.raises(ValueError, match=r"word_embeddings.weight has shape \(259, 32\), the model being trained "
                                         r"has \(512, 32\)"):
        init_model_from_hf(build_model(config, 512), tmp_path / "run")
