"""`mingpt-prepare`: tokenize a corpus into train/val token files, or check that prepared data is current.

See docs/data.md."""

from __future__ import annotations

import logging
from pathlib import Path

from mingpt.cli import command_parser, configure_logging, run_command, summary
from mingpt.data.corpus import BUILTIN_CORPUS
from mingpt.data.prepare import PrepareConfig, is_remote, out_dir, prepare, verify
from mingpt.data.prepared import read_meta
from mingpt.storage import redact

DEFAULTS = PrepareConfig()


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mingpt-prepare", summary(__doc__))
    parser.add_argument("--corpus", nargs="+", default=[BUILTIN_CORPUS],
                        help=f"files, folders or quoted globs, local or fsspec URLs (s3://..., hf://datasets/...): "
                             f"text, .jsonl or .parquet, .gz/.bz2/.xz/.zst; or {BUILTIN_CORPUS!r} (default)")
    parser.add_argument("--tokenizer", default=DEFAULTS.tokenizer,
                        help="char (default), bpe, a tiktoken encoding name such as gpt2, or a tokenizer folder")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size, above 256 (e.g. 4096)")
    parser.add_argument("--bpe-sample-bytes", type=int, default=DEFAULTS.bpe_sample_bytes,
                        help="bpe learns its merges from a sample of this many bytes (default 100 MB)")
    parser.add_argument("--text-field", default=DEFAULTS.text_field, help="JSONL field or Parquet column holding the text (default: text)")
    parser.add_argument("--val-fraction", type=float, default=DEFAULTS.val_fraction,
                        help="share held out for validation (default 0.1)")
    parser.add_argument("--num-workers", type=int, default=DEFAULTS.num_workers,
                        help="tokenizing processes (default 0: one per core)")
    parser.add_argument("--out", default=None,
                        help="output folder (default data/<corpus>-<tokenizer>[-<vocab>]), or an object-store URL "
                             "(s3://...) to share with other machines, which copy it instead of tokenizing")
    parser.add_argument("--local-copy", default=None,
                        help="where an --out URL is copied to on this machine (default data/copies/<name>-<hash>)")
    parser.add_argument("--verify", action="store_true",
                        help="re-read the corpus of an existing prepared folder and report what changed (exit 1)")
    args = parser.parse_args(argv)
    if args.num_workers < 0:
        parser.error("--num-workers must be >= 0")
    if args.bpe_sample_bytes <= 0:  # (data.bpe_sample_bytes, which users set, must be 1 MB at least)
        parser.error("--bpe-sample-bytes must be a positive number of bytes")
    configure_logging(logging.WARNING, "%(message)s")
    logging.getLogger("mingpt").setLevel(logging.INFO)  # our progress; other libraries' INFO is noise here
    config = PrepareConfig(
        corpus=args.corpus[0] if len(args.corpus) == 1 else args.corpus, text_field=args.text_field,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, bpe_sample_bytes=args.bpe_sample_bytes,
        num_workers=args.num_workers, val_fraction=args.val_fraction, prepared_dir=args.out,
        local_copy=args.local_copy)
    if args.verify:
        return run_command(lambda: _verify(out_dir(config)))
    return run_command(lambda: _prepare(config), interrupted="interrupted: nothing was published; the same command "
                                                             "goes on from where it stopped")


def _prepare(config: PrepareConfig) -> None:
    out = prepare(config)
    meta = read_meta(out)
    shared = f" (the local copy of {redact(config.prepared_dir)})" if is_remote(config.prepared_dir) else ""
    print(f"{out}{shared}: {meta['train_tokens']} train + {meta['val_tokens']} val tokens "
          f"({meta['dtype']}), tokenizer {meta['tokenizer']} with vocab {meta['vocab_size']}")


def _verify(out: Path) -> int:
    problems = verify(out)
    for problem in problems:
        print(problem)
    print(f"{out}: {'differs from its corpus' if problems else 'current: every source reads as prepared'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
