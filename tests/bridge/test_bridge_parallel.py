"""Megatron-Bridge's pretrain() in model-parallel layouts on packed windows (.venv-bridge, gloo ranks on the CPU).

Every layout starts from the same weights, a random Llama imported through AutoBridge and given as
``checkpoint.pretrained_checkpoint``, and runs 3 fp32 steps on the same windows: pipeline 2 and
tensor 2 x context 2 (context parallel's all-gather; tests/bridge/test_bridge.py runs its a2a) each
equal one process of `nemo-anchor train` from those weights within 1e-5. Batches reach every rank in
Megatron-LM's fixed packed shapes. Bridge's distributed optimizer (data parallel 2) equals that one
process and resumes bit for bit (on two nodes of a real Slurm cluster, through a time-limit requeue and a
node failure: tests/bridge/test_bridge_slurm.py). The runs fork their ranks from a process that imported
Bridge once (tests/preloaded.py). Skipped where Megatron-Bridge is not installed.
"""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

import nemo_anchor.bridge  # noqa: E402

import transformers  # noqa: E402

from nemo_anchor.cli import main as cli  # noqa: E402
from nemo_anchor.data import (PackedDataset, byte_tokenizer, collate_windows, fixed_shape_batch,  # noqa: E402
                              variable_shape_batch)

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4,
         "How vexingly quick daft zebras jump; " * 9, "a", "Waltz, bad nymph, for quick jigs vex. " * 12] * 6
# tiny, with heads divisible by tensor x context parallel sizes; the byte vocabulary padded for tensor 2
SHAPE = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=8, num_query_groups=4,
             vocab_size=512)


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    """(a `nemo-anchor train` YAML over packed byte windows of 64 tokens, the packed directory)."""
    root = tmp_path_factory.mktemp("bridge-parallel")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert cli(["pack", "--input", str(root / "corpus.jsonl"), "--tokenizer", "byte", "--seq-length", "64",
                "--output", str(root / "packed")]) == 0
    config = root / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(root / "unused"),
        "model": {**SHAPE, "seq_length": 64, "attention_type": "anchor", "rotary_base": "10000"},
        "data": {"path": str(root / "packed")},
        "trainer": {"max_steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
                    "progress_bar": False, "eval_batches": 0, "seed": 7},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 3},
    }))
    return config, root / "packed"


def bridge_pretrain(server, config, save, *overrides, nproc=1, timeout=600):
    """Bridge's pretrain() from the command line; several ranks: as torchrun --standalone, forked."""
    run = server.run(["--config", str(config), f"checkpoint.save={save}", f"checkpoint.load={save}", "--peak-tflops",
                      "1", *overrides], processes=nproc, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(save) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def start_checkpoint(tmp_path_factory):
    """A random Llama of SHAPE with the byte tokenizer, imported through AutoBridge in this process (no pretrain
    process to start): every layout below starts from its weights."""
    root = tmp_path_factory.mktemp("start")
    config = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"], intermediate_size=SHAPE["ffn_hidden_size"],
        num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_attention_heads"],
        num_key_value_heads=SHAPE["num_query_groups"], max_position_embeddings=64, rope_theta=10000.0,
        bos_token_id=256, eos_token_id=257, pad_token_id=258)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    byte_tokenizer().save(root / "hf")
    return nemo_anchor.bridge.import_hf(root / "hf", root / "megatron")


