"""``nemo-anchor pack`` output as a Megatron-Bridge dataset: packed windows with their document boundaries.

Bridge's pretraining sampler reads a dataset by consecutive sample index, rank ``r`` of ``d``
taking micro-batch ``m`` at ``[(m * d + r) * mb, ...)`` of each global batch. Sample ``i`` here is
window ``i`` of :class:`~nemo_anchor.data.WindowSampler`'s stream (epoch after epoch of seeded
permutations), so Bridge trains on the windows ``nemo-anchor train`` trains on, in the same
micro-batches, for any data-parallel size; its ``consumed_samples`` resumes the stream exactly.
Batches are :func:`~nemo_anchor.data.collate_windows` output in Megatron-LM's fixed packed shapes
(:func:`~nemo_anchor.data.fixed_shape_batch`: ``cu_seqlens`` padded with -1, ``cu_seqlens_argmin``,
``max_seqlen``), so every tensor, pipeline and context-parallel rank holds a batch of the same
shapes; the forward step rebuilds the document and window boundaries from them on the host and
shards the batch for context parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.bridge.data.base import DatasetBuildContext, DatasetProvider

from nemo_anchor.data import DEFAULT_SEED, PackedDataset, WindowSampler, WindowStream, collate_windows, fixed_shape_batch


class FixedShapeWindowStream(WindowStream):
    """The shared window stream, batched in Megatron-LM's fixed packed shapes: Bridge's loader asks the
    dataset for its ``collate_fn``, and every tensor rank and pipeline stage reads the same shapes."""

    @staticmethod
    def collate_fn(items: list[dict]) -> dict:
        return fixed_shape_batch(collate_windows(items))


@dataclass(kw_only=True)
class AnchorPackedDatasetProvider(DatasetProvider):
    """``dataset:`` of a Bridge ``ConfigContainer``: ``path`` is a ``nemo-anchor pack`` directory."""

    path: str | None = None
    seq_length: int | None = None  # checked against the pack's windows; set from the model when None
    seed: int = DEFAULT_SEED
    shuffle: bool = True
    valid_path: str | None = None
    dataloader_type: str = "single"
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False

    def open(self) -> PackedDataset:
        """The training windows, checked (ValueError naming the key)."""
        if not self.path:
            raise ValueError("dataset.path is not set: give a `nemo-anchor pack` output directory")
        dataset = PackedDataset(self.path)
        if self.seq_length is not None and dataset.seq_length != self.seq_length:
            raise ValueError(f"dataset.path={self.path} has windows of {dataset.seq_length} tokens but "
                             f"model.seq_length={self.seq_length}: repack or set model.seq_length")
        return dataset

    def stream(self, length: int) -> FixedShapeWindowStream:
        """The training stream, ``length`` samples long."""
        train = self.open()
        return FixedShapeWindowStream(train, WindowSampler(len(train), seed=self.seed, shuffle=self.shuffle), length)

    def build_datasets(self, context: DatasetBuildContext):
        stream = self.stream(context.train_samples)
        valid = None
        if self.valid_path and context.valid_samples:
            windows = PackedDataset(self.valid_path)
            valid = FixedShapeWindowStream(windows, WindowSampler(len(windows), shuffle=False), context.valid_samples)
        return stream, valid, None
