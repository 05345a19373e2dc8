"""A window of a million tokens (2^20): `nemo-anchor pack` writes it, and one training step on it in one process
equals the step on two context-parallel ranks.

The corpus is about a thousand short documents (the byte tokenizer: one token a byte) that fill one window, so that
anchor attention, which keeps to documents, stays cheap while every length on the way is a million-token run's: the
window, its int32 cu_seqlens, the RoPE positions, the context-parallel chunks of 2^18 tokens. Run as a script, this
file is the training: the step on two gloo ranks forked by torch's elastic agent (tests/forked_ranks.py), then the
same step in one process; each writes its loss, gradients and updated weights.
"""
import json
import math
import random
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_anchor.checksums import verify_digests
from nemo_anchor.cli import main as cli
from nemo_anchor.data import PackedDataset
from nemo_anchor.data.layout import read_metadata
from tiny_runs import child_environment, tiny_config  # tests/tiny_runs.py

T = 1 << 20
BOS, EOS, PAD = 256, 257, 258  # the byte tokenizer's specials
# one attention head (half the CPU of two); without the distributed optimizer every rank holds every gradient (with
# it, only those of the parameters whose update it owns)
STEP_OVERRIDES = ["model.attention_type=anchor", "model.num_attention_heads=1", "model.num_query_groups=1",
                  "trainer.distributed_optimizer=false", "trainer.max_steps=1", "trainer.peak_tflops=1"]
CP2 = ["model.context_parallel_size=2", "model.cp_comm_type=all_gather"]  # a2a would split the heads


def _documents() -> list[str]:
    """Seeded ASCII texts of 500 to 1,500 bytes, as many as one window holds with the anchor and their EOS."""
    rng = random.Random(0)
    documents, body = [], 0
    while True:
        text = "".join(rng.choices("abcdefghij klmnop\n", k=rng.randint(500, 1500)))
        if body + len(text) + 1 > T - 1:
            return documents
        documents.append(text)
        body += len(text) + 1


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("million")
    documents = _documents()
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    assert cli(["pack", "--input", str(corpus), "--tokenizer", "byte", "--seq-length", str(T),
                "--output", str(root / "packed")]) == 0
    return root / "packed", documents


def test_pack_writes_a_million_token_window(packed):
    """The window, its segments and loss mask as the README specifies them; its digest as metadata.json records it."""
    path, documents = packed
    ds = PackedDataset(path)
    assert (len(ds), ds.seq_length) == (1, T)
    item = ds[0]
    body = np.concatenate([np.append(np.frombuffer(text.encode(), np.uint8), EOS) for text in documents])
    tokens = np.full(T, PAD)
    tokens[0], tokens[1:1 + len(body)] = BOS, body
    ends = 1 + np.cumsum([len(text) + 1 for text in documents])  # the anchor opens the first document's segment
    cu_seqlens = np.concatenate([[0], ends, [T]])  # the padding is a segment of its own
    loss_mask = np.ones(T, np.float32)
    loss_mask[len(body):] = 0  # labels of padding
    loss_mask[cu_seqlens[1:] - 1] = 0  # predictions across a segment's end
    assert T - 1 - len(body) < 1500  # one window, nearly full
    assert np.array_equal(item["tokens"].numpy(), tokens)
    assert item["cu_seqlens"].dtype == torch.int32 and np.array_equal(item["cu_seqlens"].numpy(), cu_seqlens)
    assert np.array_equal(item["loss_mask"].numpy(), loss_mask)
    assert torch.equal(item["position_ids"], torch.arange(T))
    assert verify_digests(path, read_metadata(path)["checksums"]) == {}


def _tolerance() -> float:
    """Relative to a tensor's largest entry. Each gradient is a sum over the window's T tokens, which the two ranks
    add in another order (each its half, then the all-reduce): a pairwise sum of T fp32 terms rounds each term at
    most log2(T) times. A step chains a few such sums (the loss, the backward through the norms, attention and
    the embedding): 8 of them bound it."""
    return 8 * math.log2(T) * torch.finfo(torch.float32).eps


def test_one_step_on_two_context_parallel_ranks_equals_one_process(packed, tmp_path):
    path, _ = packed
    config = tiny_config(tmp_path / "run", path, max_steps=1, seq_length=T)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, __file__, str(config), str(tmp_path)], capture_output=True, text=True,
                          timeout=900, env=child_environment())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr[-5000:]
    print(f"one step of {T} tokens, in one process and on 2 ranks: "
          f"{after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime:.1f} CPU s")
    single, parallel = (torch.load(tmp_path / f"{name}.pt") for name in ("single", "cp2"))
    tolerance = _tolerance()
    assert single["record"]["loss_tokens"] == parallel["record"]["loss_tokens"] > T - 2000
    assert parallel["record"]["loss"] == pytest.approx(single["record"]["loss"], rel=tolerance)
    assert parallel["record"]["grad_norm"] == pytest.approx(single["record"]["grad_norm"], rel=tolerance)
    for kind in ("grads", "weights"):
        assert single[kind].keys() == parallel[kind].keys()
        for name, expected in single[kind].items():
            difference = (parallel[kind][name] - expected).abs().max().item()
            assert difference <= tolerance * expected.abs().max().item(), (kind, name, difference)


# ---------------------------------------------------------------- the training (run as a script)
def _step(config: str, output_dir: str, overrides: list[str], result: str) -> None:
    """One trainer step; the main rank saves its record, gradients and updated weights (full on every rank)."""
    from nemo_anchor.training.config import load_config
    from nemo_anchor.training.loop import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(load_config(config, [f"output_dir={output_dir}", *overrides]))
    try:
        record = trainer.train_step()
        if trainer.ctx.is_main:
            parameters = dict(trainer.engine.gpt.named_parameters())
            torch.save({"record": {key: record[key] for key in ("loss", "grad_norm", "loss_tokens")},
                        "grads": {name: p.main_grad.clone() for name, p in parameters.items()},
                        "weights": {name: p.detach().clone() for name, p in parameters.items()}}, result)
    finally:
        trainer.saver.close()
        trainer._release(failed=False)


if __name__ == "__main__":
    from forked_ranks import run_ranks  # this file's folder is first on the path

    import nemo_anchor.training.loop  # noqa: F401  (imported once, before the ranks are forked)

    config, out = sys.argv[1], Path(sys.argv[2])
    run_ranks(2, _step, config, str(out / "cp2"), STEP_OVERRIDES + CP2, str(out / "cp2.pt"))
    _step(config, str(out / "single"), STEP_OVERRIDES, str(out / "single.pt"))
