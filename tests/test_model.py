"""AnchorCoreAttention inside a Megatron-Core GPTModel on the CPU."""
import copy

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from nemo_anchor.model.config import ModelConfig, paper_rotary_base
from nemo_anchor.model.core_attention import AnchorCoreAttention
from nemo_anchor.model.gpt import build_gpt_model, packed_forward, transformer_config
from nemo_anchor.model.packed_seq import make_packed_seq_params
from nemo_anchor.model.spec import get_layer_spec
from nemo_anchor.parallel.distributed import initialize_parallel

VOCAB = 97


@pytest.fixture(scope="module", autouse=True)
def parallel():
    return initialize_parallel()


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                seq_length=32, attention_backend="cpu")
    base.update(kw)
    return ModelConfig(**base)


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    return build_gpt_model(cfg, VOCAB)


def _batch(cu_seqlens, windows=1, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (windows, T), generator=g)
    return dict(tokens=tokens, labels=torch.randint(0, VOCAB, (windows, T), generator=g),
                position_ids=torch.arange(T).repeat(windows, 1), loss_mask=torch.ones(windows, T),
                cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
                cu_windows=torch.arange(0, (windows + 1) * T, T, dtype=torch.int32))


def test_spec_swaps_only_core_attention():
    spec = get_layer_spec("anchor", use_transformer_engine=False)
    reference = get_gpt_layer_local_spec(normalization="RMSNorm")
    attn = spec.submodules.self_attention.submodules
    assert attn.core_attention.module is AnchorCoreAttention
    assert attn.core_attention.params == {"mask": "anchor", "backend": "auto"}
    assert attn.linear_qkv is reference.submodules.self_attention.submodules.linear_qkv
    assert reference.submodules.self_attention.submodules.core_attention is not AnchorCoreAttention


def test_full_matches_megatron_dot_product_attention():
    """Unpacked (sbhd) input: our module reproduces Megatron's own DotProductAttention."""
    cfg = _cfg(attention_type="full")
    ours = _model(cfg)
    torch.manual_seed(0)
    megatron = GPTModel(config=transformer_config(cfg), transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=VOCAB, max_sequence_length=32, position_embedding_type="rope",
        rotary_base=cfg.resolved_rotary_base(), share_embeddings_and_output_weights=False)
    megatron.load_state_dict(ours.state_dict(), strict=False)
    batch = _batch([0, 32], windows=3)
    causal = torch.triu(torch.ones(32, 32, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    inputs = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=causal,
                  labels=batch["labels"])
    loss_ours = ours(**inputs).mean()
    loss_megatron = megatron(**inputs).mean()
    assert abs(loss_ours.item() - loss_megatron.item()) < 1e-5
    loss_ours.backward()
    loss_megatron.backward()
    for (name, p), q in zip(ours.named_parameters(), megatron.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_single_window_equals_unpacked():
    cfg = _cfg(attention_type="anchor")
    model = _model(cfg)
    batch = _batch([0, 32], windows=2, T=32)
    batch["cu_seqlens"] = torch.tensor([0, 32, 64], dtype=torch.int32)
    packed = packed_forward(model, batch)
    unpacked = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                     labels=batch["labels"])
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=1e-5)


def _models(*attention_types):
    """Models that differ only in attention_type (same seed, same weights)."""
    return {kind: _model(_cfg(attention_type=kind)) for kind in attention_types}


KINDS = ("full", "intra_doc", "intra_doc_reset", "anchor")


def test_every_attention_type_equals_full_on_one_document():
    models = _models(*KINDS)
    one_doc = _batch([0, 32])
    full = packed_forward(models["full"], one_doc)
    for kind in KINDS[1:]:
        torch.testing.assert_close(packed_forward(models[kind], one_doc), full, msg=kind)


def test_attention_types_differ_on_two_documents_after_the_first():
    models = _models(*KINDS)
    two_docs = _batch([0, 12, 32])
    out = {kind: packed_forward(model, two_docs) for kind, model in models.items()}
    for kind in KINDS[1:]:  # the first document sees nothing else under any mask
        torch.testing.assert_close(out[kind][:, :12], out["full"][:, :12], msg=kind)
    for a, b in [("anchor", "full"), ("anchor", "intra_doc"), ("anchor", "intra_doc_reset"), ("intra_doc", "full")]:
        assert (out[a][:, 12:] - out[b][:, 12:]).abs().max() > 1e-3, (a, b)


