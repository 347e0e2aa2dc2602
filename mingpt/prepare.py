"""Command line: tokenize a corpus into a prepared data folder (see mingpt.data).

    python -m mingpt.prepare --corpus data/input.txt --tokenizer bpe --vocab-size 4096 --out data/mydata
"""

from __future__ import annotations

import argparse
import logging
import sys

from mingpt.corpus import BUILTIN_CORPUS
from mingpt.data import prepare, read_meta
from mingpt.errors import MinGPTError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mingpt.prepare", description="Tokenize a text corpus into train/val token files."
    )
    parser.add_argument("--corpus", default=BUILTIN_CORPUS,
                        help=f"text file path or fsspec URL (s3://...), or {BUILTIN_CORPUS!r} (default)")
    parser.add_argument("--tokenizer", default="char", help="char (default), bpe, or a tiktoken encoding name such as gpt2")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size, above 256 (e.g. 4096)")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share of tokens for validation (default 0.1)")
    parser.add_argument("--out", default=None, help="output folder (default data/<corpus>-<tokenizer>[-<vocab>])")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = prepare(args.corpus, args.tokenizer, args.vocab_size, args.out, args.val_fraction)
    except MinGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = read_meta(out)
    print(f"{out}: {meta['train_tokens']} train + {meta['val_tokens']} val tokens "
          f"({meta['dtype']}), tokenizer {meta['tokenizer']} with vocab {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
