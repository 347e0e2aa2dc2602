"""Snapshot benchmark for a gpt2-sized state (124M parameters plus AdamW state, about 1.5 GB).

Measured in this one run, to local disk and to a moto S3 server on 127.0.0.1:
- a synchronous save (copy the state, serialise, checksum, write, commit) and its throughput;
- loading the newest snapshot (list, verify checksums, torch.load weights_only) and its throughput;
- with async saving, the time training is blocked per snapshot, against the synchronous save.

    python bench/bench_snapshot.py [--model gpt2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from mingpt.model import GPT, GPTConfig
from mingpt.checkpoint.store import SnapshotStore
from mingpt.checkpoint.writer import SnapshotWriter
from mingpt.training.state import to_cpu


def gpt_state(preset: str) -> tuple[GPT, torch.optim.Optimizer]:
    model = GPT(GPTConfig.from_preset(preset, vocab_size=50257, block_size=1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg and exp_avg_sq: the optimizer state is twice the model
    return model, optimizer


def copy_state(model: GPT, optimizer: torch.optim.Optimizer) -> dict:
    """What the trainer's save does in the training thread: CPU copies training cannot change."""
    return {"model": to_cpu(model.state_dict()), "optimizer": to_cpu(optimizer.state_dict())}


def measure(url: str, model: GPT, optimizer: torch.optim.Optimizer, repeats: int) -> dict:
    store = SnapshotStore(url, keep=2)
    files = {"tokenizer.json": b"{}"}  # a stand-in: the store only checks that it is there
    info = {"samples_seen": 0, "model_config": model.config.to_dict()}
    sync, load, blocked, async_total = [], [], [], []
    step = 0
    for _ in range(repeats):
        step += 1
        start = time.perf_counter()
        store.save(step, copy_state(model, optimizer), files, info)
        sync.append(time.perf_counter() - start)

        start = time.perf_counter()
        latest = store.latest()  # lists, verifies every file's checksum
        latest.load_tensors("model.pt")
        latest.load_tensors("optimizer.pt")
        load.append(time.perf_counter() - start)

        step += 1
        writer = SnapshotWriter(store, async_save=True)
        start = time.perf_counter()
        writer.save(step, copy_state(model, optimizer), files, info)
        blocked.append(time.perf_counter() - start)  # training resumes here
        writer.wait()
        async_total.append(time.perf_counter() - start)
    size = sum(f["bytes"] for f in store.latest().manifest["files"].values())
    return {"size": size, "sync": min(sync), "load": min(load), "blocked": min(blocked), "async": min(async_total)}


def report(where: str, r: dict) -> None:
    gb = r["size"] / 1e9
    print(f"{where}: {gb:.2f} GB per snapshot")
    print(f"  synchronous save {r['sync']:6.2f} s  ({gb / r['sync']:.2f} GB/s)")
    print(f"  load + verify    {r['load']:6.2f} s  ({gb / r['load']:.2f} GB/s)")
    print(f"  async: training blocked {r['blocked']:.2f} s per snapshot = {100 * r['blocked'] / r['sync']:.1f}% "
          f"of the synchronous save (target < 10%); the save completes in the background in {r['async']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, optimizer = gpt_state(args.model)
    print(f"torch {torch.__version__}, {args.model}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")

    workdir = tempfile.mkdtemp(prefix="bench-snapshot-")
    try:
        report("local disk", measure(os.path.join(workdir, "snaps"), model, optimizer, args.repeats))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    from moto.server import ThreadedMotoServer
    import boto3

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL_S3=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
    try:
        boto3.client("s3").create_bucket(Bucket="bench")
        report("S3 (moto on 127.0.0.1)", measure("s3://bench/run", model, optimizer, args.repeats))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
