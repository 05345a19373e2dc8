"""AnchorAttention on Megatron-Bridge 0.6 (.venv-bridge): conversion through AutoBridge, Bridge's own
pretrain() on packed windows against `nemo-anchor train`, resume, context parallel on 2 ranks.

Bridge's command line (``python -m nemo_anchor.bridge.pretrain``) runs in processes forked from one that imported
Megatron-Bridge once (tests/preloaded.py). Skipped where Megatron-Bridge is not installed (the NeMo 2 environment).
"""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("megatron.bridge") is None:  # checked before nemo_anchor.bridge installs its shims
    pytest.skip("Megatron-Bridge is not installed (scripts/setup_env.sh's .venv-bridge has it)", allow_module_level=True)

import nemo_anchor.bridge as bridge  # noqa: E402

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nemo_anchor.cli import main as cli  # noqa: E402
from nemo_anchor.compat import hf_rope  # noqa: E402
from nemo_anchor.data import byte_tokenizer  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Pack my box with five dozen liquor jugs! " * 4,
         "How vexingly quick daft zebras jump; " * 9, "a", "Waltz, bad nymph, for quick jigs vex. " * 12] * 6
SHAPE = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2)
LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def save_tiny_llama(path, **extra):
    """A random 2-layer grouped-query Llama with the byte tokenizer (norms away from 1, so a swap shows)."""
    config = transformers.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=256, eos_token_id=257, pad_token_id=258, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    byte_tokenizer().save(path)
    return path


def assert_same_tensors(a_dir, b_dir):
    """Every tensor of HF directory ``a_dir`` in ``b_dir``, bit for bit (a tied lm_head may be saved once)."""
    a, b = load_file(Path(a_dir) / "model.safetensors"), load_file(Path(b_dir) / "model.safetensors")
    if transformers.AutoConfig.from_pretrained(a_dir).tie_word_embeddings:
        for tensors in (a, b):
            head = tensors.pop("lm_head.weight", None)
            assert head is None or torch.equal(head, tensors["model.embed_tokens.weight"])
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_round_trip_keeps_every_tensor_and_the_rope(tmp_path):
    hf = save_tiny_llama(tmp_path / "hf", **{"rope_scaling": LLAMA31_SCALING, "rope_theta": 500000.0})
    megatron = bridge.import_hf(hf, tmp_path / "megatron", attention_type="anchor")
    assert (megatron / "iter_0000000" / "run_config.yaml").is_file()
    assert "AnchorGPTModelProvider" in (megatron / "iter_0000000" / "run_config.yaml").read_text()
    back = bridge.export_hf(megatron, tmp_path / "back")
    assert_same_tensors(hf, back)
    original, exported = (transformers.AutoConfig.from_pretrained(d) for d in (hf, back))
    assert hf_rope(exported) == hf_rope(original)
    with pytest.raises(FileExistsError, match="is not empty"):
        bridge.export_hf(megatron, tmp_path / "back")
    with pytest.raises(ValueError, match="overlaps the input"):
        bridge.import_hf(hf, hf / "inside")


@pytest.mark.parametrize("fault,expected", [
    ("missing", r"the weights lack tensor model\.layers\.1\.mlp\.down_proj\.weight of shape \(32, 64\), which "
                r".*config\.json \(num_hidden_layers=2\) needs"),
    ("extra layer", r"the weights lack tensor model\.layers\.2\.\S+ of shape \(\d+,( \d+)?\), which "
                    r".*config\.json \(num_hidden_layers=3\) needs"),
], ids=["missing-tensor", "config-has-a-layer-more"])
def test_import_refuses_hf_weights_that_disagree_with_their_config(tmp_path, fault, expected):
    """AutoBridge builds the HF model through transformers, which fills what the files lack at random: the import
    is refused naming the tensor, its shape and the config.json key (the rule import-hf and NeMo's importer apply)."""
    from safetensors.torch import save_file

    hf = save_tiny_llama(tmp_path / "hf")
    if fault == "missing":
        tensors = load_file(hf / "model.safetensors")
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    else:
        config = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=expected):
        bridge.import_hf(hf, tmp_path / "megatron")
    assert not (tmp_path / "megatron").exists()


