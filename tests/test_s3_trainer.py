"""Training with snapshot.dir=s3://... against a real S3 server on 127.0.0.1, with real faults."""

import json
import math
import re
import signal
import sys

import pytest
import torch

from conftest import TEXT, s3_keys
from launch import BIN, MAIN, SMALL, kill_node, latest_step, output, standalone, train_here, wait_for
from mingpt.checkpoint.store import SnapshotStore
from mingpt.errors import MinGPTError
from s3server import ACCESS_KEY, SECRET_KEY


def job(tmp_path, url, steps, every=10, extra=(), prepared=None):
    return [*SMALL, f"trainer.max_steps={steps}", f"snapshot.every={every}", f"snapshot.dir={url}",
            f"data.prepared_dir={prepared or tmp_path / 'prepared'}", *extra]


def committed_steps(s3) -> list[int]:
    return sorted(int(k.split("/")[1][5:]) for k in s3_keys(s3, "run/") if k.endswith("/manifest.json"))


def final_weights(url: str) -> dict:
    return SnapshotStore(url).latest().load_tensors("model.pt")


@pytest.mark.slow
def test_resume_from_s3_on_a_fresh_machine_is_bitwise_identical(tmp_path, procs, s3):
    """The whole job is killed, and a fresh machine resumes from S3. Both it and the uninterrupted
    reference are endless (neither ends by itself, however fast this machine is) and are compared
    at a common snapshot step, then stopped with SIGTERM. One process each: what matters is the
    machine's loss, which the tests of torchrun cover at two and more workers. The prepared data is
    shared in S3 too: the fresh machine copies it instead of tokenizing."""
    url = f"s3://{s3.bucket}/run"
    endless = ["snapshot.keep=1000"]
    shared = f"s3://{s3.bucket}/prepared"
    python = [sys.executable, MAIN]
    first = procs.start(python + job(tmp_path, url, 10**8, extra=endless, prepared=shared), "first")
    # The reference trains meanwhile: one thread each, two cores.
    reference = procs.start(python + job(tmp_path, tmp_path / "reference", 10**8, extra=endless), "reference")
    wait_for(lambda: committed_steps(s3) and committed_steps(s3)[-1] >= 20, 120, "a snapshot in S3", [first])
    kill_node(first)  # the machine is gone, with its local disk
    first.wait(timeout=30)
    compare_at = committed_steps(s3)[-1] + 20
    # Stopped once it has that step, not at the end: it would train on a core for the rest of the test.
    wait_for(lambda: latest_step(tmp_path / "reference") >= compare_at, 180, f"the reference's step {compare_at}",
             [reference])
    reference.send_signal(signal.SIGTERM)
    reference.wait(timeout=60)

    fresh = tmp_path / "fresh-machine"
    fresh.mkdir()
    args = job(fresh, url, 10**8, extra=endless, prepared=shared)  # its local copy: fresh/data/copies/...
    second = procs.start(python + args, "second", cwd=fresh)
    wait_for(lambda: committed_steps(s3)[-1] >= compare_at, 180, f"step {compare_at} in S3", [second])
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=60)
    assert re.search(r"resumed from s3://\S+/run/step-\d+", output(second))
    assert "this node claimed it" in output(first) and "published s3://" in output(first)
    assert "copied s3://" in output(second) and "this node claimed it" not in output(second)
    copies = list((fresh / "data" / "copies").iterdir())
    assert len(copies) == 1 and (copies[0] / "meta.json").is_file()

    expected = torch.load(tmp_path / "reference" / f"step-{compare_at:09d}" / "model.pt", weights_only=True)
    resumed = SnapshotStore(url).get(f"step-{compare_at:09d}").load_tensors("model.pt")
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)


def test_kill_during_an_upload_leaves_the_previous_snapshot(tmp_path, procs, s3):
    url = f"s3://{s3.bucket}/run"
    held = s3.add("PUT", r"/run/step-000000020/optimizer\.pt$", "hold")
    first = procs.start([sys.executable, MAIN] + job(tmp_path, url, 40), "first")
    wait_for(held.holding.is_set, 120, "the upload of step 20", [first])
    kill_node(first)
    first.wait(timeout=30)
    held.released.set()
    assert committed_steps(s3) == [10]
    assert any("step-000000020/model.pt" in k for k in s3_keys(s3, "run/"))  # debris from the killed save

    log = train_here(tmp_path, *job(tmp_path, url, 40))  # the same job again, in this process
    assert "resumed from" in log and "step-000000010: step 10" in log
    assert committed_steps(s3)[-1] == 40
    SnapshotStore(url).latest().verify()


def test_503s_and_cut_connections_during_a_save_are_survived(tmp_path, s3):
    url = f"s3://{s3.bucket}/run"
    s3.add("PUT", r"/step-000000010/model\.pt$", "error", count=2, status=503, code="SlowDown")
    s3.add("PUT", r"/step-000000010/optimizer\.pt$", "cut", count=2)
    s3.add("PUT", r"/step-000000010/manifest\.json$", "error", count=1, status=500, code="InternalError")
    text = train_here(tmp_path, *job(tmp_path, url, 20))
    assert "SNAPSHOT FAILED" not in text
    assert re.search(r"snapshot s3://\S+/step-000000010 committed", text)
    statuses = lambda pattern: [st for m, p, st in s3.requests if m == "PUT" and re.search(pattern, p)]
    assert statuses(r"step-000000010/model\.pt$") == [503, 503, 200]
    assert statuses(r"step-000000010/optimizer\.pt$") == [0, 0, 200]  # 0: connection cut
    assert statuses(r"step-000000010/manifest\.json$") == [500, 200]
    assert committed_steps(s3) == [10, 20]


