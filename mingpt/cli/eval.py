"""`mingpt-eval hellaswag SNAPSHOT`: a snapshot's HellaSwag accuracy, scored as lm-evaluation-harness scores it.

Prints acc and acc_norm (mingpt.metrics.scoring) and the count of examples. See docs/evaluation.md."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TextIO

from mingpt.cli import command_parser, configure_logging, run_command, summary
from mingpt.errors import ConfigError, MinGPTError
from mingpt.metrics.hellaswag import PUBLIC_URL
from mingpt.storage import redact


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mingpt-eval", summary(__doc__))
    parser.add_argument("task", choices=["hellaswag"], help="the benchmark")
    parser.add_argument("snapshot", help="a run folder (its newest snapshot) or one snapshot, local or s3://")
    parser.add_argument("--data", default=PUBLIC_URL, help="HellaSwag's validation JSONL: a path or a URL")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per forward pass (each is 4 sequences)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto: cuda where there is a GPU")
    parser.add_argument("--scores", default=None, metavar="FILE",
                        help="also write each example's scores to FILE (JSONL: label, choice, choice_norm, logprobs)")
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING, "%(levelname)s %(message)s")
    return run_command(lambda: evaluate(args))


def evaluate(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    # torch and the model: imported once the flags are read, so that --help is quick
    from mingpt.checkpoint.load import open_model
    from mingpt.cli.sample import pick_device
    from mingpt.metrics.hellaswag import load_examples
    from mingpt.metrics.scoring import Tally, encode_all, score, skipped_note

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be a positive integer; got {args.batch_size}")
    device = pick_device(args.device)
    examples = load_examples(args.data, "--data")  # before the model: a wrong file is found at once
    snapshot, model, tokenizer = open_model(args.snapshot, device)
    print(f"# {snapshot.url} (step {snapshot.step})", file=sys.stderr)
    encoded, skipped = encode_all(examples, tokenizer, model.config.block_size)
    if skipped:
        print(f"# {skipped_note(skipped, len(examples), tokenizer)}", file=sys.stderr)
    if not encoded:
        raise MinGPTError(f"none of the {len(examples)} examples of {redact(args.data)} can be scored with this "
                          "snapshot's tokenizer")
    tally = Tally()
    scores_file = _open_scores(args.scores)
    try:
        with tqdm(total=len(encoded), unit="example", disable=not sys.stderr.isatty(), leave=False) as bar:
            for first in range(0, len(encoded), args.batch_size):
                for scored in score(model, encoded[first : first + args.batch_size], device):
                    tally.add(scored)
                    if scores_file:
                        scores_file.write(json.dumps({"index": scored.index, "label": scored.label,
                                                      "choice": scored.choice,
                                                      "choice_norm": scored.choice_norm,
                                                      "logprobs": scored.logprobs, "normalised": scored.normalised})
                                          + "\n")
                bar.update(min(args.batch_size, len(encoded) - first))
    finally:
        if scores_file:
            scores_file.close()
    print(f"hellaswag: {tally.count} examples | acc {tally.acc:.4f} | acc_norm {tally.acc_norm:.4f}")


def _open_scores(path: str | None) -> TextIO | None:
    if path is None:
        return None
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise MinGPTError(f"cannot write --scores {path}: {e.strerror}") from None


if __name__ == "__main__":
    raise SystemExit(main())
