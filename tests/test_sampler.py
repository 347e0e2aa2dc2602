import numpy as np
import pytest

from mingpt.training.config import Config, TrainerConfig
from mingpt.data.sampler import (GOLDEN, GlobalOrder, RandomWindows, StridedWindows, micro_batches, shard, splitmix64,
                            window_order)
from mingpt.training.schedule import lr_at


def test_order_is_a_pure_function_of_seed_and_position():
    a, b = GlobalOrder(100, seed=1), GlobalOrder(100, seed=1)
    assert np.array_equal(a.indices(250, 30), b.indices(250, 30))
    assert not np.array_equal(GlobalOrder(100, seed=2).indices(0, 30), a.indices(0, 30))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    order = GlobalOrder(50, seed=0)
    first, second = order.indices(0, 50), order.indices(50, 50)
    assert sorted(first) == list(range(50)) == sorted(second)
    assert not np.array_equal(first, second)


def test_a_batch_across_an_epoch_boundary_continues_the_stream():
    order = GlobalOrder(10, seed=3)
    stream = np.concatenate([order.indices(i, 1) for i in range(35)])
    assert np.array_equal(order.indices(0, 35), stream)
    assert np.array_equal(order.indices(7, 20), stream[7:27])



def test_splitmix64_matches_the_reference_generator():
    # The first outputs of Vigna's splitmix64.c seeded with 1234567 (the usual test vector).
    state = np.uint64(1234567) + (np.arange(1, 6, dtype=np.uint64) * GOLDEN)
    assert splitmix64(state).tolist() == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                          4593380528125082431, 16408922859458223821]


@pytest.mark.parametrize("num_tokens, block_size", [(1000, 64), (65, 64), (66, 64), (10**12, 1024)])
def test_random_windows_fit_in_the_split(num_tokens, block_size):
    starts = RandomWindows(num_tokens, block_size, seed=5).starts(3, 20_000)
    assert starts.dtype == np.int64
    assert starts.min() >= 0 and starts.max() <= num_tokens - block_size - 1  # block_size + 1 tokens fit
    if num_tokens - block_size <= 2:
        assert set(starts.tolist()) == set(range(num_tokens - block_size))  # the last offset is reachable


def test_random_windows_are_a_pure_function_of_seed_and_position():
    whole = RandomWindows(10_000, 32, seed=7).starts(0, 1000)
    other = RandomWindows(10_000, 32, seed=7)  # a fresh instance, as after a restart
    cuts = [0, 1, 13, 500, 501, 999, 1000]  # any split of the range, in any order of calls
    pieces = {a: other.starts(a, b - a) for a, b in reversed(list(zip(cuts, cuts[1:])))}
    assert np.array_equal(np.concatenate([pieces[a] for a in cuts[:-1]]), whole)
    assert np.array_equal(other.starts(2**40, 5), other.starts(2**40, 5))  # far positions: no state to replay
    assert np.array_equal(other.starts(2**40 + 2, 3), other.starts(2**40, 5)[2:])


def test_random_windows_differ_between_seeds():
    a = RandomWindows(10_000, 32, seed=0).starts(0, 10_000)
    b = RandomWindows(10_000, 32, seed=1).starts(0, 10_000)
    assert np.mean(a == b) < 0.01  # independent draws agree on 1 in 9968


@pytest.mark.parametrize("num_starts", [100, 128, 1000])  # 128: the modulo keeps only the low bits
def test_random_windows_cover_the_offsets_uniformly(num_starts):
    draws = 200 * num_starts
    counts = np.bincount(RandomWindows(num_starts + 16, 16, seed=1337).starts(0, draws), minlength=num_starts)
    assert len(counts) == num_starts
    # Pearson's chi-square with num_starts - 1 degrees of freedom: mean k, sd sqrt(2k); 6 sd is never reached
    # by a uniform generator, while a skew of a few percent on some offsets is.
    chi2 = ((counts - 200) ** 2 / 200).sum()
    assert abs(chi2 - (num_starts - 1)) < 6 * np.sqrt(2 * (num_starts - 1))
    # Consecutive positions are unrelated (a counter-based generator's usual weakness).
    starts = RandomWindows(num_starts + 16, 16, seed=1337).starts(0, draws).astype(float)
    assert abs(np.corrcoef(starts[:-1], starts[1:])[0, 1]) < 0.02


def test_strided_windows_are_the_global_order_of_blocks():
    # data.windows=strided reads exactly what the trainer read before random windows existed.
    strided = StridedWindows(num_tokens=1000, block_size=64, seed=3)
    blocks = (1000 - 65) // 64 + 1
    assert np.array_equal(strided.starts(5, 40), GlobalOrder(blocks, seed=3).indices(5, 40) * 64)
    assert sorted(strided.starts(0, blocks).tolist()) == list(range(0, blocks * 64, 64))


def test_window_order_by_name():
    assert isinstance(window_order("random", 100, 8, 0), RandomWindows)
    assert isinstance(window_order("strided", 100, 8, 0), StridedWindows)
    with pytest.raises(ValueError):
        window_order("sliding", 100, 8, 0)
    for kind in ("random", "strided"):
        with pytest.raises(ValueError):
            window_order(kind, 8, 8, 0)  # 8 tokens hold no window of 8 + 1


@pytest.mark.parametrize("count, parts", [(8, 1), (8, 2), (8, 3), (16, 6), (5, 5), (7, 4)])
def test_shards_cover_the_batch_once_and_differ_by_at_most_one(count, parts):
    slices = [shard(count, parts, i) for i in range(parts)]
    covered = [i for s in slices for i in range(s.start, s.stop)]
    assert covered == list(range(count))
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches():
    assert micro_batches(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert micro_batches(3, 8) == [slice(0, 3)]


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    cfg = Config(trainer=TrainerConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1))
    assert lr_at(cfg.trainer, 0) == pytest.approx(0.1)
    assert lr_at(cfg.trainer, 9) == pytest.approx(1.0)
    assert lr_at(cfg.trainer, 10) == pytest.approx(1.0)
    assert lr_at(cfg.trainer, 60) == pytest.approx(0.55)
    assert lr_at(cfg.trainer, 110) == pytest.approx(0.1)
    assert lr_at(cfg.trainer, 500) == pytest.approx(0.1)  # past max_steps (a run extended later) stays at the floor
    lrs = [lr_at(cfg.trainer, s) for s in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
