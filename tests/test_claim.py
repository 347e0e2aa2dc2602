"""The one claim primitive (mingpt.claim) on its own, over a real local folder and the tests' S3 server: exclusive
generations, the fence, release, entries that are not claims, the watch, and the machine lock."""

import json
import os
import signal
import threading
import time

import pytest

from mingpt import claim
from mingpt.claim import Files, GenerationalClaim, MachineLock
from mingpt.storage import create_exclusive, is_local, open_fs, redact, replace_atomically


def claims_at(url: str) -> GenerationalClaim:
    fs, path = open_fs(url)
    return GenerationalClaim(Files(fs, is_local(fs), create_exclusive, replace_atomically, redact), f"{path}/claims",
                             redact(url))


@pytest.fixture(params=["local", "s3"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "thing") if request.param == "local" else f"s3://{request.getfixturevalue('s3').bucket}/thing"


def test_of_claimants_at_once_exactly_one_takes_each_generation(url):
    """Eight claimants at once, each willing to take over any holder: every generation has exactly one holder,
    and each claimant ends up either holding one or told that another holds it."""
    start, taken = threading.Barrier(8), []

    def take() -> None:
        start.wait()
        taken.append(claims_at(url).take(lambda holder: True))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    generations = [c.generation for c in taken if c is not None]
    assert len(generations) == len(set(generations)) >= 1
    assert claims_at(url).newest().generation == max(generations)


def test_a_claim_is_fenced_off_by_a_newer_generation_and_never_writes_over_it(url):
    first = claims_at(url)
    held = first.take(lambda holder: True)
    assert first.overtaken() is None and first.renew() is None
    assert claims_at(url).take(lambda holder: False) is None  # the policy says no: nothing is written
    assert claims_at(url).newest().record["beat"] == 1

    second = claims_at(url)
    newer = second.take(lambda holder: holder.generation == held.generation)
    assert newer.generation == held.generation + 1
    assert first.renew() == newer and first.lost  # fenced off, and its renewal wrote nothing
    first.release()  # lost: not marked released, so the new holder's claim stands
    assert claims_at(url).newest() == newer and claims_at(url).read(held.generation)["released"] is False

    second.release()
    assert claims_at(url).newest().record["released"] is True
    assert claims_at(url).take(lambda holder: bool(holder.record["released"])).generation == newer.generation + 1


def test_a_generation_claimed_anew_after_its_file_went_is_not_the_holders(tmp_path):
    """The holder's file deleted (by hand, a bucket rule) and its number claimed by another: the token tells them
    apart, and the holder is fenced off."""
    first = claims_at(str(tmp_path))
    held = first.take(lambda holder: True)
    os.remove(first.path(held.generation))
    again = claims_at(str(tmp_path)).take(lambda holder: True)
    assert again.generation == held.generation and again.record["token"] != held.record["token"]
    assert first.overtaken() == again and first.lost


def plant(url: str, name: str, data: bytes) -> None:
    fs, path = open_fs(url)
    if is_local(fs):
        fs.makedirs(os.path.dirname(f"{path}/claims/{name}"), exist_ok=True)
    fs.pipe_file(f"{path}/claims/{name}", data)


def test_only_a_small_json_file_is_a_claim(url):
    """A file too large to read whole, an empty one, garbage, JSON nested thousands deep, another number, a
    folder: all skipped, none read whole; the next claim goes past them."""
    plant(url, "gen-000000005.json/inside", b"{}")  # a folder (on S3: a prefix)
    plant(url, "gen-000000004.json", b"")
    plant(url, "gen-000000003.json", json.dumps({"generation": 3, "pad": "x" * claim.MAX_CLAIM_BYTES}).encode())
    plant(url, "gen-000000002.json", b"\xff garbage")
    plant(url, "gen-000000001.json", json.dumps({"generation": 7}).encode())
    plant(url, "gen-000000000.json", b"[" * 30_000 + b"]" * 30_000)  # small, but nested too deeply for json
    plant(url, "notes.txt", b"hello")
    claims = claims_at(url)
    assert claims.newest() is None
    taken = 5 if url.startswith("s3://") else 6  # on S3 a prefix is no object: its name is free
    assert claims.take(lambda holder: True).generation == taken
    assert claims.newest().generation == taken


def test_a_fifo_or_a_link_in_a_local_claim_folder_is_never_read(tmp_path):
    """Reading a FIFO would block for good; a link may lead to a claim-like file another user wrote."""
    folder = tmp_path / "claims"
    folder.mkdir()
    elsewhere = tmp_path / "planted.json"
    elsewhere.write_text(json.dumps({"generation": 2, "host": "x", "pids": [], "beat": 0}))
    os.symlink(elsewhere, folder / "gen-000000002.json")
    os.mkfifo(folder / "gen-000000001.json")
    claims = claims_at(str(tmp_path))
    assert claims.newest() is None
    assert claims.take(lambda holder: True).generation == 3


def test_a_claim_of_another_policy_is_not_one_of_this(tmp_path):
    claims_at(str(tmp_path)).take(lambda holder: True, fields={"job": 1})
    strict = claims_at(str(tmp_path))
    strict.valid = lambda record: isinstance(record.get("job"), str)
    assert strict.newest() is None


def test_the_watch_is_on_this_process_clock_and_ends_at_a_change(tmp_path):
    value = ["a"]
    assert claim.stood_still(lambda: value[0], "a", 0.3, poll=0.05) is True
    threading.Timer(0.1, lambda: value.__setitem__(0, "b")).start()
    started = time.monotonic()
    assert claim.stood_still(lambda: value[0], "a", 30, poll=0.05) is False
    assert time.monotonic() - started < 25  # it ended at the change, not at the timeout
    assert claim.stood_still(lambda: value[0], "b", 30, poll=0.05, until=lambda: True) is False


def test_a_beat_renews_until_release(tmp_path):
    claims = claims_at(str(tmp_path))
    claims.take(lambda holder: True)
    claims.keep_alive(0.05, lost=lambda newer: pytest.fail("not taken over"))
    deadline = time.monotonic() + 30
    while claims_at(str(tmp_path)).newest().record["beat"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    claims.release()
    newest = claims_at(str(tmp_path)).newest().record
    assert newest["beat"] >= 2 and newest["released"] is True


def test_one_process_of_the_machine_holds_a_machine_lock_and_a_forked_child_never_does(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    first = MachineLock(folder, "preparing data in")
    assert first.acquire(wait=False) and first.held
    assert MachineLock(folder, "preparing data in").acquire(wait=False) is False

    started, ready = os.pipe()
    child = os.fork()
    if child == 0:  # holds no copy of the lock: it would keep it after its parent released it
        os.write(ready, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        assert os.read(started, 1) == b"x"  # the child runs: its fork hook is done
        first.release()
        again = MachineLock(folder, "preparing data in")
        assert again.acquire(wait=False), "a forked child kept the lock"
        again.release()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(started)
        os.close(ready)


def test_a_machine_lock_never_follows_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(OSError):
        MachineLock(tmp_path / "link", "preparing data in").acquire()
