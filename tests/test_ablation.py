"""`nemo-anchor ablate` on the CPU with a tiny model: same start and documents, every metric, resume, errors."""
import json
import math
import os
import re
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from nemo_anchor.ablation import measure as measure_module
from nemo_anchor.cli import main as cli
from nemo_anchor.command import EXIT_USER_ERROR
from nemo_anchor.data import PackedDataset
from nemo_anchor.data.layout import DOCUMENT_SOURCES_FILE
from nemo_anchor.run_dir import RunDir, checkpoint_step
from nemo_anchor.training import loop
from nemo_anchor.training.config import load_config
from nemo_anchor.training.preemption import EXIT_INTERRUPTED

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "ablation" / "tiny.yaml"
ALL_VARIANTS = ["full", "intra_doc", "intra_doc_reset", "anchor", "anchor+tag", "anchor+interleave"]
SENTENCES = {"web": "The quick brown fox jumps over the lazy dog. ", "code": "def f(x):\n    return x * 2\n"}


def documents():
    return [{"text": SENTENCES[domain] * (2 + index % 9) + f"#{index}", "domain": domain}
            for index in range(90) for domain in [("web", "code")[index % 2]]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("ablation_corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in documents()))
    return path


def ablate(output, corpus, variants, *extra):
    return cli(["ablate", "--config", str(CONFIG), "--output", str(output), "--variants", ",".join(variants),
                f"pack.inputs=[{corpus}]", *extra])


@pytest.fixture(scope="module")
def ablation(tmp_path_factory, corpus):
    output = tmp_path_factory.mktemp("ablation") / "out"
    assert ablate(output, corpus, ALL_VARIANTS) == 0
    return output


def _report(output):
    return json.loads((output / "ablation.json").read_text())


def _byte_counts(dataset_dir):
    """Counter of the byte tokens (< 256) in every window: the document text, tags included, no specials."""
    dataset = PackedDataset(dataset_dir)
    tokens = np.concatenate([dataset[index]["tokens"].numpy() for index in range(len(dataset))])
    return Counter(tokens[tokens < 256].tolist())


def test_every_variant_trains_from_the_same_start_on_the_same_documents(ablation):
    report = _report(ablation)
    assert list(report["variants"]) == ALL_VARIANTS
    starts = {name: variant["start"] for name, variant in report["variants"].items()}
    assert report["same_start"] is True and len({start["weights_sha256"] for start in starts.values()}) == 1

    configs = {name: load_config(Path(v["output_dir"]) / "config.yaml") for name, v in report["variants"].items()}
    for name, config in configs.items():
        assert config.model.attention_type == name.split("+")[0]
        assert Path(config.data.path).name == {"anchor+tag": "tag", "anchor+interleave": "interleave"}.get(name, "plain")
        assert config.data.valid_path == configs["full"].data.valid_path  # evaluated on the same held-out windows
        for section in ("trainer", "optim", "checkpoint"):
            assert getattr(config, section) == getattr(configs["full"], section)
        assert {**vars(config.model), "attention_type": None} == {**vars(configs["full"].model), "attention_type": None}
        steps = [json.loads(line)["step"] for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()
                 if "loss" in json.loads(line)]
        assert steps == [1, 2, 3, 4]

    # the same documents in every packing, against the corpus itself
    data = ablation / "data"
    sources = np.load(data / "plain" / DOCUMENT_SOURCES_FILE)
    for packing in ("tag", "interleave"):
        assert sorted(np.load(data / packing / DOCUMENT_SOURCES_FILE)) == sorted(sources)
    records = documents()
    expected = Counter(b for index in sources for b in records[index]["text"].encode())
    assert _byte_counts(data / "plain") == expected
    assert _byte_counts(data / "interleave") == expected
    tags = Counter(b for index in sources for b in f"<{records[index]['domain']}>\n".encode())
    assert _byte_counts(data / "tag") == expected + tags


def test_json_and_table_hold_every_metric_for_every_variant(ablation):
    report = _report(ablation)
    keys = ["valid_loss", "heldout_ppl", "ppl@1-63", "ppl@64-127", "ppl@128-191", "ppl@192-255", "ruler@512",
            "ruler_avg", "d_logit@256", "tokens_per_s"]
    assert report["checkpoint_steps"] == [2, 4]
    for name, variant in report["variants"].items():
        assert list(variant["metrics"]) == keys, name
        for key, metric in variant["metrics"].items():
            count = len(metric["values"])
            assert count == (3 if key == "tokens_per_s" else 2), (name, key)  # steps 2-4, or checkpoints 2 and 4
            assert metric["mean"] == pytest.approx(sum(metric["values"]) / count)
            assert metric["std"] == pytest.approx(float(np.std(metric["values"], ddof=1)))
        rows = [json.loads(line) for line in (Path(variant["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert variant["metrics"]["valid_loss"]["values"] == [r["valid_loss"] for r in rows if "valid_loss" in r][-2:]

    table = (ablation / "ablation.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| variant"))
    labels = [metric["label"] for metric in report["variants"]["full"]["metrics"].values()]
    assert header == "| variant | " + " | ".join(labels) + " |"
    for name, variant in report["variants"].items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")][1:]
        assert len(cells) == len(keys)
        for cell, metric in zip(cells, variant["metrics"].values()):
            assert float(cell.split(" ± ")[0]) == pytest.approx(metric["mean"], rel=1e-3)
        if name != "full":
            assert f"- **{name}**:" in table
    for comparison in report["comparisons"]:
        ours = report["variants"][comparison["variant"]]["metrics"][comparison["metric"]]
        theirs = report["variants"]["full"]["metrics"][comparison["metric"]]
        noise = math.sqrt(ours["std"] ** 2 + theirs["std"] ** 2)
        assert comparison["within_noise"] == (abs(ours["mean"] - theirs["mean"]) <= noise)
    assert len(report["comparisons"]) == len(keys) * (len(ALL_VARIANTS) - 1)
    for name in ("loss_curves.png", "ruler_vs_length.png", "perplexity_by_position.png"):
        assert (ablation / name).read_bytes().startswith(b"\x89PNG")


def test_heldout_perplexity_matches_a_float64_recomputation(ablation):
    """The last checkpoint's held-out perplexity, recomputed with transformers and a float64 loss."""
    from nemo_anchor.export.inference import load_hf_model

    variant = _report(ablation)["variants"]["anchor"]
    model, _ = load_hf_model(RunDir(variant["output_dir"]).checkpoint(4), dtype=torch.float32)
    valid = PackedDataset(variant["valid_data"])
    windows = torch.stack([valid[index]["tokens"] for index in range(2)])  # eval.perplexity_windows=2
    with torch.no_grad():
        logits = model(windows).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert variant["metrics"]["heldout_ppl"]["values"][-1] == pytest.approx(math.exp(nll.item()), rel=1e-4)


def test_rerun_skips_finished_variants_and_resumes_the_interrupted_one(tmp_path, corpus, monkeypatch, capsys):
    output = tmp_path / "out"
    extra = ["eval.tasks=[]", "eval.probe_sequences=0"]
    started, measured = [], []
    original_step, original_init = loop.Trainer.train_step, loop.Trainer.__init__
    original_measure = measure_module.measure_variant

    def interrupting_step(self, stop=None):
        record = original_step(self, stop)
        if self.config.model.attention_type == "anchor" and self.step == 1 and not self.resumed_from:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: finish the step, save, stop
        return record

    def recording_init(self, config):
        original_init(self, config)
        started.append((config.model.attention_type, self.resumed_from))

    monkeypatch.setattr(loop.Trainer, "train_step", interrupting_step)
    monkeypatch.setattr(loop.Trainer, "__init__", recording_init)
    monkeypatch.setattr("nemo_anchor.ablation.runner.measure_variant",
                        lambda *args: measured.append(args[0]) or original_measure(*args))

    assert ablate(output, corpus, ["full", "anchor"], *extra) == EXIT_INTERRUPTED
    assert started == [("full", None), ("anchor", None)] and not measured
    assert [checkpoint_step(p) for p in RunDir(output / "variants" / "anchor" / "train").list_checkpoints()] == [1]
    assert not (output / "ablation.json").exists()

    started.clear()
    assert ablate(output, corpus, ["full", "anchor"], *extra) == 0
    assert len(started) == 1 and started[0][0] == "anchor" and checkpoint_step(started[0][1]) == 1
    assert len(measured) == 2
    report = _report(output)
    assert report["same_start"] is True and set(report["variants"]) == {"full", "anchor"}
    rows = (output / "variants" / "anchor" / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in rows if "loss" in json.loads(line)] == [1, 2, 3, 4]

    started.clear(), measured.clear()
    assert ablate(output, corpus, ["full", "anchor"], *extra) == 0
    assert started == [] and measured == []  # nothing trained or measured again
    assert _report(output)["variants"] == report["variants"]

    capsys.readouterr()
    assert ablate(output, corpus, ["full", "anchor"], *extra, "trainer.max_steps=6") == EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert "nemo-anchor ablate: error: " in error and "trainer.max_steps: 4 -> 6" in error


def test_print_launches_prepares_configs_and_trains_nothing(tmp_path, corpus, capsys):
    output = tmp_path / "out"
    assert ablate(output, corpus, ["full", "anchor+tag"], "--print-launches", "--nproc-per-node", "8") == 0
    lines = capsys.readouterr().out.splitlines()
    launches = [line for line in lines if line.startswith("torchrun ")]
    assert len(launches) == 2 and all("--nproc-per-node=8" in line for line in launches)
    for line, (attention, packing) in zip(launches, [("full", "plain"), ("anchor", "tag")]):
        config = load_config(line.split("--config ")[1])
        assert config.model.attention_type == attention and Path(config.data.path).name == packing
    assert any(line.startswith("nemo-anchor ablate --config") and "--print-launches" not in line for line in lines)
    assert not list(output.glob("variants/*/train"))


@pytest.mark.parametrize("variants, extra, message", [
    (["full", "anchr"], [], r"unknown attention type 'anchr'"),
    (["anchor+tags"], [], r"unknown packing option 'tags'"),
    (["full", "full"], [], r"listed more than once"),
    (["full"], ["trainer.max_step=3"], r"max_step"),
    (["full"], ["checkpoint.save_every=4"], r"checkpoint.save_every=4: .* fewer than eval.last_k=2"),
    (["full"], ["trainer.eval_every=3"], r"trainer.eval_every=3"),
    (["full"], ["model.num_query_groups=3"], r"num_query_groups=3"),
    (["full"], ["eval.lengths=[64]"], r"eval.lengths=\[64\]"),
    (["full"], ["eval.dtype=fp8"], r"eval.dtype='fp8'"),
    (["full"], ["pack.inputs=[missing.jsonl]"], r"pack.inputs='missing.jsonl': does not exist"),
    (["full"], ["model.init_from_hf=missing"], r"model.init_from_hf='missing': does not exist"),
])
def test_bad_variant_or_config_is_a_clear_error_before_training(tmp_path, corpus, monkeypatch, capsys, variants,
                                                                 extra, message):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(loop.Trainer, "__init__", no_training)
    capsys.readouterr()
    assert ablate(tmp_path / "out", corpus, variants, *extra) == EXIT_USER_ERROR
    error = capsys.readouterr().err
    assert error.startswith("nemo-anchor ablate: error: ") and re.search(message, error), error
    assert not list(tmp_path.glob("out/variants/*/train"))


def test_smollm2_config_loads(tmp_path, corpus):
    from nemo_anchor.ablation.config import load_ablation_config

    config = load_ablation_config(REPO / "configs" / "ablation" / "smollm2.yaml", [f"pack.inputs=[{corpus}]",
                                                                                      f"model.init_from_hf={tmp_path}"])
    assert (config.model.num_layers, config.model.hidden_size, config.trainer.precision) == (30, 576, "bf16")
    assert config.checkpoint.keep_last >= config.eval.last_k
    assert yaml.safe_load((REPO / "configs" / "ablation" / "smollm2.yaml").read_text())["pack"]["tokenizer"]


def test_an_interruption_after_a_scheduled_checkpoint_keeps_what_averaging_needs(tmp_path, corpus, monkeypatch):
    """N-AB10: the signal checkpoint of step 3 must not push out step 2 (save_every=2, keep_last=2, last_k=2)."""
    output = tmp_path / "out"
    extra = ["eval.tasks=[]", "eval.probe_sequences=0"]
    original_step = loop.Trainer.train_step

    def interrupting_step(self, stop=None):
        record = original_step(self, stop)
        if self.step == 3 and not self.resumed_from:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(loop.Trainer, "train_step", interrupting_step)
    assert ablate(output, corpus, ["anchor"], *extra) == EXIT_INTERRUPTED
    run = RunDir(output / "variants" / "anchor" / "train")
    assert [checkpoint_step(p) for p in run.list_checkpoints()] == [2, 3]
    assert ablate(output, corpus, ["anchor"], *extra) == 0  # resumes from 3, saves 4, averages 2 and 4
    # the newest keep_last (2) checkpoints survive, the signal's among them, and so do the scheduled ones averaged
    assert [checkpoint_step(p) for p in run.list_checkpoints()] == [2, 3, 4]
    assert _report(output)["checkpoint_steps"] == [2, 4]


def test_overrides_may_follow_eval_lengths_as_the_usage_line_orders_them(tmp_path, corpus, capsys):
    """N-AB06: '--eval-lengths L ... key=value' no longer reads the override as a length."""
    output = tmp_path / "out"
    assert cli(["ablate", "--config", str(CONFIG), "--output", str(output), "--variants", "anchor",
                "--print-launches", "--eval-lengths", "512", "768",
                f"pack.inputs=[{corpus}]", "trainer.max_steps=6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    config = load_config(next(line for line in lines if line.startswith("torchrun ")).split("--config ")[1])
    assert config.trainer.max_steps == 6
    evaluate = next(line for line in lines if line.startswith("nemo-anchor ablate --config"))
    assert "--eval-lengths 512 768" in evaluate and evaluate.endswith(f"'pack.inputs=[{corpus}]' trainer.max_steps=6")
    with pytest.raises(SystemExit):
        cli(["ablate", "--config", str(CONFIG), "--output", str(output), "--eval-lengths", "5x2"])
    assert "argument --eval-lengths: invalid int value: '5x2'" in capsys.readouterr().err
