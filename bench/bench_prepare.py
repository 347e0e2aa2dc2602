"""Data preparation at scale: MB/s and peak memory, and what a prepared large corpus costs at start-up.

    python bench/bench_prepare.py                     # 64 MB, 256 MB and 1 GB; char and bpe; 1 and all workers
    python bench/bench_prepare.py --sizes 64 --startup-size 64    # a quick look

Corpora are the built-in text repeated (each copy numbered) to the size asked, in a scratch folder.
Memory is the peak summed PSS of the whole process tree (bench/pss.py), sampled every 50 ms.
Start-up: `python train/main.py trainer.max_steps=1` (start, prepared-data check, one step, one
snapshot) on a prepared corpus of --startup-size MB against the same on the built-in corpus,
each the best of 3 runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from mingpt.data.corpus import builtin_bytes  # noqa: E402
from pss import run_measured  # noqa: E402

PREPARE = str(Path(sys.executable).parent / "mingpt-prepare")


def make_corpus(path: Path, megabytes: int) -> None:
    text = builtin_bytes()
    with open(path, "wb") as f:
        copy = 0
        while f.tell() < megabytes * 1_000_000:
            f.write(f"\n\nCopy {copy} of the Python reference.\n\n".encode() + text)
            copy += 1


def prepare_once(corpus: Path, out: Path, tokenizer: str, workers: int) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    extra = ["--vocab-size", "4096"] if tokenizer == "bpe" else []
    rc, seconds, peak = run_measured([PREPARE, "--corpus", str(corpus), "--tokenizer", tokenizer, *extra,
                                      "--num-workers", str(workers), "--out", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if rc != 0:
        raise SystemExit(f"mingpt-prepare failed ({rc}) on {corpus}")
    return seconds, peak


def startup(workdir: Path, corpus_overrides: list[str], name: str) -> tuple[float, int]:
    """Best of 3: seconds and peak PSS of a one-step job on already prepared data."""
    best = (float("inf"), 0)
    for attempt in range(4):  # the first run prepares (or checks) the data and is not counted
        snap = workdir / f"snap-{name}-{attempt}"
        rc, seconds, peak = run_measured(
            [sys.executable, str(REPO / "train" / "main.py"), "trainer.max_steps=1", "trainer.eval_every=0",
             f"snapshot.dir={snap}", *corpus_overrides],
            cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if rc != 0:
            raise SystemExit(f"train/main.py failed ({rc}) for {name}")
        if attempt:
            best = min(best, (seconds, peak))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,1000", help="corpus sizes in MB (default 64,256,1000)")
    parser.add_argument("--tokenizers", default="char,bpe")
    parser.add_argument("--startup-size", type=int, default=1000, help="MB of the prepared corpus for start-up")
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-prepare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{cores} cores; scratch {workdir}")
    print(f"{'corpus':>8} {'tokenizer':>9} {'workers':>7} {'seconds':>8} {'MB/s':>6} {'peak PSS':>9} {'speed-up':>8}")
    try:
        for megabytes in [int(s) for s in args.sizes.split(",")]:
            corpus = workdir / f"corpus-{megabytes}.txt"
            make_corpus(corpus, megabytes)
            size = corpus.stat().st_size / 1e6
            for tokenizer in args.tokenizers.split(","):
                one = None
                for workers in sorted({1, cores}):
                    seconds, peak = prepare_once(corpus, workdir / "out", tokenizer, workers)
                    one = one or seconds
                    print(f"{size:>6.0f}MB {tokenizer:>9} {workers:>7} {seconds:>8.1f} {size / seconds:>6.1f} "
                          f"{peak / 1e6:>7.0f}MB {one / seconds:>7.2f}x", flush=True)
            corpus.unlink()
        corpus = workdir / "startup.txt"
        make_corpus(corpus, args.startup_size)
        builtin = startup(workdir, [f"data.prepared_dir={workdir / 'builtin-prep'}"], "builtin")
        large = startup(workdir, [f"data.corpus={corpus}", f"data.prepared_dir={workdir / 'large-prep'}"], "large")
        print(f"start-up to one step, built-in corpus: {builtin[0]:.1f} s, peak PSS {builtin[1] / 1e6:.0f} MB")
        print(f"start-up to one step, prepared {corpus.stat().st_size / 1e6:.0f} MB corpus: {large[0]:.1f} s "
              f"({large[0] / builtin[0]:.2f}x), peak PSS {large[1] / 1e6:.0f} MB ({large[1] / builtin[1]:.2f}x)")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
