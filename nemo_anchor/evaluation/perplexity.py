"""Long-context perplexity per position bucket: does the loss keep falling deep into the window?"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_LOGIT_CHUNK = 1024  # positions whose vocabulary logits are held at once (128K x 128K-vocab logits do not fit)


@dataclass(frozen=True)
class PositionPerplexity:
    """Mean next-token loss for the targets at positions ``[starts[b], ends[b])`` of the windows."""

    starts: list[int]
    ends: list[int]
    nll: list[float]  # mean negative log-likelihood (nats) per bucket
    num_tokens: list[int]

    @property
    def perplexity(self) -> list[float]:
        return torch.tensor(self.nll, dtype=torch.float64).exp().tolist()

    def as_dict(self) -> dict:
        return {
            "starts": self.starts, "ends": self.ends, "nll": self.nll,
            "perplexity": self.perplexity, "num_tokens": self.num_tokens,
        }


def bucket_edges(length: int, num_buckets: int) -> list[int]:
    """``num_buckets + 1`` integer edges splitting target positions ``[1, length)`` evenly."""
    if not 1 <= num_buckets <= length - 1:
        raise ValueError(f"need 1 <= num_buckets <= {length - 1} for windows of {length} tokens, got {num_buckets}")
    return [1 + (length - 1) * bucket // num_buckets for bucket in range(num_buckets + 1)]


def perplexity_by_position(model, windows: torch.Tensor, num_buckets: int = 8) -> PositionPerplexity:
    """Next-token loss of ``model`` on ``windows`` (int64 ``[N, T]``), grouped by target position.

    The target at position ``t`` (``1 <= t < T``) is predicted from tokens ``[0, t)``. Logits are
    computed ``_LOGIT_CHUNK`` positions at a time from the decoder's last hidden states, and the
    loss in fp32.
    """
    if windows.dim() != 2:
        raise ValueError(f"expected windows [N, T], got shape {tuple(windows.shape)}")
    length = windows.shape[1]
    edges = bucket_edges(length, num_buckets)
    bucket_of_target = torch.bucketize(torch.arange(1, length), torch.tensor(edges[1:-1]), right=True)
    nll_sums = torch.zeros(num_buckets, dtype=torch.float64)
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = head.weight.device
    with torch.inference_mode():
        for window in windows.to(device):
            hidden = decoder(input_ids=window[None], use_cache=False).last_hidden_state[0]
            for start in range(0, length - 1, _LOGIT_CHUNK):
                stop = min(start + _LOGIT_CHUNK, length - 1)
                logits = head(hidden[start:stop]).float()
                nll = torch.nn.functional.cross_entropy(logits, window[start + 1 : stop + 1], reduction="none")
                nll_sums.index_add_(0, bucket_of_target[start:stop], nll.to("cpu", torch.float64))
    counts = torch.bincount(bucket_of_target, minlength=num_buckets) * windows.shape[0]
    return PositionPerplexity(
        starts=edges[:-1], ends=edges[1:], nll=(nll_sums / counts).tolist(), num_tokens=counts.tolist()
    )
