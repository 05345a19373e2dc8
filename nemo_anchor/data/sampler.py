"""A deterministic, resumable window sampler whose state does not depend on the parallel layout."""
from __future__ import annotations

import numpy as np


DEFAULT_SEED = 1234  # of the window order in every front door (nemo-anchor train's trainer.seed, NeMo, Bridge)


class WindowSampler:
    """The windows of every global batch, for any number of data-parallel ranks.

    The training stream is epoch after epoch of all windows, epoch e a permutation of
    ``range(num_windows)`` seeded by ``(seed, e)`` (identity when ``shuffle`` is False). Each
    optimizer step takes the next ``global_batch_size`` windows of the stream
    (:meth:`next_global_batch`); data-parallel rank r of d takes its micro-batches from it with
    :func:`rank_microbatches`. The state is the number of windows the whole run has consumed, so a
    run resumed with another data-parallel size (or micro-batch size) trains on exactly the windows
    the uninterrupted run would have.

    Raises:
        ValueError: no windows, or a state from another dataset or seed.
    """

    def __init__(self, num_windows: int, *, seed: int = 0, shuffle: bool = True):
        if num_windows < 1:
            raise ValueError(f"cannot sample from {num_windows} windows")
        self.num_windows, self.seed, self.shuffle = num_windows, seed, shuffle
        self.consumed = 0
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_windows

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """int64 ``[num_windows]``: the windows of ``epoch`` in stream order."""
        if self._cached is None or self._cached[0] != epoch:
            order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_windows) if self.shuffle
                     else np.arange(self.num_windows))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_global_batch(self, global_batch_size: int) -> list[int]:
        """The next ``global_batch_size`` windows of the stream (crossing epochs as needed)."""
        batch = []
        while len(batch) < global_batch_size:
            epoch, position = divmod(self.consumed, self.num_windows)
            taken = self.epoch_windows(epoch)[position:position + global_batch_size - len(batch)]
            batch.extend(int(w) for w in taken)
            self.consumed += len(taken)
        return batch

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "num_windows": self.num_windows, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_windows", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state.get(key)!r}, this sampler has {getattr(self, key)!r}")
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"sampler state has consumed={consumed!r}, expected a non-negative int")
        self.consumed = consumed


class WindowStream:
    """A map-style dataset whose sample ``i`` is window ``i`` of ``sampler``'s stream, ``length`` samples long.

    For trainers that read a dataset by consecutive sample index, rank ``r`` of ``d`` taking
    micro-batch ``m`` at ``[(m * d + r) * mb, ...)`` of each global batch (NeMo's
    ``MegatronPretrainingSampler``, Megatron-Bridge's pretraining sampler): they then read the windows
    ``nemo-anchor train`` reads, in the same micro-batches, and resume from their consumed-sample count.
    """

    def __init__(self, dataset, sampler: WindowSampler, length: int):
        self.dataset, self.sampler, self.length = dataset, sampler, length

    def window(self, index: int) -> int:
        epoch, position = divmod(index, self.sampler.num_windows)
        return int(self.sampler.epoch_windows(epoch)[position])

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return self.dataset[self.window(index)]


def rank_microbatches(global_batch: list[int], micro_batch_size: int, data_parallel_rank: int,
                      data_parallel_size: int) -> list[list[int]]:
    """Rank r's micro-batches of a global batch: micro-batch m holds windows ``(m * d + r) * mb ...``.

    Raises:
        ValueError: the global batch is not a multiple of ``micro_batch_size x data_parallel_size``.
    """
    per_round = micro_batch_size * data_parallel_size
    if len(global_batch) % per_round:
        raise ValueError(f"a global batch of {len(global_batch)} windows is not a multiple of micro_batch_size x "
                         f"data-parallel size = {micro_batch_size} x {data_parallel_size}")
    return [global_batch[start + data_parallel_rank * micro_batch_size:
                         start + (data_parallel_rank + 1) * micro_batch_size]
            for start in range(0, len(global_batch), per_round)]
