"""The trainer on several gloo ranks: every parallel layout reproduces the single-process run.

Data parallelism with the distributed optimizer, tensor parallelism (with sequence parallelism),
pipeline parallelism, context parallelism (both communication types, up to 8 ranks) and their
products, and resuming a checkpoint in another layout. Runs of one process count share one
launch (:data:`_RUNS`), whose ranks torch's elastic agent (what torchrun runs) forks from a process that
has imported the trainer once (tests/forked_ranks.py); the resumed runs of two processes go on in the
two-process launch, those of one process run in this one.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_anchor.cli import main as cli
from tiny_runs import child_environment  # tests/tiny_runs.py

REPO = Path(__file__).resolve().parents[1]
TESTS_ON_THE_PATH = f"{REPO}{os.pathsep}{REPO / 'tests'}"  # the launch script imports tests/forked_ranks.py
TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "a", "Pack my box with five dozen liquor jugs! " * 2,
         "How vexingly quick daft zebras jump; ", "Sphinx of black quartz, judge my vow. " * 5] * 8
STEPS = 4
RESUME_AT = 2  # the resumed runs take two steps, so the second one uses the optimizer state read back

# several training runs in one launch: argv = config, process count,
# JSON [[output_dir, [overrides...], continued], ...]; a run with ``continued`` (the output_dir of an earlier run
# of the launch) starts from a copy of that run's folder
_RUNS = '''
import json, shutil, sys


def run_all(config, plan):
    import torch.distributed as dist

    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.loop import train

    for output_dir, overrides, continued in plan:
        if continued:  # every rank has finished the earlier run; one copies its folder
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.copytree(continued, output_dir)
            dist.barrier()
        train(load_config(config, [f"output_dir={output_dir}", *overrides]))


# dist_checkpointing's spawn-context Manager (its write-results queue) re-imports this module: the trainer is
# imported only here, once, before the ranks are forked (tests/forked_ranks.py)
if __name__ == "__main__":
    import nemo_anchor.training.loop
    from forked_ranks import run_ranks

    processes, plan = int(sys.argv[2]), json.loads(sys.argv[3])
    if processes == 1:
        run_all(sys.argv[1], plan)
    else:
        run_ranks(processes, run_all, sys.argv[1], plan)
'''
ANCHOR, RESET = "model.attention_type=anchor", "model.attention_type=intra_doc_reset"
TP2, PP2 = "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"
A2A, ALL_GATHER = "model.cp_comm_type=a2a", "model.cp_comm_type=all_gather"
# the byte tokenizer's own 259 ids: tensor parallelism pads them to 512 rows, one process does not pad
BYTE_VOCAB = "model.vocab_size=null"


def _cp(size: int) -> str:
    return f"model.context_parallel_size={size}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel_training")


@pytest.fixture(scope="module")
def config(root):
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    packed = root / "packed"
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", "64", "--output", str(packed)]) == 0
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump({
        # 16 heads in 8 query groups: a2a context parallelism over 8 ranks, and over 2 on each of 2
        # tensor-parallel ranks; vocab_size as Megatron pads the byte tokenizer's for 2 tensor-parallel ranks
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 64, "num_attention_heads": 16,
                  "num_query_groups": 8, "seq_length": 64, "attention_backend": "cpu", "vocab_size": 384},
        "data": {"path": str(packed)},
        "trainer": {"max_steps": STEPS, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False},
        "optim": {"lr": 3e-3, "schedule": "constant", "clip_grad": 1.0},
        "checkpoint": {"save_every": 0},
    }))
    return path


def _launch(config: Path, processes: int, runs: list[tuple]) -> None:
    """``runs``: (output_dir, overrides) or (output_dir, overrides, the earlier run's output_dir it continues)."""
    script = config.parent / "runs.py"
    script.write_text(_RUNS)
    plan = json.dumps([[str(out), overrides, str(continued[0]) if continued else None]
                       for out, overrides, *continued in runs])
    proc = subprocess.run([sys.executable, str(script), str(config), str(processes), plan], capture_output=True,
                          text=True, timeout=900, env=child_environment(PYTHONPATH=TESTS_ON_THE_PATH))
    assert proc.returncode == 0, proc.stderr[-4000:]


def _losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def start(config, root):
    """Starting weights for every run (``model.init_from_hf``): a random init depends on the layout
    (each tensor-parallel rank draws its own SwiGLU halves), loading one checkpoint does not. Their launch
    goes on with the one-process runs of :data:`LAYOUTS`, which start from them."""
    start = {vocab: f"model.init_from_hf={root / name}" for vocab, name in ((None, "start"),
                                                                          (BYTE_VOCAB, "start_byte_vocab"))}
    _launch(config, 1, [(root / "start", ["trainer.max_steps=1"]),
                        (root / "start_byte_vocab", ["trainer.max_steps=1", BYTE_VOCAB]),
                        *_runs_of(start, root, 1)])
    return start


def _start(start: dict, overrides: list[str]) -> str:
    """The starting weights of a run, in its vocabulary."""
    return start[BYTE_VOCAB if BYTE_VOCAB in overrides else None]


# name -> (processes, overrides); every run of a process count is one launch
LAYOUTS = {
    "single_anchor": (1, [ANCHOR]),
    "single_reset": (1, [RESET]),
    "dp2": (2, [ANCHOR]),
    "tp2": (2, [ANCHOR, TP2]),
    "pp2": (2, [ANCHOR, PP2]),
    "cp2_all_gather": (2, [RESET, _cp(2), ALL_GATHER]),
    "dp2_saved": (2, [ANCHOR, f"trainer.max_steps={RESUME_AT}"]),  # the checkpoint the resume tests continue
    "dp2_cp2_a2a": (4, [ANCHOR, _cp(2), A2A]),
    "tp2_cp2_a2a": (4, [ANCHOR, TP2, _cp(2), A2A]),
    "pp2_cp2_all_gather": (4, [RESET, PP2, _cp(2), ALL_GATHER]),
    "cp8_a2a": (8, [ANCHOR, _cp(8), A2A]),
    "cp8_all_gather": (8, [RESET, _cp(8), ALL_GATHER]),
    "tp2_pp2_cp2_a2a": (8, [ANCHOR, TP2, PP2, _cp(2), A2A]),
    "single_byte_vocab": (1, [ANCHOR, BYTE_VOCAB]),
    "tp2_byte_vocab": (2, [ANCHOR, BYTE_VOCAB, TP2]),  # padded to 512 rows
    # 260 rows: 128 x 4 would leave the last rank padding only
    "tp4_byte_vocab": (4, [ANCHOR, BYTE_VOCAB, "model.tensor_model_parallel_size=4"]),
    "dp2_byte_vocab_saved": (2, [ANCHOR, BYTE_VOCAB, f"trainer.max_steps={RESUME_AT}"]),
    "tp2_byte_vocab_saved": (2, [ANCHOR, BYTE_VOCAB, TP2, f"trainer.max_steps={RESUME_AT}"]),
}


def _runs_of(start: dict, root: Path, processes: int) -> list[tuple[Path, list[str]]]:
    """The :data:`LAYOUTS` runs of one process count, from the starting weights."""
    return [(root / run, [_start(start, overrides), *overrides])
            for run, (count, overrides) in LAYOUTS.items() if count == processes]


@pytest.fixture(scope="module")
def trained(config, root, start):
    """``trained(name)``: the per-step losses of a :data:`LAYOUTS` run (its process count's launch runs on first use;
    the two-process launch goes on with the two-process runs of :data:`RESUMED`)."""
    done = {1}  # the starting weights' launch ran the one-process runs

    def losses(name: str) -> dict[int, float]:
        processes = LAYOUTS[name][0]
        if processes not in done:
            continued = [(root / run, [_start(start, overrides), *overrides], root / saved)
                         for run, (saved, count, overrides) in RESUMED.items() if count == processes]
            _launch(config, processes, _runs_of(start, root, processes) + continued)
            done.add(processes)
        return _losses(root / name)
    return losses


def _reference(trained, name: str) -> dict[int, float]:
    overrides = LAYOUTS[name][1]
    single = trained("single_reset" if RESET in overrides else "single_byte_vocab" if BYTE_VOCAB in overrides
                     else "single_anchor")
    assert sorted(single) == list(range(1, STEPS + 1))
    assert single[STEPS] < single[1]  # it trains: later steps see new weights
    return single


def _close(parallel: dict, single: dict, atol: float) -> None:
    assert parallel and set(parallel) <= set(single)
    worst = max(abs(parallel[s] - single[s]) for s in parallel)
    assert worst <= atol, f"per-step loss differs by {worst:.3g} (parallel {parallel}, single {single})"


def test_data_parallel_with_distributed_optimizer(root, trained):
    _close(trained("dp2"), _reference(trained, "dp2"), 1e-6)
    memory = [json.loads(line) for line in (root / "dp2" / "metrics.jsonl").read_text().splitlines()]
    state = next(r["memory"] for r in memory if "memory" in r)
    total = sum(state["optimizer_bytes"])  # fp32 Adam moments, sharded over the two ranks
    assert len(state["optimizer_bytes"]) == 2 and max(state["optimizer_bytes"]) <= 0.6 * total


@pytest.mark.parametrize("name", [name for name, (processes, _) in LAYOUTS.items()
                                  if processes > 1 and name not in ("dp2", "dp2_saved", "dp2_byte_vocab_saved",
                                                                    "tp2_byte_vocab_saved")])
def test_layout_reproduces_one_process(trained, name):
    losses = trained(name)
    assert sorted(losses) == list(range(1, STEPS + 1))
    _close(losses, _reference(trained, name), 1e-5)


@pytest.fixture(scope="module")
def resumed(root, config, start, trained):
    """The data- or tensor-parallel checkpoint of step RESUME_AT, continued to STEPS in other layouts: those of
    two processes in the two-process launch (after the runs they continue), those of one in this process."""
    for name, (saved, processes, overrides) in RESUMED.items():
        trained(saved)  # its process count's launch
        if processes == 1:
            shutil.copytree(root / saved, root / name)
            assert cli(["train", "--config", str(config), f"output_dir={root / name}", _start(start, overrides),
                        *overrides]) == 0
    return lambda name: _losses(root / name)


# name -> (the checkpoint of step RESUME_AT it continues, processes, overrides)
RESUMED = {
    "resumed_pp2": ("dp2_saved", 2, [ANCHOR, PP2]), "resumed_tp2": ("dp2_saved", 2, [ANCHOR, TP2]),
    "resumed_cp2": ("dp2_saved", 2, [ANCHOR, _cp(2)]), "resumed_one_process": ("dp2_saved", 1, [ANCHOR]),
    # a vocabulary that tensor parallelism pads: checkpoints store its 259 rows, whatever the layout
    "resumed_byte_vocab_tp2": ("dp2_byte_vocab_saved", 2, [ANCHOR, BYTE_VOCAB, TP2]),
    "resumed_byte_vocab_one_process": ("tp2_byte_vocab_saved", 1, [ANCHOR, BYTE_VOCAB]),
    "resumed_byte_vocab_pp2": ("tp2_byte_vocab_saved", 2, [ANCHOR, BYTE_VOCAB, PP2]),
}


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_in_another_layout_continues_the_straight_run(trained, resumed, name):
    """A checkpoint saved at data parallel 2 continues exactly at pipeline 2, tensor 2, context 2 and in one
    process; one of the byte tokenizer's vocabulary, saved at data or tensor parallel 2 (512 padded rows),
    continues at tensor parallel 2, pipeline parallel 2 and in one process (259 rows)."""
    saved = RESUMED[name][0]
    losses = resumed(name)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[RESUME_AT] == trained(saved)[RESUME_AT]  # steps before the resume logged once
    _close({s: v for s, v in losses.items() if s > RESUME_AT}, _reference(trained, saved), 1e-5)


def test_padded_vocabulary_stays_out_of_checkpoints_and_exports(root, trained, tmp_path):
    """A tensor-parallel checkpoint of the byte tokenizer stores its 259 rows, weights and Adam moments alike,
    and exports a Hugging Face model of 259 tokens: no padded row that generation could emit."""
    from megatron.core import dist_checkpointing
    from safetensors import safe_open

    trained("tp2_byte_vocab_saved")
    checkpoint = root / "tp2_byte_vocab_saved" / "checkpoints" / f"iter_{RESUME_AT:07d}"
    vocab_rows = {key: tuple(meta.global_shape) for key, meta in
                  dist_checkpointing.load_tensors_metadata(str(checkpoint)).items()
                  if key.endswith(("word_embeddings.weight", "output_layer.weight"))}
    assert len(vocab_rows) == 6 and set(vocab_rows.values()) == {(259, 64)}, vocab_rows  # weights, exp_avg, exp_avg_sq
    assert cli(["export-hf", str(checkpoint), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 259
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as weights:
        assert {name: weights.get_slice(name).get_shape() for name in ("model.embed_tokens.weight", "lm_head.weight")} \
            == {"model.embed_tokens.weight": [259, 64], "lm_head.weight": [259, 64]}
