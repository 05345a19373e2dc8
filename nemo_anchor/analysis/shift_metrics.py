"""Attention under a uniform position shift: D of Eq. 4 and D_logit of Eq. 5 (Wang et al., Section 2).

RoPE is meant to encode relative positions only, so running a model with position ids
``Δ, Δ+1, ..., Δ+T-1`` should give the same attention for every Δ. Both metrics run the model
once with one batch row per shift and compare every layer's attention between rows.

What is computed, in which precision:

- The forward pass is the model's own (its dtype, its attention implementation). It provides
  each layer's input hidden states, which depend on Δ through all earlier layers.
- Each layer's q and k are recomputed from that input as the layer computes them: the q/k
  projections in the model dtype, then HF's rotation ``x*cos + rotate_half(x)*sin`` in the model
  dtype, with the cos/sin table the model passed to the layer (HF computes it in fp32 and casts it
  to the model dtype). In bf16 this is where the position shift stops cancelling.
- Logits ``q·k * scaling`` are accumulated and kept in fp32, as FlashAttention-2 and PyTorch's
  SDPA kernels do with bf16 inputs; softmax is in fp32 under the causal (and sliding-window)
  mask. Logits are not rounded to bf16 as HF's eager attention does, so what is measured is the
  RoPE rounding, not a rounding of the scores that production kernels do not do.
- Differences are summed over query tokens in fp32 and over heads and layers in float64.

Rope types whose frequencies depend on the largest position in the batch ("dynamic",
"longrope") are refused: rows with different shifts would share one table.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # Mistral and Qwen2 copy it

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_BATCH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
_CHUNK_ELEMENTS = 1 << 25  # bounds the [rows, heads, T, T] score block held at once (128 MiB in fp32)

LayerCallback = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], None]


def check_supported(model) -> None:
    """Raise ValueError unless ``model`` is a Llama-family HF causal LM these metrics understand."""
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    rope_type = getattr(model.get_decoder().rotary_emb, "rope_type", "default")
    if rope_type in _BATCH_DEPENDENT_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} picks its frequencies from the largest position in the batch, "
            "so shifted rows of one batch would not see the tables separate runs would"
        )


def causal_normalisation(length: int) -> torch.Tensor:
    """The vector ``n = [1/T, 1/(T-1), ..., 1]`` of Eq. 4: key ``j`` (0-based) is seen by ``T - j`` queries."""
    return 1.0 / torch.arange(length, 0, -1, dtype=torch.float64)


def attention_shift_difference(
    model, input_ids: torch.Tensor, shifts: Sequence[int], reference_shift: int = 16
) -> torch.Tensor:
    """Per-key attention difference between each shift ``Δ1`` in ``shifts`` and ``Δ2 = reference_shift``.

    Args:
        model: a Llama-family HF causal LM (see :func:`check_supported`).
        input_ids: int64 ``[T]``, one sequence.
        shifts: the ``Δ1`` values; may include ``reference_shift`` (its row is then exactly 0).

    Returns:
        float64 ``[len(shifts), T]`` (CPU): entry ``[s, j] = n_j * Σ_{l,h} Σ_i |ATTN_ij(Δ1_s) - ATTN_ij(Δ2)|``,
        with ``ATTN`` the post-softmax attention of layer ``l``, head ``h``. Row ``s`` summed over
        ``j`` is ``D(X, Δ1_s, Δ2)`` of Eq. 4; the row of ``Δ1 = 0`` is Figure 1 (middle).
    """
    rows = [reference_shift, *shifts]  # the reference is row 0
    length = input_ids.shape[-1]
    column_sums = torch.zeros(len(rows), length, dtype=torch.float64)

    def compare_to_reference(attention, query, key):
        hidden_keys = _hidden_keys(length, _sliding_window(attention), query.device)
        groups = attention.num_key_value_groups
        for heads in _head_chunks(query.shape[1], len(rows) * length * length):
            probabilities = _attention_probabilities(query[:, heads], key[:, heads // groups], attention.scaling, hidden_keys)
            difference = (probabilities - probabilities[:1]).abs_()
            column_sums.add_(difference.sum(dim=2).sum(dim=1).to("cpu", torch.float64))

    _run_shifted(model, input_ids, rows, compare_to_reference)
    return column_sums[1:] * causal_normalisation(length)


def first_token_logit_difference(model, input_ids: torch.Tensor, shift_a: int = 0, shift_b: int = 16) -> float:
    """``D_logit`` of Eq. 5: ``(1/T) Σ_{l,h} Σ_i |A_i0(Δa) - A_i0(Δb)|`` for one sequence ``[T]``.

    ``A_i0`` is the logit of query ``i`` on the first key, ``q_i·k_0 * scaling`` (fp32 accumulation
    of the model-dtype q and k, see the module notes); logits rather than probabilities because
    the softmax normaliser changes with ``T``.
    """
    length = input_ids.shape[-1]
    total = torch.zeros((), dtype=torch.float64)

    def first_key_logits(attention, query, key):
        first_key = key[:, :, :1].float().repeat_interleave(attention.num_key_value_groups, dim=1)
        logits = torch.matmul(query.float(), first_key.transpose(-1, -2)) * attention.scaling
        total.add_((logits[0] - logits[1]).abs().sum().to("cpu", torch.float64))

    _run_shifted(model, input_ids, [shift_a, shift_b], first_key_logits)
    return total.item() / length


def rotated_query_key(attention, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q ``[B, H, T, D]`` and k ``[B, H_kv, T, D]`` after RoPE, in the model dtype, as ``attention`` makes them."""
    batch, length, _ = hidden_states.shape
    query = attention.q_proj(hidden_states).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    key = attention.k_proj(hidden_states).view(batch, length, -1, attention.head_dim).transpose(1, 2)
    return apply_rotary_pos_emb(query, key, cos, sin)


