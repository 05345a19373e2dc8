"""RoPE positions travel in the packed-sequence parameters and are applied through the layer spec.

No Megatron function is replaced in the process; a copy of the parameters' tensors keeps the positions;
the rotated queries and keys equal transformers' Llama RoPE in float64 with the same position ids,
unpacked and packed, in fp32 and with ``rope_in_fp32``; and on the fused path Megatron's THD kernel gets
boundaries that give the same positions.
"""
import dataclasses

import numpy as np
import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_apply_rotary_pos_emb

from nemo_anchor.model.config import ModelConfig
from nemo_anchor.model.gpt import build_gpt_model, packed_forward
from nemo_anchor.model.packed_seq import make_packed_seq_params
from nemo_anchor.model.rope import AnchorSelfAttention, rotate, token_freqs
from nemo_anchor.parallel.context_parallel import shard_plan
from nemo_anchor.parallel.distributed import initialize_parallel

VOCAB = 97
T = 32
DOCS = [0, 5, 20, 32, 33, 50, 64]  # two windows of 32; the second starts a document at 33
HEAD_DIM = 16


@pytest.fixture(scope="module", autouse=True)
def parallel():
    return initialize_parallel()


def _cfg(**kw):
    return ModelConfig(**{**dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                 num_query_groups=2, seq_length=T, attention_backend="cpu"), **kw})


def _model(cfg):
    torch.manual_seed(0)
    return build_gpt_model(cfg, VOCAB)


def _batch():
    g = torch.Generator().manual_seed(1)
    return dict(tokens=torch.randint(0, VOCAB, (2, T), generator=g), labels=torch.randint(0, VOCAB, (2, T), generator=g),
                position_ids=torch.arange(T).repeat(2, 1), loss_mask=torch.ones(2, T),
                cu_seqlens=torch.tensor(DOCS, dtype=torch.int32), cu_windows=torch.tensor([0, T, 2 * T], dtype=torch.int32))


def _hf_positions(bounds) -> torch.Tensor:
    """Position ids restarting at every boundary, as a Llama user would pass them."""
    return torch.cat([torch.arange(end - start) for start, end in zip(bounds[:-1], bounds[1:])])


def _hf_rope(q, k, positions, cfg):
    """transformers' Llama RoPE in float64: q, k ``[t, h, d]`` rotated at ``positions``."""
    config = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_query_groups, head_dim=HEAD_DIM,
                         rope_theta=cfg.resolved_rotary_base(), max_position_embeddings=4 * T)
    inv_freq = LlamaRotaryEmbedding(config).inv_freq.double()
    angles = positions.double()[:, None] * inv_freq[None]
    emb = torch.cat([angles, angles], dim=-1)[None]  # [1, t, d], as LlamaRotaryEmbedding returns it
    rotated = hf_apply_rotary_pos_emb(q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                      emb.cos(), emb.sin())
    return [x[0].transpose(0, 1) for x in rotated]


def _capture_rotation(model):
    """Each layer's (q, k) before RoPE and (q, k) as its core attention receives them, in THD ``[t, h, d]``."""
    before, after = [], []

    def tokens(x):  # sbhd [s, b, h, d] (THD: b = 1) -> [b*s, h, d]; THD [t, h, d] as it is
        return x.detach().transpose(0, 1).flatten(0, 1) if x.dim() == 4 else x.detach()

    def attention_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            q, k, _ = module.get_query_key_value_tensors(hidden)
        before.append((tokens(q), tokens(k)))

    def core_input(module, args, kwargs):
        after.append((tokens(args[0]), tokens(args[1])))

    for layer in model.decoder.layers:
        layer.self_attention.register_forward_pre_hook(attention_input, with_kwargs=True)
        layer.self_attention.core_attention.register_forward_pre_hook(core_input, with_kwargs=True)
    return before, after


def test_no_megatron_function_is_replaced():
    """Building and training a model leaves Megatron's modules as they are: the layers are Megatron's
    SelfAttention subclassed in the spec."""
    originals = {name: getattr(attention, name) for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_with_cos_sin")}
    model = _model(_cfg(rope_in_fp32=True))
    packed_forward(model, _batch()).sum().backward()
    assert attention.apply_rotary_pos_emb is rope_utils.apply_rotary_pos_emb
    assert {name: getattr(attention, name) for name in originals} == originals
    assert all(type(layer.self_attention) is AnchorSelfAttention for layer in model.decoder.layers)


@pytest.mark.parametrize("copy", ["clone", "to"])
def test_a_copy_of_the_parameters_keeps_the_positions(monkeypatch, copy):
    """Cloning or moving the parameters' tensors keeps every token's position: the forward and backward
    still read nothing back from the device and compute the same loss."""
    model = _model(_cfg())
    batch = _batch()
    params = make_packed_seq_params(batch["cu_seqlens"], batch["cu_windows"], "anchor")
    inputs = dict(input_ids=batch["tokens"].reshape(1, -1), position_ids=batch["position_ids"].reshape(1, -1),
                  attention_mask=None, labels=batch["labels"].reshape(1, -1))
    expected = model(**inputs, packed_seq_params=params)
    move = (lambda x: x.clone()) if copy == "clone" else (lambda x: x.to(torch.int64).to(x.dtype))
    copied = dataclasses.replace(params, **{f.name: move(getattr(params, f.name)) for f in dataclasses.fields(params)
                                            if isinstance(getattr(params, f.name), torch.Tensor)})

    def host_sync(self, *args, **kwargs):
        raise AssertionError("a device-to-host read in the forward step")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "item", host_sync)
        patch.setattr(torch.Tensor, "tolist", host_sync)
        loss = model(**inputs, packed_seq_params=copied)
        loss.sum().backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


