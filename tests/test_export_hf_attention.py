"""attn_implementation="anchor" for transformers models: the AnchorAttention mask on packed batches."""
import pytest
import torch
import transformers

import nemo_anchor.export.hf_attention  # noqa: F401  registers "anchor"
from nemo_anchor.convert.hf_mapping import hf_to_megatron_state, model_config_from_hf
from nemo_anchor.convert.megatron_state import build_model, load_into_model
from nemo_anchor.model.gpt import packed_forward

# two rows (windows) of 12 tokens: documents [0,4) [4,9) [9,12) | [12,15) [15,24)
CU_SEQLENS = torch.tensor([0, 4, 9, 12, 15, 24], dtype=torch.int32)
CU_WINDOWS = torch.tensor([0, 12, 24], dtype=torch.int32)
B, T = 2, 12


def tiny_llama(attn_implementation):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=attn_implementation)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def anchor_mask_by_hand():
    """Additive [B, 1, T, T] mask spelled out from the definition: causal, same document or the window's first token."""
    document = torch.zeros(B * T, dtype=torch.long)
    for index, (start, end) in enumerate(zip(CU_SEQLENS[:-1].tolist(), CU_SEQLENS[1:].tolist())):
        document[start:end] = index
    allowed = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for row in range(B):
        for i in range(T):
            for j in range(i + 1):
                allowed[row, 0, i, j] = j == 0 or document[row * T + i] == document[row * T + j]
    return torch.zeros(B, 1, T, T).masked_fill(~allowed, float("-inf"))


def test_anchor_attention_equals_an_explicit_mask():
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T).expand(B, T)  # continuous across each window
    eager = tiny_llama("eager")
    anchor = tiny_llama("anchor")
    with torch.no_grad():
        reference = eager(input_ids=tokens, position_ids=positions, attention_mask=anchor_mask_by_hand()).logits
        logits = anchor(input_ids=tokens, position_ids=positions, cu_seqlens=CU_SEQLENS, cu_windows=CU_WINDOWS,
                        use_cache=False).logits
        full = eager(input_ids=tokens, position_ids=positions).logits
    assert (logits - reference).abs().max() <= 1e-5
    assert (logits - full).abs().max() > 1e-3  # the documents after the first really are cut off

    anchor.train()
    loss = anchor(input_ids=tokens, position_ids=positions, cu_seqlens=CU_SEQLENS, cu_windows=CU_WINDOWS,
                  labels=tokens, use_cache=False).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in anchor.parameters() if p.requires_grad)


def test_anchor_attention_matches_the_megatron_model_on_a_packed_batch():
    hf = tiny_llama("anchor")
    cfg = model_config_from_hf(hf.config, attention_type="anchor")
    megatron = build_model(cfg, hf.config.vocab_size)
    load_into_model(megatron, hf_to_megatron_state(hf.state_dict(), cfg, source="tiny"), source="tiny")
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens, "position_ids": torch.arange(T).expand(B, T), "cu_seqlens": CU_SEQLENS,
             "cu_windows": CU_WINDOWS}
    with torch.no_grad():
        ours = packed_forward(megatron.eval(), batch)
        theirs = hf(input_ids=tokens, position_ids=batch["position_ids"], cu_seqlens=CU_SEQLENS,
                    cu_windows=CU_WINDOWS, use_cache=False).logits
    assert (ours - theirs).abs().max() <= 1e-4


def test_structure_must_come_as_keyword_arguments():
    model = tiny_llama("anchor")
    tokens = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        model(input_ids=tokens, use_cache=False)
    with pytest.raises(ValueError, match="attention_mask=None"):
        model(input_ids=tokens, attention_mask=torch.ones(1, 1, 8, 8), cu_seqlens=torch.tensor([0, 8]),
              use_cache=False)