def _run_shifted(model, input_ids: torch.Tensor, shifts: Sequence[int], on_layer: LayerCallback) -> None:
    """One forward of the decoder with row ``r`` at positions ``shifts[r] + [0, T)``; calls
    ``on_layer(attention_module, query, key)`` on every layer with its rotated q and k."""
    check_supported(model)
    if input_ids.dim() != 1:
        raise ValueError(f"expected one sequence of token ids [T], got shape {tuple(input_ids.shape)}")
    decoder = model.get_decoder()
    device = decoder.embed_tokens.weight.device
    length = input_ids.shape[0]
    position_ids = torch.tensor(shifts, device=device)[:, None] + torch.arange(length, device=device)

    def hook(attention, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        on_layer(attention, *rotated_query_key(attention, kwargs["hidden_states"], cos, sin))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in decoder.layers]
    try:
        with torch.inference_mode():
            batch = input_ids.to(device).expand(len(shifts), length)
            decoder(input_ids=batch, position_ids=position_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def _attention_probabilities(query, key, scaling: float, hidden_keys: torch.Tensor) -> torch.Tensor:
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2)).mul_(scaling)
    return logits.masked_fill_(hidden_keys, float("-inf")).softmax(dim=-1)


def _hidden_keys(length: int, window: int | None, device) -> torch.Tensor:
    """bool ``[T, T]``: True where query ``i`` may not see key ``j`` (future keys, or keys a sliding window dropped)."""
    offset = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)  # i - j
    hidden = offset < 0
    if window is not None:
        hidden |= offset >= window
    return hidden


def _sliding_window(attention) -> int | None:
    # Qwen2 sets it per layer on the module; Mistral only has it in the config; Llama has neither.
    return getattr(attention, "sliding_window", getattr(attention.config, "sliding_window", None))


def _head_chunks(num_heads: int, elements_per_head: int):
    size = max(1, _CHUNK_ELEMENTS // elements_per_head)
    for start in range(0, num_heads, size):
        yield torch.arange(start, min(start + size, num_heads))