@pytest.mark.parametrize("attention_type", ["anchor", "intra_doc_reset"])
def test_packed_rotation_equals_transformers_llama_in_float64(attention_type):
    """Inside the model, each layer's q and k reach the core attention rotated as transformers' Llama
    rotates them with position ids restarting at every window (``anchor``) or document (``intra_doc_reset``)."""
    cfg = _cfg(attention_type=attention_type)
    model = _model(cfg)
    batch = _batch()
    before, after = _capture_rotation(model)
    packed_forward(model, batch)
    bounds = DOCS if attention_type == "intra_doc_reset" else [0, T, 2 * T]
    positions = _hf_positions(bounds)
    assert len(after) == cfg.num_layers
    for (q, k), (q_rotated, k_rotated) in zip(before, after):
        q_ref, k_ref = _hf_rope(q, k, positions, cfg)
        torch.testing.assert_close(q_rotated.double(), q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_rotated.double(), k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_rope_in_fp32_rounds_once_against_float64(packed):
    """bf16 with ``rope_in_fp32``: every rotated element is the float64 rotation of the bf16 q/k rounded
    once (within half a bf16 unit in the last place), packed (THD) and unpacked (sbhd) alike."""
    cfg = _cfg(rope_in_fp32=True)
    model = _model(cfg).bfloat16()
    batch = _batch()
    before, after = _capture_rotation(model)
    if packed:
        packed_forward(model, batch)
    else:
        model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
              labels=batch["labels"])
    positions = _hf_positions([0, T, 2 * T])
    for (q, k), rotated in zip(before, after):
        for exact, ours in zip(_hf_rope(q, k, positions, cfg), rotated):
            assert ours.dtype == torch.bfloat16
            error = (ours.double() - exact).abs()
            assert (error <= exact.abs() * 2.0 ** -8 * (1 + 1e-6)).all(), error.max()


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_positions_equal_transformers_llama(cp):
    """Each context-parallel rank's tokens (chunks r and 2cp-1-r of every window) rotate by their
    positions in the whole window, as transformers' Llama rotates the unsharded pack."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cfg = _cfg(seq_length=2 * T)
    model = _model(cfg)
    docs = torch.tensor([0, 10, 32, 40, 64], dtype=torch.int32)
    windows = torch.tensor([0, 32, 64], dtype=torch.int32)
    torch.manual_seed(2)
    q, k = torch.randn(64, 4, HEAD_DIM), torch.randn(64, 2, HEAD_DIM)
    q_ref, k_ref = _hf_rope(q, k, _hf_positions(windows.tolist()), cfg)
    table = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0, rotary_base=cfg.resolved_rotary_base(),
                            use_cpu_initialization=True)
    for rank in range(cp):
        group = _Group(cp, rank)
        plan = shard_plan(docs, windows, cp, rank, "anchor")
        params = make_packed_seq_params(plan.cu_seqlens, plan.cu_windows, "anchor", group)
        freqs = token_freqs(table(params.max_seqlen_q, packed_seq=True), params, group)
        for x, ref in ((q, q_ref), (k, k_ref)):
            ours = rotate(x[plan.index].unsqueeze(1), freqs, model.config, cp_group=group).squeeze(1)
            torch.testing.assert_close(ours.double(), ref[plan.index], rtol=1e-5, atol=1e-5)


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_fused_rope_gets_boundaries_that_give_the_same_positions(monkeypatch):
    """With ``apply_rope_fusion`` the layers leave RoPE to Megatron, whose fused THD kernel takes
    ``cu_seqlens_q`` and the table sized by ``max_seqlen_q``. Stood in by Megatron's own baseline THD RoPE
    (the semantics TE's kernel implements: positions restart at every segment), the model computes what
    the per-token path computes, for windows and for documents as RoPE segments."""
    calls = []

    def fused_thd_stand_in(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
        calls.append(cu_seqlens)
        return rope_utils._apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=interleaved,
                                                    cp_group=_Group(cp_size, cp_rank))

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", fused_thd_stand_in)
    for attention_type in ("anchor", "intra_doc_reset"):
        model = _model(_cfg(attention_type=attention_type))
        batch = _batch()
        per_token = packed_forward(model, batch)
        assert not calls
        model.config.apply_rope_fusion = True
        fused = packed_forward(model, batch)
        assert len(calls) == 2 * model.config.num_layers  # q and k of every layer
        torch.testing.assert_close(fused, per_token, rtol=1e-6, atol=1e-6)
        calls.clear()


def test_rope_positions_count_chunks_r_and_2cp_minus_1_minus_r():
    from nemo_anchor.model.rope import rope_positions

    assert rope_positions((0, 8, 16), 2, 0).tolist() == [0, 1, 6, 7, 0, 1, 6, 7]
    assert rope_positions((0, 8, 16), 2, 1).tolist() == [2, 3, 4, 5, 2, 3, 4, 5]
    assert np.array_equal(rope_positions((0, 3, 7)), [0, 1, 2, 0, 1, 2, 3])
