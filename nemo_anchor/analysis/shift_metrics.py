"""Attention under a uniform position shift: D of Eq. 4 and D_logit of Eq. 5 (Wang et al., Section 2).

RoPE is meant to encode relative positions only, so running a model with position ids
``Δ, Δ+1, ..., Δ+T-1`` should give the same attention for every Δ. :func:`shift_differences`
runs the model once, one batch row per shift, and compares every layer's attention probabilities
and first-key logits between rows; D and D_logit (for every length up to T) follow from them.

What is computed, in which precision. The model runs its own forward pass in its dtype; only its
attention kernel is swapped (through HF's ``AttentionInterface``) for :func:`fp32_score_attention`,
which sees exactly the q, k, v the model's attention module produced:

- q/k/v projections in the model dtype, then HF's rotation ``x*cos + rotate_half(x)*sin`` in the
  model dtype with a cos/sin table computed in fp32 and cast to the model dtype. In bf16 this is
  where the shift stops cancelling.
- Scores ``(q * scaling)·k`` accumulated and kept in fp32 and a fp32 softmax under the causal (and
  sliding-window) mask, as FlashAttention-2 and PyTorch's SDPA kernels do with bf16 inputs
  (HF's eager attention would also round the scores to bf16; production kernels do not).
- The probabilities are cast to the value dtype for the weighted sum, as FlashAttention-2 does;
  the next layer's input is therefore what a bf16 model computes.
- Differences are taken between fp32 probabilities (D) or fp32 logits (D_logit), summed over
  query tokens in fp32 and over heads and layers in float64.

Rope types whose frequencies depend on the largest position in the batch ("dynamic",
"longrope") are refused: rows with different shifts would share one table.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import AttentionInterface

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_BATCH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
# Score-block size bounds (elements, queries). On the CPU small blocks win twice over (measured:
# about 2x faster than 128 MiB blocks): they stay in cache and are reused by the allocator instead
# of being mapped afresh (page faults). Accelerators want few, large launches.
_BLOCK_ELEMENTS = {"cpu": 1 << 20}
_ACCELERATOR_BLOCK_ELEMENTS = 1 << 25  # 128 MiB in fp32
_QUERY_BLOCK = {"cpu": 64}
_ACCELERATOR_QUERY_BLOCK = 256
_ATTENTION_NAME = "nemo_anchor_shift_probe"

# (query [B,H,T,D], key [B,Hkv,T,D], value [B,Hkv,T,D], scaling, sliding_window) -> output [B,T,H,D]
LayerAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], torch.Tensor]
_LAYER_ATTENTION: contextvars.ContextVar[LayerAttention] = contextvars.ContextVar(_ATTENTION_NAME)


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


@dataclass(frozen=True)
class ShiftDifferences:
    """Differences between each shift ``Δ1`` and the reference ``Δ2`` for one sequence of ``T`` tokens.

    ``attention[s, j] = n_j Σ_{l,h} Σ_i |ATTN_ij(Δ1_s) - ATTN_ij(Δ2)|``: per key ``j``, with ``ATTN``
    layer ``l`` head ``h``'s attention probabilities and ``n`` the causal normalisation (Eq. 4
    before its sum over ``j``; the row of ``Δ1 = 0`` is Figure 1, middle). None when not measured.

    ``first_key_logits[s, i] = Σ_{l,h} |A_i0(Δ1_s) - A_i0(Δ2)|``: per query ``i``, with
    ``A_i0 = (q_i * scaling)·k_0`` its fp32 logit on the first key (Eq. 5 before its mean over ``i``).
    Both are float64 ``[len(shifts), T]`` on the CPU.
    """

    attention: torch.Tensor | None
    first_key_logits: torch.Tensor

    def D(self) -> torch.Tensor:
        """``D(X, Δ1, Δ2)`` of Eq. 4 per shift: float64 ``[len(shifts)]``."""
        if self.attention is None:
            raise ValueError("attention differences were not measured (attention=False)")
        return self.attention.sum(dim=-1)

    def D_logit(self, length: int) -> torch.Tensor:
        """``D_logit`` of Eq. 5 per shift for the sequence's first ``length`` tokens: float64 ``[len(shifts)]``.

        A causal model computes the first ``length`` positions of a longer sequence exactly as it
        computes the prefix alone, so every length up to ``T`` comes from one forward pass.
        """
        if not 1 <= length <= self.first_key_logits.shape[-1]:
            raise ValueError(f"length {length} is outside [1, {self.first_key_logits.shape[-1]}]")
        return self.first_key_logits[:, :length].sum(dim=-1) / length


def shift_differences(
    model, input_ids: torch.Tensor, shifts: Sequence[int], reference_shift: int = 16, *, attention: bool = True
) -> ShiftDifferences:
    """Run ``model`` on ``input_ids`` (int64 ``[T]``) once per shift, in one batch, and compare each
    shift's attention (when ``attention``) and first-key logits with those of ``reference_shift``.

    ``model`` is a Llama-family HF causal LM (see :func:`check_supported`); a shift equal to
    ``reference_shift`` gives rows of exact zeros. See :class:`ShiftDifferences`.
    """
    rows = [reference_shift, *shifts]  # the reference is row 0
    length = input_ids.shape[-1]
    attention_sums = torch.zeros(len(rows), length, dtype=torch.float64) if attention else None
    logit_sums = torch.zeros(len(rows), length, dtype=torch.float64)

    def compare_attention(probabilities):  # fp32 [rows, heads, queries, keys [0, k)]
        difference = probabilities[1:].sub_(probabilities[:1]).abs_()
        per_key = difference.sum(dim=2).sum(dim=1)  # Σ_h Σ_i |ATTN(Δ1) - ATTN(Δ2)|
        attention_sums[1:, : per_key.shape[-1]] += per_key.to("cpu", torch.float64)

    def layer_attention(query, key, value, scaling, sliding_window):
        groups = query.shape[1] // key.shape[1]
        first_key = key[:, :, :1].float().repeat_interleave(groups, dim=1)  # [rows, H, 1, D]
        logits = torch.matmul(query.float() * scaling, first_key.transpose(-1, -2))[..., 0]  # [rows, H, T]
        logit_sums.add_((logits - logits[:1]).abs_().sum(dim=1).to("cpu", torch.float64))
        inspect = compare_attention if attention else None
        return fp32_score_attention(query, key, value, scaling, sliding_window, inspect=inspect)

    _run_shifted(model, input_ids, rows, layer_attention)
    normalised = None if attention_sums is None else attention_sums[1:] * causal_normalisation(length)
    return ShiftDifferences(attention=normalised, first_key_logits=logit_sums[1:])


def fp32_score_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None = None,
    inspect: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Causal attention with fp32 scores and softmax; the weighted sum in the value dtype.

    Args:
        query: ``[B, H, T, D]``; key, value: ``[B, H_kv, T, D]`` with ``H % H_kv == 0`` (GQA).
        sliding_window: when set, query ``i`` sees keys ``j`` with ``i - window < j <= i`` (HF's convention).
        inspect: called with every block of fp32 probabilities ``[B, h, q, k]`` (``h`` heads, ``q``
            consecutive queries ending at ``k``, keys ``[0, k)``; later keys are masked) once the
            block has been used, so it may overwrite it.

    Returns:
        ``[B, T, H, D]`` in the value dtype (the layout HF attention functions return).
    """
    batch, num_heads, length, head_dim = query.shape
    groups = num_heads // key.shape[1]
    output = torch.empty(batch, length, num_heads, head_dim, dtype=value.dtype, device=query.device)
    # Blocks of queries skip the keys the causal mask hides (about half of them) and bound memory.
    budget = _BLOCK_ELEMENTS.get(query.device.type, _ACCELERATOR_BLOCK_ELEMENTS)
    query_block = _QUERY_BLOCK.get(query.device.type, _ACCELERATOR_QUERY_BLOCK)
    queries_per_block = max(1, min(length, query_block, budget // (batch * length)))
    heads_per_block = max(1, min(num_heads, budget // (batch * queries_per_block * length)))
    for head_start in range(0, num_heads, heads_per_block):
        heads = slice(head_start, min(head_start + heads_per_block, num_heads))
        kv_heads = torch.arange(heads.start, heads.stop, device=query.device) // groups
        keys, values = key[:, kv_heads].float(), value[:, kv_heads]
        for query_start in range(0, length, queries_per_block):
            rows = slice(query_start, min(query_start + queries_per_block, length))
            visible = rows.stop  # keys after the block's last query are all masked: not computed
            scaled_query = query[:, heads, rows].float() * scaling
            scores = torch.matmul(scaled_query, keys[:, :, :visible].transpose(-1, -2))  # [B, h, q, visible]
            # Only the diagonal square holds future keys; a sliding window also hides older ones.
            keys_to_mask = slice(0 if sliding_window is not None else query_start, visible)
            hidden = _hidden_keys(rows, keys_to_mask, sliding_window, query.device)
            scores[..., keys_to_mask].masked_fill_(hidden, float("-inf"))
            probabilities = scores.softmax(dim=-1)
            weighted = torch.matmul(probabilities.to(value.dtype), values[:, :, :visible])
            output[:, rows, heads] = weighted.transpose(1, 2)
            if inspect is not None:
                inspect(probabilities)
    return output


def _hidden_keys(queries: slice, keys: slice, window: int | None, device) -> torch.Tensor:
    """bool ``[len(queries), len(keys)]``: True where query ``i`` may not see key ``j`` (a future
    key, or one the sliding window dropped)."""
    query_positions = torch.arange(queries.start, queries.stop, device=device)[:, None]
    offset = query_positions - torch.arange(keys.start, keys.stop, device=device)  # i - j
    hidden = offset < 0
    if window is not None:
        hidden |= offset >= window
    return hidden


def _run_shifted(model, input_ids: torch.Tensor, shifts: Sequence[int], layer_attention: LayerAttention) -> None:
    """One decoder forward with batch row ``r`` at positions ``shifts[r] + [0, T)``, every layer's
    attention computed by ``layer_attention``."""
    check_supported(model)
    if input_ids.dim() != 1:
        raise ValueError(f"expected one sequence of token ids [T], got shape {tuple(input_ids.shape)}")
    decoder = model.get_decoder()
    device = decoder.embed_tokens.weight.device
    length = input_ids.shape[0]
    position_ids = torch.tensor(shifts, device=device)[:, None] + torch.arange(length, device=device)
    with _attention_swapped(model, layer_attention), torch.inference_mode():
        decoder(input_ids=input_ids.to(device).expand(len(shifts), length), position_ids=position_ids, use_cache=False)


@contextlib.contextmanager
def _attention_swapped(model, layer_attention: LayerAttention):
    original = model.config._attn_implementation
    token = _LAYER_ATTENTION.set(layer_attention)
    model.set_attn_implementation(_ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
        _LAYER_ATTENTION.reset(token)


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface entry point: hands the layer's q, k, v to the active metric."""
    if attention_mask is not None:
        raise ValueError("the shift probe runs unpadded sequences and builds its own causal mask")
    scaling = module.scaling if scaling is None else scaling
    return _LAYER_ATTENTION.get()(query, key, value, scaling, kwargs.get("sliding_window")), None


AttentionInterface.register(_ATTENTION_NAME, _probe_attention)