@pytest.mark.slow
def test_saves_that_keep_failing_stop_the_job_without_committed_looking_folders(tmp_path, procs, s3):
    url = f"s3://{s3.bucket}/run"
    # A server that keeps failing every write (500: botocore retries it once, s3fs not at all; 503 SlowDown,
    # which s3fs also retries with backoff, is in the test above).
    s3.add("PUT", r"/run/step-", "error", count=math.inf, status=500, code="InternalError")
    fast_retries = "+snapshot.storage_options.config_kwargs.retries.max_attempts=2"
    proc = procs.start([sys.executable, MAIN] + job(tmp_path, url, 1000, every=5,
                                                    extra=["snapshot.max_failures=2", fast_retries]), "job")
    assert proc.wait(timeout=180) == 2
    text = output(proc)
    assert text.count("SNAPSHOT FAILED") >= 2
    assert "2 snapshots in a row could not be written" in text and "run the same command to resume" in text
    assert not [k for k in s3_keys(s3, "run/") if k.endswith("manifest.json")]
    assert SECRET_KEY not in text


def test_sigterm_under_torchrun_writes_a_final_snapshot_quickly(tmp_path, procs, s3):
    url = f"s3://{s3.bucket}/run"
    agent = procs.start(standalone(2) + job(tmp_path, url, 100000, every=100000), "job")
    wait_for(lambda: "step 20/" in output(agent), 120, "training to start", [agent])
    agent.send_signal(signal.SIGTERM)  # what SLURM or a preempting scheduler does
    agent.wait(timeout=60)
    # The workers stopped by themselves, with a snapshot, inside torchrun's shutdown window: past it, torchrun
    # would have SIGKILLed them before they could say so.
    stopped = int(re.search(r"stopped at step (\d+) on request", output(agent))[1])
    assert committed_steps(s3) == [stopped]
    SnapshotStore(url).latest().verify()


@pytest.mark.parametrize("case", ["missing bucket", "wrong credentials"])
def test_startup_storage_errors_are_clear_and_do_not_leak_secrets(tmp_path, s3, monkeypatch, caplog, case):
    url = f"s3://{s3.bucket}/run"
    if case == "missing bucket":
        url = f"s3://missing-{s3.bucket}/run"
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEY")
    with pytest.raises(MinGPTError) as refused:
        train_here(tmp_path, *job(tmp_path, url, 10))
    expected = "bucket does not exist" if case == "missing bucket" else "access denied"
    assert f"cannot write snapshots to {url}" in str(refused.value) and expected in str(refused.value)
    assert SECRET_KEY not in str(refused.value) + caplog.text
    assert not (tmp_path / "prepared").exists()  # before any data work


@pytest.mark.multiproc
def test_sample_from_an_s3_snapshot(tmp_path, s3, procs):
    url = f"s3://{s3.bucket}/run"
    # Credentials given as storage options: used, but never logged nor stored.
    options = [f"+snapshot.storage_options.key={ACCESS_KEY}", f"+snapshot.storage_options.secret={SECRET_KEY}"]
    text = train_here(tmp_path, *job(tmp_path, url, 20, extra=options))
    assert SECRET_KEY not in text
    result = procs.run([str(BIN / "mingpt-sample"), url, "--max-new-tokens", "40", "--seed", "1", "--prompt", "The "],
                       "sample")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The ") and len(result.stdout) == len("The ") + 40 + 1  # char tokens, newline
    assert f"{url}/step-000000020" in result.stderr
    store = SnapshotStore(url)
    assert store.latest().manifest["config"]["snapshot"]["storage_options"] == ["key", "secret"]  # names only
    assert SECRET_KEY.encode() not in store.fs.cat_file(f"{store.path}/step-000000020/manifest.json")
    records = [json.loads(line) for line in store.fs.cat_file(f"{store.path}/metrics.jsonl").splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [5, 10, 15, 20]  # appended in batches on S3


@pytest.mark.multiproc
def test_sigterm_during_a_slow_init_from_download_stops_before_the_download_ends(tmp_path, procs, s3, char_run):
    """model.init_from names a snapshot in S3 whose weights come slowly (the GET held): SIGTERM ends the job
    at once, with 143 and one line, not once the download is done."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for path in (char_run / "step-000000040").rglob("*"):
        if path.is_file():
            client.put_object(Bucket=s3.bucket, Key=f"pretrained/{path.relative_to(char_run)}", Body=path.read_bytes())
    held = s3.add("GET", r"/pretrained/step-000000040/model\.pt$", "hold", count=float("inf"))
    (tmp_path / "corpus.txt").write_text(TEXT)  # in the vocabulary of the run's tokenizer
    job = procs.start([sys.executable, MAIN, *SMALL, f"model.init_from=s3://{s3.bucket}/pretrained/step-000000040",
                       f"data.corpus={tmp_path / 'corpus.txt'}",
                       f"snapshot.dir={tmp_path / 'snap'}", f"data.prepared_dir={tmp_path / 'prepared'}"], "job")
    wait_for(held.holding.is_set, 120, "the download of model.pt", [job])
    job.send_signal(signal.SIGTERM)
    try:
        assert job.wait(timeout=60) == 143, output(job)[-3000:]
        # The server answers a held GET once released (below) or after its own 120 s: none was answered, so
        # the job ended while its download was still held, not once it was done.
        assert not [path for method, path, _ in s3.requests if method == "GET" and path.endswith("/model.pt")]
    finally:
        held.released.set()
    assert "interrupted (SIGTERM)" in output(job) and "Traceback" not in output(job)
