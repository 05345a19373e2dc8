"""The BF16 RoPE probe: Eq. 4 / Eq. 5 against direct computations, fp32 vs bf16 on a trained model, the CLI."""
import inspect
import json
import string
import textwrap

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nemo_anchor.analysis.probe import random_init_copy, same_weights_in
from nemo_anchor.analysis import shift_metrics
from nemo_anchor.analysis.shift_metrics import check_supported, fp32_score_attention, shift_differences
from nemo_anchor.cli import main
from nemo_anchor.evaluation.models import load_model

TEXT = inspect.getsource(textwrap) + inspect.getsource(string)


def byte_tokenizer():
    """Byte-level BPE without merges: one token per byte, plus BOS/EOS."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, **{symbol: index + 2 for index, symbol in enumerate(sorted(alphabet))}}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def tiny_config(vocab_size, **overrides):
    settings = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
    )
    return LlamaConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def trained_model_dir(tmp_path_factory):
    """A tiny Llama trained for a few dozen steps on stdlib source, saved with its tokenizer."""
    tokenizer = byte_tokenizer()
    tokens = torch.tensor(tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(len(tokenizer)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        starts = torch.randint(0, tokens.numel() - 65, (8,))
        batch = torch.stack([tokens[start : start + 64] for start in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 3.5  # it learned something (uniform over the vocab is 5.6)
    directory = tmp_path_factory.mktemp("trained_llama")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sequence(trained_model_dir):
    tokenizer = byte_tokenizer()
    return torch.tensor([tokenizer.bos_token_id, *tokenizer(TEXT[:255], add_special_tokens=False)["input_ids"]])


def test_bf16_breaks_the_shift_invariance_that_fp32_keeps(trained_model_dir, sequence):
    shifts = [0, 16, 200, 2000]
    fp32 = shift_differences(load_model(trained_model_dir, dtype=torch.float32)[0], sequence, shifts, 16)
    bf16 = shift_differences(load_model(trained_model_dir, dtype=torch.bfloat16)[0], sequence, shifts, 16)
    for measured in (fp32, bf16):  # Δ1 == Δ2: the same computation, so exactly zero
        assert measured.D()[1] == 0 and measured.first_key_logits[1].abs().max() == 0
    assert (bf16.D()[[0, 2, 3]] > 0).all()
    assert (fp32.D()[[0, 2, 3]] * 100 <= bf16.D()[[0, 2, 3]]).all()
    assert (fp32.D_logit(256)[[0, 2, 3]] * 100 <= bf16.D_logit(256)[[0, 2, 3]]).all()


def one_layer_model(tmp_path):
    config = tiny_config(64, hidden_size=32, num_hidden_layers=1, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    return LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()


def test_eq4_matches_a_direct_computation_from_eager_attention(tmp_path):
    """Huge shifts make fp32's own RoPE rounding large enough to compare with HF's eager probabilities."""
    model = one_layer_model(tmp_path)
    length, reference = 40, 16
    ids = torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(2))
    shifts = [1_000_000, 10_000_000]  # fp32 angles at these positions are off by up to 0.06 and 1 radian

    def eager_attention(shift):  # [heads, T, T] float64, separate forward per shift
        with torch.no_grad():
            output = model(ids[None], position_ids=torch.arange(length)[None] + shift, output_attentions=True)
        return output.attentions[0][0].double()

    measured = shift_differences(model, ids, shifts, reference)
    expected_reference = eager_attention(reference)
    for row, shift in enumerate(shifts):
        attention = eager_attention(shift)
        per_key = torch.zeros(length, dtype=torch.float64)
        for j in range(length):  # Eq. 4 term by term: n_j = 1 / (number of queries seeing key j)
            per_key[j] = (attention[:, j:, j] - expected_reference[:, j:, j]).abs().sum() / (length - j)
        assert measured.attention[row] == pytest.approx(per_key, rel=1e-3, abs=1e-9)
        assert measured.D()[row].item() == pytest.approx(per_key.sum().item(), rel=1e-4)
    assert (measured.D() > 1e-3).all()  # the comparison is made on large differences, not on rounding noise


def test_eq5_matches_first_key_logits_from_the_model_modules(tmp_path):
    model = one_layer_model(tmp_path)
    length = 24
    ids = torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(3))
    attention = model.model.layers[0].self_attn

    def first_key_logits(shift):  # [heads, T]: q_i·k_0 * scaling, straight from the layer's modules
        with torch.no_grad():
            hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[None]))
            cos, sin = model.model.rotary_emb(hidden, torch.arange(length)[None] + shift)
            query = attention.q_proj(hidden).view(1, length, -1, attention.head_dim).transpose(1, 2)
            key = attention.k_proj(hidden).view(1, length, -1, attention.head_dim).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            key = key.repeat_interleave(attention.num_key_value_groups, dim=1)
        return (query[0] @ key[0, :, 0, :, None])[..., 0].double() * attention.scaling

    difference = (first_key_logits(10_000_000) - first_key_logits(16)).abs().sum(dim=0)  # Σ_h, per query
    measured = shift_differences(model, ids, [10_000_000], 16, attention=False)
    assert measured.attention is None
    assert difference[1:].min() > 1e-3  # far above rounding noise (query 0 sees key 0 at distance 0: noise only)
    for prefix in (8, length):
        assert measured.D_logit(prefix)[0].item() == pytest.approx(difference[:prefix].sum().item() / prefix, rel=1e-4)


@pytest.mark.parametrize("window", [None, 7])
def test_fp32_score_attention_matches_sdpa(window, monkeypatch):
    monkeypatch.setitem(shift_metrics._QUERY_BLOCK, "cpu", 16)  # several query blocks
    monkeypatch.setitem(shift_metrics._BLOCK_ELEMENTS, "cpu", 2 * 16 * 50 * 4)  # and several head blocks
    generator = torch.Generator().manual_seed(4)
    query, key, value = (torch.randn(2, heads, 50, 8, generator=generator) for heads in (6, 2, 2))
    offset = torch.arange(50)[:, None] - torch.arange(50)
    visible = (offset >= 0) & ((offset < window) if window else True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1), attn_mask=visible
    )
    result = fp32_score_attention(query, key, value, 8**-0.5, window)
    assert torch.allclose(result, expected.transpose(1, 2), atol=1e-5)


def test_random_copy_is_seeded_kaiming_and_leaves_the_global_rng_alone():
    config = tiny_config(64)
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    first = random_init_copy(config, dtype=torch.bfloat16, seed=9)
    assert torch.rand(1) == before
    second = random_init_copy(config, dtype=torch.bfloat16, seed=9)
    weight = first.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, second.model.layers[0].mlp.down_proj.weight)
    bound = config.intermediate_size**-0.5  # kaiming_uniform_(a=sqrt(5)) draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert 0.9 * bound < weight.float().abs().max() <= bound * 1.01
    assert first.model.rotary_emb.inv_freq.dtype == torch.float32


def test_bf16_copy_is_what_a_bf16_load_gives(trained_model_dir):
    copy = same_weights_in(load_model(trained_model_dir, dtype=torch.float32)[0], torch.bfloat16)
    loaded, _ = load_model(trained_model_dir, dtype=torch.bfloat16)
    assert copy.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(copy.state_dict()[name], tensor) for name, tensor in loaded.state_dict().items())
    assert copy.model.rotary_emb.inv_freq.dtype == loaded.model.rotary_emb.inv_freq.dtype == torch.float32


def test_rope_scaled_by_batch_positions_is_refused():
    model = LlamaForCausalLM(tiny_config(64, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match="dynamic"):
        check_supported(model)


def test_probe_command_writes_figure1_data(trained_model_dir, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "probe"
    code = main([
        "probe", "--hf", str(trained_model_dir), "--output", str(out), "--data", str(text),
        "--num-sequences", "2", "--sequence-length", "48", "--shifts", "0", "8", "16", "100",
        "--lengths", "16", "32", "64", "128", "--max-length", "64",
    ])
    assert code == 0
    results = json.loads((out / "probe.json").read_text())
    assert set(results) == {"bf16", "fp32", "random_bf16"}
    for measured in results.values():
        assert list(measured["D"]) == ["0", "8", "16", "100"] and measured["D"]["16"] == 0
        assert len(measured["per_token"]) == 48
        assert sum(measured["per_token"]) == pytest.approx(measured["D"]["0"])
        assert list(measured["D_logit"]) == ["16", "32", "64"]  # 128 is above --max-length
    assert results["fp32"]["D"]["100"] * 100 < results["bf16"]["D"]["100"]
    assert results["random_bf16"]["D"] != results["bf16"]["D"]
    assert (out / "figure1.png").read_bytes().startswith(b"\x89PNG")
    assert json.loads((out / "probe_settings.json").read_text())["logit_lengths"] == [16, 32, 64]
