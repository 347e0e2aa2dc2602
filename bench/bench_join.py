"""A node joins a running job on a large corpus shared through S3 (moto on 127.0.0.1).

    python bench/bench_join.py                      # 0.5, 1 and 2 GB (about 25 min on 2 cores)
    python bench/bench_join.py --gb 0.1 --vocab-size 1024 --bpe-sample-mb 10     # a quick look

For each corpus size (16 text files, the built-in text repeated and numbered, bpe with
--vocab-size ids):
1. prepare: `mingpt-prepare --out s3://bench/...` on an empty bucket: tokenize and publish. This is
   what a node would spend preparing the corpus itself (the publishing part is printed apart).
2. copy: the same command for a second node with its own, empty local copy: it copies and checks.
   The figure to read is prepare / copy: how much sooner a fresh node is ready.
3. join: node A (mingpt-torchrun, one worker) trains on the data with trainer.dist_timeout_s=30;
   node B, with no local data, starts once A has trained a while. Printed: B's start to its first
   step with A (world size 2), and the job's pause (A's last step alone to the first step of both).
   The job must go on: the pause must not grow with the corpus, and nothing may time out.
Afterwards the scratch folders are searched for `.*.tmp-*` debris, which must be none.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mingpt.data.corpus import builtin_bytes  # noqa: E402
from jobs import free_port, records, stop_all, wait_until  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = ["model=gpt-nano", "model.arch=gpt2", "trainer.optimizer=adamw",
         "data.block_size=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
         "trainer.log_every=1", "trainer.eval_every=0", "trainer.precision=fp32", "trainer.dist_timeout_s=30",
         "snapshot.every=1000", "trainer.max_steps=100000000"]


def make_corpus(folder: Path, gigabytes: float, files: int = 16) -> None:
    folder.mkdir(parents=True)
    text, per_file = builtin_bytes(), int(gigabytes * 1e9 / files)
    for i in range(files):
        with open(folder / f"part-{i:02d}.txt", "wb") as f:
            copy = 0
            while f.tell() < per_file:
                f.write(f"\n\nCopy {copy} of part {i} of the Python reference.\n\n".encode() + text)
                copy += 1


def timed(command: list[str], log: Path, cwd: Path) -> float:
    started = time.perf_counter()
    with open(log, "wb") as out:
        rc = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{command[0]} failed ({rc}); see {log}")
    return time.perf_counter() - started


def join(work: Path, data: list[str]) -> tuple[float, float]:
    """Seconds from node B's start to the first step of both nodes, and the job's pause."""
    port = free_port()
    rendezvous = subprocess.Popen([str(BIN / "mingpt-rendezvous"), f"--port={port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
    node = [str(BIN / "mingpt-torchrun"), "--no-live", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench-join",
            "--rdzv-conf=last_call_timeout=1,is_host=false", str(REPO / "train" / "main.py"),
            f"snapshot.dir={work / 'snap'}", *MODEL, *data]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = []
    try:
        for name in ("node-a", "node-b"):
            (work / name).mkdir()
            if name == "node-b":
                wait_until(lambda: len(records(work / "snap" / "metrics.jsonl")) >= 30, 600, "node A's steps", nodes)
            started = time.time()
            log = open(work / f"{name}.log", "wb")
            nodes.append(subprocess.Popen(node, cwd=work / name, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        both = wait_until(lambda: [r for r in records(work / "snap" / "metrics.jsonl") if r.get("world_size") == 2],
                          900, "a step of both nodes", nodes)[0]
        alone = [r for r in records(work / "snap" / "metrics.jsonl") if r["step"] < both["step"]][-1]
        return both["time"] - started, both["time"] - alone["time"]
    finally:
        stop_all([*nodes, rendezvous])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--bpe-sample-mb", type=int, default=100)
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL_S3=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                      AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    boto3.client("s3").create_bucket(Bucket="bench")
    print(f"{'corpus':>8} {'prepare s':>10} {'(publish)':>10} {'copy s':>7} {'ratio':>6} {'B to step s':>12} "
          f"{'pause s':>8} {'debris':>7}")
    try:
        for gb in args.gb:
            work = Path(tempfile.mkdtemp(prefix="bench-join-"))
            try:
                make_corpus(work / "corpus", gb)
                url = f"s3://bench/prepared-{gb}"
                settings = ["--corpus", str(work / "corpus"), "--tokenizer", "bpe", "--vocab-size", str(args.vocab_size),
                            "--bpe-sample-bytes", str(args.bpe_sample_mb * 1_000_000), "--out", url]
                prepare = timed([str(BIN / "mingpt-prepare"), *settings, "--local-copy", str(work / "first")],
                                work / "prepare.log", work)
                publish = _published_seconds(work / "prepare.log")
                copy = timed([str(BIN / "mingpt-prepare"), *settings, "--local-copy", str(work / "second")],
                             work / "copy.log", work)
                data = [f"data.corpus={work / 'corpus'}", "data.tokenizer=bpe", f"data.vocab_size={args.vocab_size}",
                        f"data.bpe_sample_bytes={args.bpe_sample_mb * 1_000_000}", f"data.prepared_dir={url}"]
                to_step, pause = join(work, data)
                debris = [p for p in work.rglob(".*.tmp-*")]
                print(f"{gb:>6g}GB {prepare:>10.1f} {publish:>10.1f} {copy:>7.1f} {prepare / copy:>5.1f}x "
                      f"{to_step:>12.1f} {pause:>8.1f} {len(debris):>7}", flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        server.stop()


def _published_seconds(log: Path) -> float:
    for line in log.read_text().splitlines():
        if "published s3://" in line:
            return float(line.rsplit(" in ", 1)[1].rstrip("s"))
    return float("nan")


if __name__ == "__main__":
    main()
