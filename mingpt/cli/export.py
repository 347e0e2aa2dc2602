"""`mingpt-export SNAPSHOT OUT`: a snapshot's model and tokenizer as a Hugging Face GPT-2 folder."""

from __future__ import annotations

from mingpt.cli import command_parser, run_command, summary
from mingpt.storage import redact


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mingpt-export", summary(__doc__))
    parser.add_argument("snapshot", help="a snapshot folder, or a run folder (its newest snapshot), local or s3://")
    parser.add_argument("out", help="a new folder, local or s3://")
    args = parser.parse_args(argv)

    def command() -> None:
        from mingpt.interop.hf import export  # torch: imported once the flags are read, so that --help is quick

        names = export(args.snapshot, args.out)
        print(f"wrote {', '.join(names)} to {redact(args.out)}")

    return run_command(command)


if __name__ == "__main__":
    raise SystemExit(main())