def test_smollm2_round_trip_keeps_every_tensor(tmp_path, smollm2_dir):
    back = bridge.export_hf(bridge.import_hf(smollm2_dir, tmp_path / "megatron"), tmp_path / "back")
    assert_same_tensors(smollm2_dir, back)


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """(packed byte windows of 64 tokens, an HF Llama, its import_hf checkpoint, a `nemo-anchor train` YAML)."""
    root = tmp_path_factory.mktemp("bridge")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert cli(["pack", "--input", str(root / "corpus.jsonl"), "--tokenizer", "byte", "--seq-length", "64",
                "--output", str(root / "packed")]) == 0
    hf = save_tiny_llama(root / "hf", rope_theta=10000.0)
    megatron = bridge.import_hf(hf, root / "megatron")
    config = root / "run.yaml"
    config.write_text(json.dumps({
        "output_dir": str(root / "ours"),
        "model": {**SHAPE, "seq_length": 64, "attention_type": "anchor", "rotary_base": "10000", "init_from_hf": str(hf)},
        "data": {"path": str(root / "packed")},
        "trainer": {"max_steps": 6, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False, "eval_batches": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"save_every": 3},
    }))
    return root, megatron, config


def bridge_pretrain(server, config, megatron, save, *overrides, nproc=1):
    """Bridge's pretrain() from the command line; several ranks: as torchrun --standalone, forked."""
    run = server.run(["--config", str(config), f"checkpoint.pretrained_checkpoint={megatron}",
                      f"checkpoint.save={save}", f"checkpoint.load={save}", "--peak-tflops", "1", *overrides],
                     processes=nproc)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {r["step"]: r for r in map(json.loads, (Path(save) / "metrics.jsonl").read_text().splitlines())}


def losses(rows):
    return {step: row["loss"] for step, row in rows.items() if "loss" in row}


@pytest.fixture(scope="module")
def straight(start, pretrain_cli, tmp_path_factory):
    """Bridge's pretrain() for 6 steps from the imported weights: (checkpoint.save, metrics rows by step)."""
    root, megatron, config = start
    save = tmp_path_factory.mktemp("straight")
    return save, bridge_pretrain(pretrain_cli, config, megatron, save)


def test_pretrain_writes_metrics_and_equals_our_trainer(start, straight, tmp_path):
    root, megatron, config = start
    save, rows = straight
    assert sorted(rows) == list(range(1, 7))
    assert {"step", "loss", "lr", "tokens_per_s", "tflops_per_device", "mfu", "hfu"} <= set(rows[1])
    assert rows[1]["lr"] == 1e-3 and rows[6]["loss"] < rows[1]["loss"]
    assert cli(["train", "--config", str(config), f"output_dir={tmp_path / 'ours'}", "trainer.max_steps=3"]) == 0
    ours = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
    assert sorted(ours) == [1, 2, 3]
    for step in ours:  # same data, initial weights, optimizer and loss normalisation: fp32 rounding apart
        assert rows[step]["loss"] == pytest.approx(ours[step], abs=1e-5)


def test_three_steps_then_resume_to_six_equals_the_straight_run(start, pretrain_cli, straight, tmp_path):
    root, megatron, config = start
    bridge_pretrain(pretrain_cli, config, megatron, tmp_path / "split", "train.train_iters=3")
    resumed = bridge_pretrain(pretrain_cli, config, megatron, tmp_path / "split")
    assert losses(resumed) == losses(straight[1])  # bit for bit


def test_context_parallel_2_equals_one_process(start, pretrain_cli, straight, tmp_path):
    root, megatron, config = start
    two = losses(bridge_pretrain(pretrain_cli, config, megatron, tmp_path / "cp2", "train.train_iters=2",
                                 "model.context_parallel_size=2", nproc=2))
    assert sorted(two) == [1, 2]
    for step in two:
        assert two[step] == pytest.approx(straight[1][step]["loss"], abs=1e-5)


