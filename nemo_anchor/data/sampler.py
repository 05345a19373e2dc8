"""A deterministic, resumable, data-parallel window sampler."""
from __future__ import annotations

from typing import Iterator

import numpy as np


class WindowSampler:
    """Endless stream of window indices for one data-parallel rank, epoch after epoch.

    Epoch e is a permutation of ``range(num_windows)`` seeded by ``(seed, e)`` (identity when
    ``shuffle`` is False); its first ``num_windows - num_windows % world_size`` entries are dealt
    round-robin to the ranks, so ranks never share a window within an epoch and every rank sees
    the same number. The remainder is dropped; with shuffling, different windows each epoch.

    The state is the number of windows this rank has consumed: iterating yields windows from
    there on and counts them; ``load_state_dict(state_dict())`` resumes exactly. Iterate only as
    far as the trainer uses (e.g. ``micro_batch_size`` windows per micro-batch, gradient accumulation
    included); a prefetching loader that runs ahead must save its own consumed count instead.

    Raises:
        ValueError: fewer windows than ranks, a bad rank, or a state from another configuration.
    """

    def __init__(self, num_windows: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if num_windows < world_size:
            raise ValueError(f"{num_windows} windows cannot be shared by {world_size} data-parallel ranks")
        self.num_windows, self.rank, self.world_size = num_windows, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.consumed = 0

    def __len__(self) -> int:
        """Windows per epoch on this rank."""
        return self.num_windows // self.world_size

    @property
    def epoch(self) -> int:
        return self.consumed // len(self)

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """int64 ``[len(self)]``: this rank's windows of ``epoch``, in order."""
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_windows) if self.shuffle
                 else np.arange(self.num_windows))
        return order[: len(self) * self.world_size][self.rank::self.world_size]

    def __iter__(self) -> Iterator[int]:
        while True:
            epoch, position = divmod(self.consumed, len(self))
            for window in self.epoch_windows(epoch)[position:]:
                self.consumed += 1
                yield int(window)

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "num_windows": self.num_windows, "world_size": self.world_size,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_windows", "world_size", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(f"sampler state has {key}={state.get(key)!r}, this sampler has {getattr(self, key)!r}")
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"sampler state has consumed={consumed!r}, expected a non-negative int")
        self.consumed = consumed
