"""Data order as a pure function of (seed, global position), sliced over whatever ranks exist now.

The trainer keeps one cursor, the number of examples consumed so far. Step `s` of a run with
global batch `G` reads the examples at positions `[cursor, cursor + G)` of an endless stream
made of one fresh permutation of the dataset per epoch. Each process takes a contiguous slice
of that batch, so the same examples are read, in the same optimizer steps, at any world size.
"""

from __future__ import annotations

import numpy as np


class GlobalOrder:
    """Example indices at global stream positions; epoch `e` is permutation([seed, e])."""

    def __init__(self, num_examples: int, seed: int):
        if num_examples < 1:
            raise ValueError("cannot order an empty dataset")
        self.num_examples = num_examples
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def epoch(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_examples))
        return self._cached[1]

    def indices(self, start: int, count: int) -> np.ndarray:
        """The example indices at positions start, start+1, ..., start+count-1."""
        out = np.empty(count, dtype=np.int64)
        filled = 0
        while filled < count:
            epoch, offset = divmod(start + filled, self.num_examples)
            take = min(count - filled, self.num_examples - offset)
            out[filled : filled + take] = self.epoch(epoch)[offset : offset + take]
            filled += take
        return out


def shard(count: int, parts: int, index: int) -> slice:
    """The `index`-th of `parts` contiguous slices of range(count), sizes differing by at most one."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def micro_batches(count: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of range(count) of at most `micro_batch_size` each."""
    return [slice(i, min(i + micro_batch_size, count)) for i in range(0, count, micro_batch_size)]
