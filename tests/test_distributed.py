"""Joining the process group: device placement by LOCAL_RANK."""

import pytest
import torch

from mingpt.training import distributed
from mingpt.errors import ConfigError


def test_more_workers_than_gpus_is_a_clear_error(monkeypatch):
    # Two GPUs, and a third worker: it must not silently share GPU 0 with the first.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail(f"set_device({device}) called"))
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this node has 2 visible GPU\(s\).*"
                                          r"--nproc-per-node=gpu or at most 2.*CUDA_VISIBLE_DEVICES"):
        distributed.start(timeout_s=5)


def test_each_worker_takes_the_gpu_of_its_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    world = distributed.start(timeout_s=5)
    assert world.device == torch.device("cuda", 1) and chosen == [torch.device("cuda", 1)]
