"""The training-step FLOP count: a hand count on a tiny model, and the kept pairs against the oracle's dense mask."""
import random

import pytest
import torch

from nemo_anchor.attention.layout import MODES, pack_layout, query_blocks
from nemo_anchor.attention.reference import dense_mask
from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.flops import train_step_flops


def _random_layout(rng: random.Random, total: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, total), rng.randint(0, min(12, total - 1))))
    return (0, *cuts, total)


@pytest.mark.parametrize("mode", MODES)
def test_kept_pairs_match_the_dense_mask(mode):
    rng = random.Random(0)
    for _ in range(25):
        total = rng.randint(1, 90)
        bounds = _random_layout(rng, total)
        mask = dense_mask(query_blocks(bounds, (0, total), mode, 0, total), 0, total, torch.device("cpu"))
        assert pack_layout(torch.tensor(bounds, dtype=torch.int32)).kept_pairs(mode) == int(mask.sum())


def _tiny(**overrides):
    return ModelConfig(num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2, num_query_groups=1,
                       head_dim=4, seq_length=5, **overrides)


def test_hand_count_on_a_tiny_model():
    # one window of 5 tokens: documents [0, 3) and [3, 5); vocabulary 10
    window = torch.tensor([0, 3, 5], dtype=torch.int32)
    # anchor pairs: document 1 causal 1+2+3; document 2 causal 1+2 plus the anchor for each of its 2 queries
    pairs = {"full": 15, "intra_doc": 9, "anchor": 11}
    tokens, h, d, hq, hkv, f, vocab = 5, 8, 4, 2, 1, 12, 10
    qkv = 2 * h * (hq * d + 2 * hkv * d)  # 2*8*(8+8) = 256 per token
    out = 2 * hq * d * h  # 128
    mlp = 2 * h * f * 3  # 576
    logits = 2 * h * vocab  # 160
    for kind, mode in (("full", "full"), ("intra_doc", "intra_doc"), ("intra_doc_reset", "intra_doc"),
                       ("anchor", "anchor")):
        layer = tokens * (qkv + out + mlp) + pairs[mode] * 4 * hq * d
        expected = 3 * (2 * layer + tokens * logits)
        assert train_step_flops(_tiny(attention_type=kind), vocab, [window]) == (expected, expected)
        assert pack_layout(window).kept_pairs(mode) == pairs[mode]
    # two windows count twice
    base = train_step_flops(_tiny(), vocab, [window]).model
    assert train_step_flops(_tiny(), vocab, [window, window]) == (2 * base, 2 * base)
    # recomputation is hardware work, not model work: model FLOPs (MFU) stay, hardware FLOPs (HFU) add the
    # recomputed forward
    layer = tokens * (qkv + out + mlp) + pairs["anchor"] * 4 * hq * d
    assert train_step_flops(_tiny(recompute="full"), vocab, [window]) == (base, base + 2 * layer)
    assert train_step_flops(_tiny(recompute="full", recompute_num_layers=1), vocab, [window]) == (base, base + layer)
    core = pairs["anchor"] * 4 * hq * d
    assert train_step_flops(_tiny(recompute="selective"), vocab, [window]) == (base, base + 2 * core)
