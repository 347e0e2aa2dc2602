"""Trainer benchmark, every figure measured in this one run:

1. trainer tokens/s against a bare training loop of the same model, data and batch (the overhead
   of the trainer: data order, loss weighting, the per-step collective, logging);
2. one process with 2 threads against torchrun with 2 processes of 1 thread each;
3. the time a synchronous snapshot blocks training, against the time of one training step.

    python bench/bench_trainer.py [--steps 200] [--model gpt-micro]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mingpt.training.config import Config, DataConfig, ModelConfig, SnapshotConfig, TrainerConfig
from mingpt.data.prepared import PreparedData
from mingpt.data.prepare import prepare
from mingpt.model import GPT
from mingpt.data.sampler import GlobalOrder
from mingpt.checkpoint.store import SnapshotStore
from mingpt.training.trainer import train

REPO = Path(__file__).resolve().parents[1]


def make_config(workdir: Path, name: str, steps: int, model: str) -> Config:
    return Config(
        model=ModelConfig(name=model, arch="gpt2"),
        data=DataConfig(block_size=128, prepared_dir=str(workdir / "prepared")),
        trainer=TrainerConfig(max_steps=steps, global_batch_size=32, micro_batch_size=32, eval_every=0, log_every=10,
                              optimizer="adamw"),
        snapshot=SnapshotConfig(dir=str(workdir / name), every=10**9),
    )


def rate_from_metrics(snapdir: Path, tokens_per_step: int) -> float:
    """tokens/s between the first and last progress records, so start-up and the final snapshot are excluded."""
    records = [json.loads(line) for line in (snapdir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "train_loss" in r]
    first, last = records[0], records[-1]
    return (last["step"] - first["step"]) * tokens_per_step / (last["time"] - first["time"])


def bare_loop(cfg: Config, steps: int) -> float:
    """The same model, data, batch and optimizer as the trainer, in the plainest loop; tokens/s."""
    t = cfg.trainer
    data = PreparedData(cfg.data.prepared_dir)
    blocks = data.split("train", cfg.data.block_size)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model.build(data.vocab_size, cfg.data.block_size))
    optimizer = torch.optim.AdamW(model.param_groups(t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))
    order = GlobalOrder(len(blocks), cfg.seed)
    start = None
    for step in range(steps + 10):
        if step == 10:  # as the trainer's figure, skip the first records' warm-up
            start = time.perf_counter()
        x, y = blocks.batch(order.indices(step * t.global_batch_size, t.global_batch_size))
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
    return steps * t.global_batch_size * cfg.data.block_size / (time.perf_counter() - start)


def torchrun_rate(workdir: Path, steps: int, model: str) -> float:
    name = "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "train" / "main.py"), f"model={model}", "model.arch=gpt2", "trainer.optimizer=adamw",
           "data.block_size=128", f"trainer.max_steps={steps}",
           "trainer.global_batch_size=32", "trainer.micro_batch_size=32", "trainer.eval_every=0",
           "trainer.log_every=10", f"snapshot.dir={workdir / name}", "snapshot.every=1000000000",
           f"data.prepared_dir={workdir / 'prepared'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=workdir)
    return rate_from_metrics(workdir / name, 32 * 128)


def snapshot_block_time(cfg: Config, workdir: Path, repeats: int = 5) -> tuple[float, float]:
    """Seconds one synchronous save blocks training (copy to CPU + serialise + write + prune), and its MB."""
    data = PreparedData(cfg.data.prepared_dir)
    model = GPT(cfg.model.build(data.vocab_size, cfg.data.block_size))
    optimizer = torch.optim.AdamW(model.parameters())
    model(*data.split("train", cfg.data.block_size).batch([0]))[1].backward()
    optimizer.step()  # creates the AdamW state
    store = SnapshotStore(str(workdir / "sync-save"), keep=2)
    times = []
    for step in range(repeats):
        start = time.perf_counter()
        snap = store.save(step, {"model": {k: v.clone() for k, v in model.state_dict().items()},
                                 "optimizer": optimizer.state_dict()}, {}, {"samples_seen": 0})
        times.append(time.perf_counter() - start)
    size = sum(f["bytes"] for f in snap.manifest["files"].values()) / 1e6
    return sorted(times)[len(times) // 2], size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default="gpt-micro")
    args = parser.parse_args()
    torch.set_num_threads(2)
    workdir = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    cfg = make_config(workdir, "single", args.steps, args.model)
    prepare(cfg.data)
    tokens_per_step = cfg.trainer.global_batch_size * cfg.data.block_size
    print(f"torch {torch.__version__}; {args.model}, block 128, global batch 32, {args.steps} steps; {workdir}")

    bare = bare_loop(cfg, args.steps)
    train(cfg)
    trainer = rate_from_metrics(workdir / "single", tokens_per_step)
    print(f"bare loop, 1 process x 2 threads:     {bare:9,.0f} tokens/s")
    print(f"trainer,   1 process x 2 threads:     {trainer:9,.0f} tokens/s  "
          f"(overhead {100 * (1 - trainer / bare):+.1f}%, target < 5%)")

    distributed = torchrun_rate(workdir, args.steps, args.model)
    print(f"trainer,   torchrun 2 processes x 1:  {distributed:9,.0f} tokens/s  ({distributed / trainer:.2f}x the single process)")

    blocked, size = snapshot_block_time(cfg, workdir)
    step_time = tokens_per_step / trainer
    print(f"synchronous snapshot ({size:.1f} MB): blocks training {blocked * 1000:.0f} ms "
          f"= {blocked / step_time:.1f} training steps of {step_time * 1000:.0f} ms")


if __name__ == "__main__":
    main()
