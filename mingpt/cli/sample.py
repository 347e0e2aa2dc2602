"""`mingpt-sample SNAPSHOT`: sample text from a snapshot, local or in S3, streaming it to stdout. No corpus needed.

--max-new-tokens 0 prints the prompt alone: a quick check that the snapshot loads and encodes it."""

from __future__ import annotations

import argparse
import codecs
import contextlib
import logging
import math
import signal
import sys
import threading
from typing import TYPE_CHECKING, Iterator

from mingpt.checkpoint.store import SnapshotError
from mingpt.cli import command_parser, configure_logging, run_command, summary
from mingpt.errors import ConfigError, TokenizerError

if TYPE_CHECKING:  # torch and the model are imported once the flags are read, so that --help is quick
    import torch

    from mingpt.model import GPT
    from mingpt.tokenizers import Tokenizer


def check_args(args: argparse.Namespace) -> None:
    """ConfigError naming the first flag whose value makes no sense, before anything is loaded."""
    from mingpt.training.config import MAX_SEED

    checks = [
        ("--max-new-tokens", args.max_new_tokens >= 0, "an integer >= 0 (0 prints the prompt alone)"),
        ("--num-samples", args.num_samples >= 1, "a positive integer"),
        ("--temperature", math.isfinite(args.temperature) and args.temperature >= 0,
         "a finite number >= 0 (0 picks the most likely token)"),
        ("--top-k", args.top_k is None or args.top_k >= 1, "a positive integer"),
        ("--top-p", args.top_p is None or 0.0 < args.top_p <= 1.0, "in (0, 1]"),
        ("--seed", args.seed is None or 0 <= args.seed <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
    ]
    for flag, ok, expected in checks:
        if not ok:
            raise ConfigError(f"{flag} must be {expected}; got {getattr(args, flag[2:].replace('-', '_'))}")


def pick_device(name: str) -> torch.device:
    """The torch device `--device` names (auto: a GPU where there is one); ConfigError where unknown or absent."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine (no GPU visible, or a CPU "
                          "build of torch); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s), numbered "
                          "from 0; pick one of them")
    return device


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mingpt-sample", summary(__doc__))
    parser.add_argument("snapshot", help="snapshot folder or one snapshot (local path or s3://...)")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 picks the most likely token")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="makes the output reproducible")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto: cuda where there is a GPU")
    args = parser.parse_args(argv)
    configure_logging(logging.WARNING, "%(levelname)s %(message)s")
    return run_command(lambda: sample(args))


def sample(args: argparse.Namespace) -> None:
    import torch

    from mingpt.checkpoint.load import open_model

    check_args(args)
    device = pick_device(args.device)
    snapshot, model, tokenizer = open_model(args.snapshot, device)
    try:
        prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long, device=device)
    except TokenizerError as e:  # bytes that are not UTF-8, characters a char vocabulary lacks
        raise ConfigError(f"--prompt: {e}") from None
    if prompt.numel() == 0:
        raise SnapshotError("the prompt encodes to no tokens; give a non-empty --prompt")
    print(f"# {snapshot.url} (step {snapshot.step})", file=sys.stderr)
    try:
        write_samples(model, tokenizer, prompt, args)
    except KeyboardInterrupt:
        sys.stderr.write("\n")  # "interrupted" on a line of its own, after the text cut short
        raise


@contextlib.contextmanager
def ctrl_c_flag() -> Iterator[threading.Event]:
    """Ctrl-C as a flag the sampling loop checks between tokens (a KeyboardInterrupt can be lost where it lands)."""
    flag = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def write_samples(model: GPT, tokenizer: Tokenizer, prompt: torch.Tensor, args: argparse.Namespace) -> None:
    """Stream `args.num_samples` continuations of `prompt` to stdout, each ending where the model ends its document."""
    import torch

    generator = torch.Generator(device=prompt.device)
    generator.manual_seed(args.seed if args.seed is not None else torch.seed())
    with ctrl_c_flag() as ctrl_c:
        for k in range(args.num_samples):
            if args.num_samples > 1:
                print(f"\n--- sample {k + 1} ---", flush=True)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            sys.stdout.write(args.prompt)
            for ids in model.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, generator=generator):
                if ctrl_c.is_set():
                    raise KeyboardInterrupt
                ids = ids.tolist()
                ended = tokenizer.eot_id in ids  # the model ended its document: so does the sample
                if ended:
                    ids = ids[: ids.index(tokenizer.eot_id)]
                sys.stdout.write(decoder.decode(tokenizer.decode_bytes(ids)))
                sys.stdout.flush()
                if ended:
                    break
            sys.stdout.write(decoder.decode(b"", final=True) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