def test_anchor_second_document_sees_only_anchor_and_itself():
    """Changing the first document's body (not its anchor) leaves the second document unchanged."""
    model = _model(_cfg())
    batch = _batch([0, 12, 32])
    before = packed_forward(model, batch)
    batch["tokens"][:, 1:12] = (batch["tokens"][:, 1:12] + 5) % VOCAB
    after = packed_forward(model, batch)
    torch.testing.assert_close(after[:, 12:], before[:, 12:])
    batch["tokens"][:, 0] = (batch["tokens"][:, 0] + 5) % VOCAB  # the anchor
    assert (packed_forward(model, batch)[:, 12:] - before[:, 12:]).abs().max() > 1e-4


@pytest.mark.parametrize("attention_type,restarts", [("anchor", "window"), ("full", "window"),
                                                     ("intra_doc", "window"), ("intra_doc_reset", "document")])
def test_megatron_rope_sees_window_or_document_positions(attention_type, restarts):
    """Megatron's THD RoPE with our params rotates by the positions the attention type promises."""
    cfg = _cfg(attention_type=attention_type)
    model = _model(cfg)
    T, windows = 32, 2
    cu_seqlens = torch.tensor([0, 5, 20, 32, 33, 64], dtype=torch.int32)
    cu_windows = torch.tensor([0, 32, 64], dtype=torch.int32)
    params = make_packed_seq_params(cu_seqlens, cu_windows, attention_type)
    freqs = model.rotary_pos_emb(max(params.max_seqlen_q, params.max_seqlen_kv), packed_seq=True)
    x = torch.randn(windows * T, 4, 16)
    rotated = apply_rotary_pos_emb(x, freqs, model.config, cu_seqlens=params.cu_seqlens_q)

    bounds = cu_seqlens if restarts == "document" else cu_windows
    positions = torch.cat([torch.arange(int(e - s)) for s, e in zip(bounds[:-1], bounds[1:])])
    inv_freq = 1.0 / (cfg.resolved_rotary_base() ** (torch.arange(0, 16, 2).float() / 16))
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotate_half = torch.cat([-x[..., 8:], x[..., :8]], -1)
    torch.testing.assert_close(rotated, x * cos + rotate_half * sin, atol=1e-5, rtol=1e-5)


def test_selective_recompute_gives_same_loss_and_gradients():
    batch = _batch([0, 7, 20, 32])
    grads = []
    for recompute in ("none", "selective"):
        model = _model(_cfg(recompute=recompute))
        loss = packed_forward(model, batch).mean()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b)


def test_bf16_model_trains_through_anchor_attention():
    fp32 = _model(_cfg())
    bf16 = _model(_cfg()).bfloat16()
    batch = _batch([0, 9, 32])
    loss32 = packed_forward(fp32, batch).mean()
    loss16 = packed_forward(bf16, batch).mean()
    loss16.backward()
    assert abs(loss16.item() - loss32.item()) < 0.05
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bf16.parameters())


def test_core_attention_rejects_unsupported_inputs():
    model = _model(_cfg())
    core = model.decoder.layers[0].self_attention.core_attention
    q = torch.randn(8, 1, 4, 16)
    with pytest.raises(ValueError, match="attention_bias"):
        core(q, q[:, :, :2], q[:, :, :2], None, attention_bias=torch.zeros(1))
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="causal"):
        core(q, q[:, :, :2], q[:, :, :2], None, attn_mask_type=AttnMaskType.no_mask)


def test_model_config_errors_name_the_key():
    with pytest.raises(ValueError, match="attention_type"):
        _cfg(attention_type="sliding")
    with pytest.raises(ValueError, match="num_query_groups"):
        _cfg(num_query_groups=3)
    with pytest.raises(ValueError, match="rotary_base"):
        _cfg(rotary_base="ten")
    assert paper_rotary_base(65536) == 5e6 and paper_rotary_base(131072) == 1e7
    assert paper_rotary_base(32768) == 1e6 and paper_rotary_base(262144) == 5e7
    ntk = _cfg(rotary_base="10000", rope_scaling="ntk", rope_scaling_factor=16.0)
    assert ntk.resolved_rotary_base() == pytest.approx(10000 * 16 ** (16 / 14))


