"""The vocabulary padding of a tensor-parallel layout, kept out of the model and its checkpoints.

Megatron splits the word embeddings and the logits by vocabulary rows over the tensor-parallel
ranks, so a vocabulary the tensor-parallel size does not divide is padded (Megatron-LM pads to a
multiple of 128 x tensor-parallel size). Megatron treats the padded rows as tokens: they take
part in the softmax and the checkpoint stores them, so the loss and the checkpoint's shapes depend
on the layout. Here the padding belongs to the layout only:

- the logits of padded rows are ``-inf`` (:class:`PaddedVocabGPTModel`): the loss, its gradients
  (none reach the padded rows) and every prediction are those of the true vocabulary, and any
  layout trains exactly as one process does;
- ``sharded_state_dict()`` describes the word embeddings and output layer with the true
  vocabulary as their global shape (a ``ShardedTensorFactory`` keeps each rank's real rows and
  pads them back after a load). Checkpoints, the optimizer state in model space
  (:mod:`nemo_anchor.training.optimizer_state`), ``model.init_from_hf`` and exports all see the
  true vocabulary, so any tensor-parallel size resumes any checkpoint, and exports carry no rows
  that generation could emit.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.models.gpt import GPTModel

VOCAB_WEIGHTS = ("embedding.word_embeddings.weight", "output_layer.weight")  # split by vocabulary rows


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """``vocab_size`` padded as Megatron-LM pads it (to a multiple of 128 x tensor-parallel size),
    only when the tensor-parallel split of the embedding and logits needs it, and to the next
    multiple of the tensor-parallel size where that would leave a rank with padding only (a small
    vocabulary split many ways): every rank holds real rows."""
    tp = tensor_parallel_size
    if vocab_size % tp == 0:
        return vocab_size
    padded = -(-vocab_size // (128 * tp)) * 128 * tp
    if padded - vocab_size >= padded // tp:
        padded = -(-vocab_size // tp) * tp
    if padded - vocab_size >= padded // tp:
        raise ValueError(f"model.vocab_size={vocab_size} is too small to split over "
                         f"model.tensor_model_parallel_size={tp} ranks")
    return padded


class PaddedVocabGPTModel(GPTModel):
    """A ``GPTModel`` with ``padded_vocab_size`` rows of which the first ``true_vocab_size`` are tokens."""

    def __init__(self, *args, true_vocab_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        if self.post_process:
            self.output_layer.register_forward_hook(self._mask_padded_logits)

    def _real_rows(self, rows: int) -> int:
        """How many of this rank's ``rows`` vocabulary rows (its tensor-parallel share, or all of
        them when gathered) are tokens."""
        start = 0 if rows == self.vocab_size else parallel_state.get_tensor_model_parallel_rank() * rows
        return min(rows, self.true_vocab_size - start)

    def _mask_padded_logits(self, module, args, output):
        logits, bias = output
        real = self._real_rows(logits.shape[-1])
        if real == logits.shape[-1]:
            return output
        padded = torch.arange(logits.shape[-1], device=logits.device) >= real
        return logits.masked_fill(padded, float("-inf")), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in VOCAB_WEIGHTS:
            entry = state.get(prefix + name)
            if isinstance(entry, ShardedTensor):
                state[prefix + name] = true_vocab_rows(entry, self.true_vocab_size)
        return state


def true_vocab_rows(entry: ShardedTensor, vocab_size: int) -> ShardedTensorFactory:
    """``entry`` (a vocabulary-split weight) with the global shape of ``vocab_size`` rows: saved, only
    this rank's real rows are written; loaded, they are padded back with zeros to the local shape."""
    axis = entry.prepend_axis_num  # the vocabulary axis of the global shape
    rows, rest = entry.local_shape[0], tuple(entry.local_shape[1:])
    real = min(rows, vocab_size - entry.global_offset[axis])  # >= 1 (padded_vocab_size)
    global_shape = (*entry.global_shape[:axis], vocab_size, *entry.global_shape[axis + 1:])

    def build(key, data, replica_id, flattened_range):
        return replace(entry, key=key, data=data[:real], dtype=data.dtype, local_shape=(real, *rest),
                       global_shape=global_shape, axis_fragmentations=None, replica_id=replica_id,
                       allow_shape_mismatch=False)

    def merge(loaded: torch.Tensor) -> torch.Tensor:
        return torch.cat([loaded, loaded.new_zeros((rows - real, *rest))])

    return ShardedTensorFactory(entry.key, entry.data, build, merge, entry.replica_id)
