"""Data order as a pure function of (seed, global position), sliced over whatever ranks exist now. The trainer keeps
one cursor, the examples consumed so far: a step of global batch `G` reads positions `[cursor, cursor + G)` of an
endless stream, each process a contiguous slice, so the same examples are read in the same steps at any world size. An
example is a window of `block_size + 1` tokens at a start offset: RandomWindows (any offset, so a small corpus is not
cut into a few fixed blocks) or StridedWindows (blocks `stride` apart, each read once per epoch), by `data.windows`."""

from __future__ import annotations

from typing import Protocol

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


class WindowOrder(Protocol):
    """Token offsets of the windows at global stream positions [start, start + count)."""

    def starts(self, start: int, count: int) -> np.ndarray: ...


class StridedWindows:
    """Position p reads block GlobalOrder.indices(p) of the split, at token offset index * stride."""

    def __init__(self, num_tokens: int, block_size: int, seed: int, stride: int | None = None):
        self.stride = stride or block_size
        spare = num_tokens - (block_size + 1)  # each window needs block_size + 1 tokens
        if spare < 0:
            raise ValueError(f"{num_tokens} tokens hold no window of {block_size} + 1")
        self.order = GlobalOrder(spare // self.stride + 1, seed)

    def starts(self, start: int, count: int) -> np.ndarray:
        return self.order.indices(start, count) * self.stride


# SplitMix64 (Steele, Lea and Flood 2014): a Weyl sequence with step GOLDEN through a 64-bit finalizer. Its i-th output
# is a function of (state, i) alone, so any position is drawn without the ones before it, in any order, by any process.
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer of each uint64 in `x` (arithmetic wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64, copy=True)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


class RandomWindows:
    """Position p starts at output p of a SplitMix64 stream seeded by `seed`, reduced modulo the starts where a window
    fits (bias below num_tokens / 2**64). Drawn with replacement: a window may come twice before another comes once,
    which, with one possible window per token, matters less than seeing only fixed blocks."""

    def __init__(self, num_tokens: int, block_size: int, seed: int):
        self.num_starts = num_tokens - block_size  # offsets 0 .. num_tokens - block_size - 1
        if self.num_starts < 1:
            raise ValueError(f"{num_tokens} tokens hold no window of {block_size} + 1")
        self.key = splitmix64(np.array([seed], dtype=np.uint64))[0]  # nearby seeds: unrelated streams

    def starts(self, start: int, count: int) -> np.ndarray:
        positions = np.arange(start, start + count, dtype=np.uint64)
        with np.errstate(over="ignore"):
            state = self.key + (positions + np.uint64(1)) * GOLDEN
        return (splitmix64(state) % np.uint64(self.num_starts)).astype(np.int64)


def window_order(kind: str, num_tokens: int, block_size: int, seed: int) -> WindowOrder:
    """The order `data.windows` names: 'random' or 'strided'."""
    if kind == "random":
        return RandomWindows(num_tokens, block_size, seed)
    if kind == "strided":
        return StridedWindows(num_tokens, block_size, seed)
    raise ValueError(f"data.windows must be random or strided, got {kind!r}")


def shard(count: int, parts: int, index: int) -> slice:
    """The `index`-th of `parts` contiguous slices of range(count), sizes differing by at most one."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def micro_batches(count: int, micro_batch_size: int) -> list[slice]:
    """Consecutive slices of range(count) of at most `micro_batch_size` each."""
    return [slice(i, min(i + micro_batch_size, count)) for i in range(0, count, micro_batch_size)]