def test_rope_in_fp32_rotates_in_fp32():
    """With rope_in_fp32 the bf16 rotation is exact up to one final rounding."""
    from nemo_anchor.model.rope import rotate

    cfg32 = _cfg(rope_in_fp32=True)
    model = _model(cfg32)
    freqs = model.rotary_pos_emb(4096)
    x = torch.randn(4096, 1, 4, 16)

    exact = rotate(x, freqs, model.config)
    in_fp32 = rotate(x.bfloat16(), freqs, model.config)
    rounded_config = copy.copy(model.config)
    rounded_config.rope_in_fp32 = False
    in_bf16 = rotate(x.bfloat16(), freqs, rounded_config)
    err32 = (in_fp32.float() - exact).abs().mean()
    err16 = (in_bf16.float() - exact).abs().mean()
    assert err32 < err16
    torch.testing.assert_close(in_fp32, rotate(x.bfloat16().float(), freqs, model.config).bfloat16(), atol=0, rtol=0)



def test_layout_is_read_once_per_micro_batch_and_shared_by_every_layer(monkeypatch):
    """The boundaries go to the host when the packed-seq params are made, never inside a layer: every
    layer's core attention gets the micro-batch's layout, whose query blocks and CPU kernel buckets
    are built once, through forward and backward of a 3-layer model with full recompute."""
    from nemo_anchor.attention import cpu, layout as layout_module
    from nemo_anchor.model import core_attention

    calls = {"boundaries": 0, "query_blocks": 0, "buckets": 0}
    seen_layouts = []

    def counting(name, function):
        def spy(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return spy

    def recording_attention(*args, layout=None, **kwargs):
        seen_layouts.append(layout)
        return anchor_attention(*args, layout=layout, **kwargs)

    anchor_attention = core_attention.anchor_attention
    monkeypatch.setattr(layout_module, "boundaries", counting("boundaries", layout_module.boundaries))
    monkeypatch.setattr(layout_module, "query_blocks", counting("query_blocks", layout_module.query_blocks))
    monkeypatch.setattr(cpu, "_build_buckets", counting("buckets", cpu._build_buckets))
    monkeypatch.setattr(core_attention, "anchor_attention", recording_attention)
    model = _model(_cfg(num_layers=3, recompute="full"))
    micro_batches = [_batch([0, 5, 20, 32, 40, 64], windows=2), _batch([0, 9, 32, 33, 50, 64], windows=2)]
    for number, batch in enumerate(micro_batches, start=1):
        b, t = batch["tokens"].shape
        params = make_packed_seq_params(batch["cu_seqlens"], batch["cu_windows"], "anchor")
        assert calls == {"boundaries": 2 * number, "query_blocks": number - 1, "buckets": number - 1}  # read here
        model(input_ids=batch["tokens"].reshape(1, b * t), position_ids=batch["position_ids"].reshape(1, b * t),
              attention_mask=None, labels=batch["labels"].reshape(1, b * t), packed_seq_params=params).sum().backward()
        assert calls == {"boundaries": 2 * number, "query_blocks": number, "buckets": number}
        assert len(seen_layouts) == 6 * number  # 3 layers, run again by the recompute in backward
        assert all(layout is params.layout for layout in seen_layouts[-6:])


def test_plain_packed_seq_params_are_one_window_with_rope_restarting_at_every_document():
    """Megatron's own PackedSeqParams (one cu_seqlens segment per document, as Megatron-LM's THD training builds
    them) mean: the pack is one window whose first token is the anchor, and RoPE restarts at every document,
    as Megatron applies it; our parameters say the same with the documents as RoPE segments."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = _model(_cfg())
    batch = _batch([0, 12, 32])
    segments = batch["cu_seqlens"]
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=segments, cu_seqlens_kv=segments, max_seqlen_q=20,
                            max_seqlen_kv=20)
    ours = make_packed_seq_params(segments, batch["cu_windows"], "intra_doc_reset")  # the model's mask: anchor
    inputs = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                  labels=batch["labels"])
    torch.testing.assert_close(model(**inputs, packed_seq_params=plain), model(**inputs, packed_seq_params=ours))


@pytest.mark.parametrize("variant", [{}, {"rope_in_fp32": True},
                                     {"rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                                      "original_max_position_embeddings": 16}], ids=["rope", "rope_in_fp32", "yarn"])
def test_the_forward_step_reads_nothing_back_from_the_device(monkeypatch, variant):
    """Once ``batch_for_this_rank`` has built the layout from the host copy of the boundaries, forward
    and backward of a micro-batch (full recompute: the forward runs twice) call no ``.item()`` or
    ``.tolist()``: each is a device-to-host sync on a GPU, per layer for Megatron's unfused THD RoPE."""
    from nemo_anchor.parallel.context_parallel import batch_for_this_rank

    model = _model(_cfg(num_layers=2, recompute="full", **variant))
    batch = batch_for_this_rank(_batch([0, 5, 20, 32, 40, 64], windows=2), "anchor", torch.device("cpu"))
    expected = packed_forward(model, batch)

    def host_sync(self, *args, **kwargs):
        raise AssertionError("a device-to-host read in the forward step")

    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "item", host_sync)
        patch.setattr(torch.Tensor, "tolist", host_sync)
        loss = packed_forward(model, batch)
        loss.sum().backward()
    torch.testing.assert_close(loss, expected)


