import numpy as np
import pytest

from mingpt.config import Config, TrainerConfig
from mingpt.sampler import GlobalOrder, micro_batches, shard
from mingpt.trainer import lr_at


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
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 60) == pytest.approx(0.55)
    assert lr_at(cfg, 110) == pytest.approx(0.1)
    assert lr_at(cfg, 500) == pytest.approx(0.1)  # past max_steps (a run extended later) stays at the floor
    lrs = [lr_at(cfg, s) for s in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
