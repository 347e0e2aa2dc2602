"""Preparing Parquet shards: this project against the FineWeb GPT-2 reproductions' script, side by side.

    git clone https://github.com/karpathy/build-nanogpt /tmp/build-nanogpt     # its fineweb.py; pip install datasets
    python bench/bench_parquet.py --baseline /tmp/build-nanogpt              # 256 MB, 2 workers each
    python bench/bench_parquet.py --baseline /tmp/build-nanogpt --mb 1000    # about 1 GB

The corpus: --mb of Parquet in --shards files laid out as FineWeb-Edu's are (text beside id, url,
dump, score and other columns; pyarrow's default row groups, which hold a whole shard here),
documents of 0.5-8 KB cut from the built-in text and numbered so that none repeats.

Both sides tokenize with the same tiktoken encoding, a byte-level BPE of 8192 tokens trained here on
the built-in text (tiktoken's gpt2 vocabulary needs a download this machine cannot make), one
end-of-text per document, and --workers processes:
- this project: `mingpt-prepare --corpus DIR --tokenizer TOKENIZER/ --num-workers W`;
- the baseline: build-nanogpt's fineweb.py (from its checkout, copied into a scratch folder and never
  into this project), run with `datasets.load_dataset` pointed at the same local shards (a fresh
  HF_DATASETS_CACHE, so its Arrow conversion counts, as on a first run) and `tiktoken.get_encoding`
  returning the shared encoding; its pool has os.cpu_count() // 2 processes, so cpu_count is set to
  2 x --workers.
The token counts of the two must agree (the same work), else the bench stops.

Printed: wall seconds, tokens/s, peak summed PSS of the process tree (bench/pss.py) of each, and
this project's tokens/s over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from mingpt.data.corpus import builtin_bytes  # noqa: E402
from mingpt.tokenizers import BPETokenizer  # noqa: E402
from pss import run_measured  # noqa: E402

PREPARE = str(Path(sys.executable).parent / "mingpt-prepare")

# Runs the baseline script with its inputs pointed at ours; the placeholders are filled in by `run_baseline`.
SHIM = """
import os, runpy, sys
import datasets, tiktoken
sys.path.insert(0, {repo!r})
from mingpt.tokenizers import load_tokenizer

encoding = load_tokenizer({tokenizer!r}).encoding
load = datasets.load_dataset
datasets.load_dataset = lambda *args, **kwargs: load("parquet", data_files={shards!r}, split="train")
tiktoken.get_encoding = lambda name: encoding
os.cpu_count = lambda: {cpus}
runpy.run_path({script!r}, run_name="__main__")
"""


def make_shards(folder: Path, megabytes: int, shards: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = builtin_bytes().decode()
    rng = random.Random(0)
    folder.mkdir(parents=True)
    per_shard, number = megabytes * 1_000_000 // shards, 0
    for k in range(shards):
        docs, size = [], 0
        while size < per_shard:
            start, length = rng.randrange(len(text) - 8000), rng.randrange(500, 8000)
            docs.append(f"Document {number}.\n" + text[start : start + length])
            size, number = size + length, number + 1
        table = pa.table({
            "text": docs, "id": [f"<urn:uuid:{k}-{i}>" for i in range(len(docs))],
            "dump": ["CC-MAIN-2024-10"] * len(docs), "url": [f"https://example.org/{k}/{i}" for i in range(len(docs))],
            "date": ["2024-02-21T12:00:00Z"] * len(docs), "language": ["en"] * len(docs),
            "language_score": [0.95] * len(docs), "token_count": [len(d) // 4 for d in docs],
            "score": [3.1] * len(docs), "int_score": [3] * len(docs)})
        pq.write_table(table, folder / f"{k:03d}_00000.parquet")


def make_tokenizer(folder: Path) -> Path:
    folder.mkdir()
    BPETokenizer.train(builtin_bytes().decode(), 8192).save(str(folder / "tokenizer.json"))
    return folder


def run_ours(shards: Path, tokenizer: Path, workers: int, out: Path) -> tuple[float, int, int]:
    rc, seconds, peak = run_measured([PREPARE, "--corpus", str(shards), "--tokenizer", f"{tokenizer}/",
                                      "--num-workers", str(workers), "--out", str(out)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if rc != 0:
        raise SystemExit(f"mingpt-prepare failed ({rc})")
    meta = json.loads((out / "meta.json").read_text())
    return seconds, peak, meta["train_tokens"] + meta["val_tokens"]


def run_baseline(checkout: Path, shards: Path, tokenizer: Path, workers: int, scratch: Path) -> tuple[float, int, int]:
    scratch.mkdir()
    script = scratch / "fineweb.py"
    shutil.copy(checkout / "fineweb.py", script)  # it writes its shards beside itself
    shim = scratch / "shim.py"
    shim.write_text(SHIM.format(repo=str(REPO), tokenizer=str(tokenizer / "tokenizer.json"), cpus=2 * workers,
                                shards=sorted(str(p) for p in shards.glob("*.parquet")), script=str(script)))
    env = {**__import__("os").environ, "HF_DATASETS_CACHE": str(scratch / "hf-cache"), "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1"}
    rc, seconds, peak = run_measured([sys.executable, str(shim)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env, cwd=scratch)
    if rc != 0:
        raise SystemExit(f"the baseline failed ({rc}); is `datasets` installed (pip install datasets)?")
    tokens = sum(len(np.load(p, mmap_mode="r")) for p in (scratch / "edu_fineweb10B").glob("*.npy"))
    return seconds, peak, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of karpathy/build-nanogpt")
    parser.add_argument("--mb", type=int, default=256, help="megabytes of text in the Parquet shards")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="tokenizing processes on each side")
    args = parser.parse_args()
    if not (args.baseline / "fineweb.py").is_file():
        raise SystemExit(f"{args.baseline}/fineweb.py not found: git clone https://github.com/karpathy/build-nanogpt")
    with tempfile.TemporaryDirectory(prefix="bench-parquet-") as scratch:
        work = Path(scratch)
        make_shards(work / "shards", args.mb, args.shards)
        stored = sum(p.stat().st_size for p in (work / "shards").iterdir())
        tokenizer = make_tokenizer(work / "tokenizer")
        print(f"corpus: {args.mb} MB of text in {args.shards} Parquet shards ({stored / 1e6:.0f} MB stored); "
              f"{args.workers} workers each; BPE of 8192 tokens", flush=True)
        baseline = run_baseline(args.baseline, work / "shards", tokenizer, args.workers, work / "baseline")
        shutil.rmtree(work / "baseline" / "hf-cache", ignore_errors=True)
        ours = run_ours(work / "shards", tokenizer, args.workers, work / "ours")
        if ours[2] != baseline[2]:
            raise SystemExit(f"token counts differ: ours {ours[2]}, baseline {baseline[2]}: not the same work")
        for name, (seconds, peak, tokens) in (("build-nanogpt fineweb.py", baseline), ("mingpt-prepare", ours)):
            print(f"{name:>25}: {seconds:6.1f} s  {tokens / seconds / 1e6:5.2f} M tokens/s  peak PSS {peak / 1e6:5.0f} MB")
        print(f"tokens/s, mingpt-prepare / baseline: {baseline[0] / ours[0]:.2f}x  ({ours[2]:,} tokens each)")


if __name__ == "__main__":
    main()