class _ContextParallelRank:
    """What Megatron's THD RoPE reads of a context-parallel group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("variant", [{}, {"rope_in_fp32": True},
                                     {"rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                                      "original_max_position_embeddings": 16}], ids=["rope", "rope_in_fp32", "yarn"])
def test_per_token_rope_rotates_as_megatrons_thd_rope(variant, cp_size):
    """The attention's RoPE (per token, positions from the packed-sequence parameters) equals Megatron's own
    unfused THD RoPE on every context-parallel rank, YaRN's attention scaling and the fp32 rotation included."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

    from nemo_anchor.model.rope import rotate, token_freqs

    cfg = _cfg(**variant)
    model = _model(cfg)
    cu_seqlens = torch.tensor([0, 8, 20, 32, 36, 64], dtype=torch.int32)
    cu_windows = torch.tensor([0, 32, 64], dtype=torch.int32)
    mscale = _yarn_get_concentration_factor_from_config(model.config)
    assert (mscale != 1.0) == ("rope_scaling" in variant)
    for rank in range(cp_size):
        group = _ContextParallelRank(cp_size, rank)
        params = make_packed_seq_params(cu_seqlens, cu_windows, "anchor", group if cp_size > 1 else None)
        emb = model.rotary_pos_emb(params.max_seqlen_q, packed_seq=True)
        freqs = emb[0] if isinstance(emb, tuple) else emb
        x = torch.randn(64 // cp_size, 4, 16).bfloat16()
        ours = rotate(x.unsqueeze(1), token_freqs(freqs, params, group), model.config, mscale).squeeze(1)
        source = x.float() if variant.get("rope_in_fp32") else x
        megatrons = rope_utils.apply_rotary_pos_emb(source, freqs, model.config, cu_seqlens=cu_windows.clone(),
                                                    mscale=mscale, cp_group=group).to(x.dtype)
        torch.testing.assert_close(ours, megatrons, atol=0, rtol=0)


@pytest.mark.parametrize("tensor_parallel", [1, 2, 3, 4, 8])
def test_vocabulary_padding_is_megatrons_and_leaves_every_rank_real_rows(tensor_parallel):
    """Megatron-LM's rule (a multiple of 128 x TP, only when TP does not divide the vocabulary), except where
    it would leave the last rank padding only: then the next multiple of TP (checkpoints store each rank's
    real rows, nemo_anchor.model.vocab)."""
    from nemo_anchor.model.vocab import padded_vocab_size

    tp = tensor_parallel
    for vocab in range(64, 3000):
        padded = padded_vocab_size(vocab, tp)
        megatron = vocab if vocab % tp == 0 else -(-vocab // (128 * tp)) * 128 * tp
        assert padded % tp == 0 and 0 <= padded - vocab < padded // tp, (vocab, padded)
        assert padded == (megatron if megatron - vocab < megatron // tp else -(-vocab // tp) * tp), (vocab, padded)
