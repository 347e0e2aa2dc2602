"""`mingpt-snapshot list|verify URL`: each snapshot's step, time, size and state, and who holds the run.

Exit status: 0 when every snapshot is fine, 1 when one is damaged or none is committed, 2 when URL cannot be read."""

from __future__ import annotations

import logging
import re
import sys

from mingpt.checkpoint.lease import RunLease, describe
from mingpt.checkpoint.store import Listing, Snapshot, SnapshotError, SnapshotStore, step_of
from mingpt.cli import command_parser, configure_logging, run_command, summary
from mingpt.errors import MinGPTError
from mingpt.storage import explain_storage_error, redact


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("mingpt-snapshot", summary(__doc__))
    parser.add_argument("command", choices=["list", "verify"], help="list reads manifests; verify also checks every file")
    parser.add_argument("url", help="a run folder (snapshot.dir) or one of its snapshots: a local path or s3://...")
    args = parser.parse_args(argv)
    configure_logging(logging.ERROR, "%(levelname)s %(message)s")
    return run_command(lambda: show(args.url, verify=args.command == "verify"))


def show(url: str, verify: bool) -> int:
    """Print the table; the exit status."""
    try:
        store, only = _store_of(url)
        listing = store.scan()
        if only:  # one snapshot's folder: that snapshot alone
            listing = Listing([s for s in listing.committed if s.name == only],
                              [entry for entry in listing.damaged if entry[0] == only],
                              [name for name in listing.debris if name == only])
        holder = describe(RunLease(store.run, 0, "-").current())
    except MinGPTError:
        raise
    except Exception as e:
        raise MinGPTError(f"cannot read {redact(url)}: {explain_storage_error(e)}") from None
    rows = [(s.name, s.step, s.manifest.get("created", "-"), sum(f["bytes"] for f in s.manifest["files"].values()),
             _state(s, verify)) for s in listing.committed]
    rows += [(name, None, "-", None, f"damaged: {problem}") for name, problem in listing.damaged]
    rows += [(name, step_of(name), "-", None, "debris (no manifest)") for name in listing.debris]
    rows += [(name, None, "-", None, "set aside: damaged when its step was written anew; inspect or delete it")
             for name in listing.aside]
    print(f"{'snapshot':<16} {'step':>9}  {'created':<24} {'size':>10}  state")
    for name, step, created, size, state in sorted(rows):
        size_text = "-" if size is None else f"{size / 1e6:.1f}MB"
        print(f"{name:<16} {'-' if step is None else step:>9}  {created:<24} {size_text:>10}  {state}")
    print(f"# {holder}")
    if not listing.committed:
        print(f"no committed snapshot in {store.url}", file=sys.stderr)
    return 1 if not listing.committed or any(row[4].startswith("damaged") for row in rows) else 0


def _store_of(url: str) -> tuple[SnapshotStore, str | None]:
    """The store of the run folder `url`, or of the run of snapshot `url` (and its name); MinGPTError for no folder."""
    from mingpt.checkpoint.load import snapshot_store  # torch: imported once the flags are read (a quick --help)

    store = snapshot_store(url)
    if not store.fs.exists(store.path):
        raise MinGPTError(f"{redact(url)} does not exist; give a run folder (snapshot.dir) or one of its snapshots")
    if not store.fs.isdir(store.path):
        raise MinGPTError(f"{redact(url)} is a file; give a run folder (snapshot.dir) or one of its snapshots")
    parent, _, name = url.rstrip("/").rpartition("/")
    if parent and re.fullmatch(r"step-\d{9}", name):
        return snapshot_store(parent), name
    return store, None


def _state(snapshot: Snapshot, verify: bool) -> str:
    if not verify:
        return "committed"
    try:
        snapshot.verify(keep=False)
        return "verified"
    except SnapshotError as e:
        return f"damaged: {e}"


if __name__ == "__main__":
    raise SystemExit(main())