@pytest.fixture(scope="module")
def one_process(run_config, start_checkpoint, tmp_path_factory):
    """The 3 steps in one process of `nemo-anchor train`, in this process, from the same HF weights
    (tests/bridge/test_bridge.py: Bridge's pretrain() in one process equals it within 1e-5)."""
    output = tmp_path_factory.mktemp("one-process") / "run"
    assert cli(["train", "--config", str(run_config[0]), f"output_dir={output}",
                f"model.init_from_hf={start_checkpoint.parent / 'hf'}"]) == 0
    return {r["step"]: r["loss"] for r in map(json.loads, (output / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def test_fixed_shape_batches_carry_documents_and_windows(run_config):
    windows = PackedDataset(run_config[1])
    batches = [collate_windows([windows[i], windows[i + 1]]) for i in range(0, 8, 2)]
    fixed = [fixed_shape_batch(b) for b in batches]
    # the shapes depend only on the micro-batch size and the window length
    assert {tuple((k, tuple(v.shape)) for k, v in f.items()) for f in fixed} == {(
        ("tokens", (2, 64)), ("labels", (2, 64)), ("loss_mask", (2, 64)), ("position_ids", (2, 64)),
        ("cu_seqlens", (1, 129)), ("cu_seqlens_argmin", (1,)), ("max_seqlen", (1,)))}
    assert len({len(b["cu_seqlens"]) for b in batches}) > 1  # while the document counts differ
    for batch, padded in zip(batches, fixed):
        count = int(padded["cu_seqlens_argmin"])
        assert (padded["cu_seqlens"][0, count:] == -1).all() and (padded["cu_seqlens"][0, :count] >= 0).all()
        assert int(padded["max_seqlen"]) == int((batch["cu_seqlens"].diff()).max())
        back = variable_shape_batch(padded)
        assert sorted(back) == sorted(batch)
        for key in batch:
            assert torch.equal(back[key], batch[key]), key
    with pytest.raises(ValueError, match="cu_seqlens_argmin=200"):
        variable_shape_batch({**fixed[0], "cu_seqlens_argmin": torch.tensor([200])})


@pytest.mark.parametrize("layout", [
    pytest.param(("model.pipeline_model_parallel_size=2",), id="pipeline2"),
    pytest.param(("model.tensor_model_parallel_size=2", "model.context_parallel_size=2",
                  "model.cp_comm_type=all_gather"), id="tensor2xcontext2"),
])
def test_model_parallel_layout_equals_one_process(pretrain_cli, run_config, start_checkpoint, one_process, layout,
                                                  tmp_path):
    nproc = 4 if len(layout) > 1 else 2
    losses = bridge_pretrain(pretrain_cli, run_config[0], tmp_path / "run",
                             f"checkpoint.pretrained_checkpoint={start_checkpoint}", *layout, nproc=nproc)
    assert sorted(losses) == [1, 2, 3] == sorted(one_process)
    for step in losses:
        assert losses[step] == pytest.approx(one_process[step], abs=1e-5), (step, losses, one_process)


DISTRIBUTED_OPTIMIZER = ("optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true")


@pytest.fixture(scope="module")
def data_parallel_2(pretrain_cli, run_config, start_checkpoint, tmp_path_factory):
    """3 steps on one node, two processes (data parallel 2) with Bridge's distributed optimizer."""
    save = tmp_path_factory.mktemp("data-parallel-2")
    return bridge_pretrain(pretrain_cli, run_config[0], save, f"checkpoint.pretrained_checkpoint={start_checkpoint}",
                           *DISTRIBUTED_OPTIMIZER, nproc=2)


def test_distributed_optimizer_equals_one_process(one_process, data_parallel_2):
    assert sorted(data_parallel_2) == [1, 2, 3]
    for step in data_parallel_2:  # each rank updates its half of the parameters
        assert data_parallel_2[step] == pytest.approx(one_process[step], abs=1e-5)


def test_distributed_optimizer_saves_sharded_and_resumes_exactly(pretrain_cli, run_config, start_checkpoint,
                                                                 data_parallel_2, tmp_path):
    """2 steps saved by two ranks, then resumed to 3 by the same two ranks."""
    from megatron.core import dist_checkpointing

    split = tmp_path / "split"
    start = f"checkpoint.pretrained_checkpoint={start_checkpoint}"
    bridge_pretrain(pretrain_cli, run_config[0], split, start, *DISTRIBUTED_OPTIMIZER, "train.train_iters=2",
                    "checkpoint.save_interval=2", nproc=2)
    saved = dist_checkpointing.load_content_metadata(str(split / "iter_0000002"))
    assert saved["distrib_optim_sharding_type"] == "dp_reshardable"  # the optimizer state is sharded over ranks
    resumed = bridge_pretrain(pretrain_cli, run_config[0], split, start, *DISTRIBUTED_OPTIMIZER, nproc=2)
    assert resumed == data_parallel_2  # steps 1-2 from the first run's metrics, step 3 after the resume: bit for bit
