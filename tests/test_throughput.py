"""TFLOP/s and MFU in every run: metrics.jsonl rows against the FLOP count, the peak's sources, the config key."""
import json

import pytest
import torch
import yaml

from nemo_anchor.cli import main as cli
from nemo_anchor.data import PackedDataset, WindowSampler
from nemo_anchor.model.flops import StepFlops, train_step_flops
from nemo_anchor.training import throughput
from nemo_anchor.training.config import load_config

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4,
         "a", "Sphinx of black quartz, judge my vow. " * 3, "Waltz, bad nymph, for quick jigs vex. " * 12] * 6


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "64",
                "--output", str(root / "packed")]) == 0
    return root / "packed"


def test_metrics_rows_carry_tflops_and_mfu_from_the_flop_count(tmp_path, packed):
    config = {
        "output_dir": str(tmp_path / "run"),
        "model": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 64, "attention_type": "anchor", "recompute": "selective"},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": 3, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False, "peak_tflops": 0.05, "seed": 7},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli(["train", "--config", str(path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]

    run = load_config(path)
    dataset = PackedDataset(packed)
    sampler = WindowSampler(len(dataset), seed=7, shuffle=True)  # the trainer's window order
    for row in rows:
        windows = sampler.next_global_batch(2)
        flops = train_step_flops(run.model, dataset.tokenizer.vocab_size, [dataset[i]["cu_seqlens"] for i in windows])
        assert row["tflops_per_device"] == pytest.approx(flops.model / row["step_time_s"] / 1e12, rel=1e-9)
        assert row["mfu"] == pytest.approx(row["tflops_per_device"] / 0.05, rel=1e-9)
        # selective recompute runs the attention core's forward again: HFU counts it, MFU does not
        assert flops.hardware > flops.model
        assert row["hfu"] == pytest.approx(flops.hardware / row["step_time_s"] / 1e12 / 0.05, rel=1e-9)


def test_peak_sources():
    assert throughput.published_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert throughput.published_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert throughput.published_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert throughput.published_peak_tflops("NVIDIA A10") == 125.0
    assert throughput.published_peak_tflops("Some Accelerator") is None
    assert throughput.resolve_peak_tflops(123.0, torch.device("cpu"), "bf16") == (123.0, "trainer.peak_tflops")
    measured, source = throughput.resolve_peak_tflops(None, torch.device("cpu"), "fp32")
    assert measured > 0 and "measured" in source
    rates = throughput.rates(flops=StepFlops(model=6e12, hardware=8e12), seconds=2.0, devices=3, peak_tflops=2.0)
    assert rates == {"tflops_per_device": pytest.approx(1.0), "mfu": pytest.approx(0.5), "hfu": pytest.approx(2 / 3)}


def test_cpu_peak_is_the_fastest_this_cpu_has_shown(tmp_path, monkeypatch):
    """A measurement taken under load (lower) does not lower the peak MFU is computed against."""
    monkeypatch.setenv("NEMO_ANCHOR_CACHE", str(tmp_path / "cache"))
    assert throughput.remembered_cpu_peak("fp32", 0.2)[0] == 0.2
    peak, source = throughput.remembered_cpu_peak("fp32", 0.05)  # a busy machine
    assert peak == 0.2 and "fastest fp32 matmul" in source
    assert throughput.remembered_cpu_peak("bf16", 0.1)[0] == 0.1  # kept per precision
    assert throughput.remembered_cpu_peak("fp32", 0.3)[0] == 0.3
    assert sorted(json.loads((tmp_path / "cache" / "cpu_peak_tflops.json").read_text()).values()) == [0.1, 0.3]
    (tmp_path / "cache" / "cpu_peak_tflops.json").write_text("not json")  # a damaged cache is measured again
    assert throughput.remembered_cpu_peak("fp32", 0.01)[0] == 0.01


def test_peak_tflops_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.peak_tflops=-1.0"):
        load_config(None, ["output_dir=x", "data.path=y", "trainer.peak_tflops=-1"])