def test_trained_checkpoint_exports_to_transformers(start, straight, tmp_path):
    root = start[0]
    exported = bridge.export_hf(straight[0], tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(model).__name__ == "LlamaForCausalLM"
    before, after = load_file(root / "hf" / "model.safetensors"), load_file(exported / "model.safetensors")
    assert sorted(before) == sorted(after) and not torch.equal(before["lm_head.weight"], after["lm_head.weight"])


def test_overrides_and_data_errors_name_the_key(start, tmp_path):
    from nemo_anchor.bridge.pretrain import apply_overrides, prepare
    from nemo_anchor.bridge.recipes import from_run_config
    from nemo_anchor.training.config import load_config

    root, megatron, config = start
    recipe = from_run_config(load_config(config))
    apply_overrides(recipe, ["train.train_iters=3", "optimizer.lr=1e-3", "model.num_layers=1", "dataset.path=null"])
    assert (recipe.train.train_iters, recipe.optimizer.lr, recipe.model.num_layers) == (3, 1e-3, 1)
    with pytest.raises(ValueError, match="unknown config key train.iters"):
        apply_overrides(recipe, ["train.iters=3"])
    with pytest.raises(ValueError, match="dataset.path is not set"):
        prepare(recipe)
    apply_overrides(recipe, [f"dataset.path={root / 'packed'}", "model.seq_length=128", f"checkpoint.save={tmp_path}"])
    with pytest.raises(ValueError, match="windows of 64 tokens but model.seq_length=128"):
        prepare(recipe)


def test_recipes_build_and_the_context_extension_fits_the_planner():
    from nemo_anchor.bridge.recipes import RECIPES, llama3_context_extension

    for name, recipe in RECIPES.items():
        config = recipe()
        assert config.model.attention_type == "anchor", name
    paper = llama3_context_extension(131_072)
    assert paper.model.seq_length == 131_072 and paper.model.rotary_base == 1e7  # the paper's 10M at 128K
    assert paper.model.context_parallel_size > 1 and paper.model.recompute_granularity == "full"
    scaled = llama3_context_extension(65_536, rope="llama3.1")
    assert scaled.model.rope_scaling and scaled.model.rope_scaling_factor == 8.0 and scaled.model.rotary_base == 5e5
    with pytest.raises(ValueError, match="no context-parallel size up to 1"):
        llama3_context_extension(131_072, gpus=1, gpu=80)


# ---------------------------------------------------------------- the run guards of nemo-anchor train on pretrain()

def bridge_run(server, config, megatron, save, *args):
    """``python -m nemo_anchor.bridge.pretrain`` as bridge_pretrain runs it, not checked: (exit status, output)."""
    run = server.run(["--config", str(config), f"checkpoint.pretrained_checkpoint={megatron}",
                      f"checkpoint.save={save}", f"checkpoint.load={save}", "--peak-tflops", "1", *args])
    return run.returncode, run.stdout + run.stderr


def pack_texts(root, texts, tokenizer="byte"):
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert cli(["pack", "--input", str(root / "corpus.jsonl"), "--tokenizer", tokenizer, "--seq-length", "64",
                "--output", str(root / "packed")]) == 0
    return root / "packed"


def test_resume_on_other_data_is_refused_and_a_listed_change_resumes(start, pretrain_cli, straight, tmp_path):
    """`nemo-anchor train`'s resume comparison on Bridge's resume: other data refused naming data.path, a new
    clip_grad naming optim.clip_grad, then allowed by --allow-change (it resumes to step 7); a new lr stays refused
    with the Megatron-Core limitation named, even when listed."""
    root, megatron, config = start
    save = straight[0]
    metrics = (save / "metrics.jsonl").read_text()
    other = pack_texts(tmp_path / "other", [text[::-1] for text in TEXTS])
    status, out = bridge_run(pretrain_cli, config, megatron, save, f"dataset.path={other}", "train.train_iters=7")
    assert status != 0 and f"data.path={other} is not the packed dataset it was trained on" in out, out[-3000:]
    status, out = bridge_run(pretrain_cli, config, megatron, save, "optimizer.clip_grad=0.5", "train.train_iters=7")
    assert status != 0 and "optim.clip_grad was 1.0, the new config has 0.5" in out, out[-3000:]
    status, out = bridge_run(pretrain_cli, config, megatron, save, "optimizer.lr=5e-4", "train.train_iters=7",
                             "--allow-change", "optim.lr")
    assert status != 0 and "optim.lr=0.0005 (was 0.001): Megatron-Core's optimizer" in out, out[-3000:]
    assert (save / "metrics.jsonl").read_text() == metrics
    status, out = bridge_run(pretrain_cli, config, megatron, save, "optimizer.clip_grad=0.5", "train.train_iters=7",
                             "--allow-change", "optim.clip_grad")
    assert status == 0, out[-3000:]
    rows = {r["step"]: r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert sorted(rows) == list(range(1, 8))


def test_data_of_another_tokenizer_is_refused_before_the_first_step(start, pretrain_cli, smollm2_dir, tmp_path):
    root, megatron, config = start
    other = pack_texts(tmp_path / "smollm2", TEXTS, tokenizer=str(smollm2_dir))
    status, out = bridge_run(pretrain_cli, config, megatron, tmp_path / "run", f"dataset.path={other}")
    assert status != 0 and f"dataset.path={other} was tokenized with" in out, out[-3000:]
    assert f"checkpoint.pretrained_checkpoint={megatron}" in out and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_second_run_into_the_same_checkpoint_save_is_refused(start, pretrain_cli, tmp_path):
    """While a run holds checkpoint.save (its lock, as nemo-anchor train's), another run is refused naming its
    host and pid, before writing anything there."""
    from nemo_anchor.run_dir import RunDir
    from nemo_anchor.run_lease import RunClaim

    root, megatron, config = start
    save = tmp_path / "held"
    holder = RunClaim(RunDir(save))  # what a live run holds, in this process
    try:
        status, out = bridge_run(pretrain_cli, config, megatron, save)
    finally:
        holder.release(failed=False)
    assert status != 0 and f"is in use by another training run (host {os.uname().nodename}, pid {os.getpid()}" in out
    assert sorted(p.name for p in save.iterdir()) == []


def test_group_sigterm_after_earlier_saves_saves_the_step_reached_and_exits_75(start, pretrain_cli, tmp_path):
    """Bridge's exit signal as Slurm and torchrun deliver it, to the whole process group, after scheduled saves:
    the run saves the step it reached and exits 75, as nemo-anchor train does."""
    import signal
    import time

    root, megatron, config = start
    save = tmp_path / "run"
    run = pretrain_cli.start(["--config", str(config), f"checkpoint.pretrained_checkpoint={megatron}",
                              f"checkpoint.save={save}", f"checkpoint.load={save}", "checkpoint.save_interval=2",
                              "train.train_iters=400", "--peak-tflops", "1"], merge_output=True)  # its own session
    metrics = save / "metrics.jsonl"

    def steps():
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        return [json.loads(row)["step"] for row in rows if '"loss"' in row]

    deadline = time.monotonic() + 400
    while len(steps()) < 5 and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert run.poll() is None and len(steps()) >= 5, run.communicate()[0][-3000:] if run.poll() is not None else "slow"
    os.killpg(run.pid, signal.SIGTERM)
    out = run.communicate(timeout=300)[0]
    assert run.returncode == 75, out[-3000:]
    latest = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert latest == max(steps()) >= 5 and (save / f"iter_{latest:07d}").is_dir(), (latest, steps())
    assert out.splitlines()[-1].startswith(f"stop requested (SIGTERM): saved {save / f'iter_{latest:07d}'} at step"), \
        out[-3000:]
