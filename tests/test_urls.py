"""URLs a user gives (snapshot.dir, data.corpus, ...): credentials in them are never shown, file: URLs
mean what RFC 8089 says or are refused, and local folders derived from a URL stay in their folder."""

import sys
from pathlib import Path

import pytest

from conftest import s3_keys
from launch import MAIN, SMALL, Processes, train_here
from mingpt.cli import prepare
from mingpt.errors import MinGPTError
from mingpt.metrics.loggers import TensorBoardLogger
from mingpt.rundir import RunDir
from mingpt.storage import explain_storage_error, open_fs, redact

HUSH = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYHUSH"  # a made-up AWS secret (they may hold "/"); "HUSH" must never show


def run(procs: Processes, args: list[str], cwd: Path) -> tuple[int, str]:
    """Run a command line as a user would; its exit code and its whole output."""
    result = procs.run(args, "command", cwd)
    return result.returncode, result.stdout + result.stderr


# -- secrets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("url, shown", [
    (f"s3://AKIAKEY:{HUSH}@bucket/x", "s3://***@bucket/x"),
    ("s3://AKIAHUSH@bucket/x", "s3://***@bucket/x"),
    (f"https://user:{HUSH}@host/corpus.txt", "https://***@host/corpus.txt"),
    (f"https://host/c.txt?X-Amz-Credential=AKIAHUSH%2F&X-Amz-Signature={HUSH}&X-Amz-Security-Token=HUSH",
     "https://host/c.txt?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***"),
    ("https://acct.blob.example/c/x.txt?sv=2022&sig=HUSH", "https://acct.blob.example/c/x.txt?sv=2022&sig=***"),
    ("https://host/x?token=HUSH#part", "https://host/x?token=***#part"),
    (f"failed on file://user:{HUSH}@localhost/x, then on ftp://HUSH@h/y",
     "failed on file://***@localhost/x, then on ftp://***@h/y"),
    # A password holding "@", or "/" and "@": hidden up to its last "@", not its first.
    (f"https://user:p@ss{HUSH}@host/c.txt", "https://***@host/c.txt"),
    (f"https://user:HU/SH@{HUSH}@host/c.txt: 401", "https://***@host/c.txt: 401"),
    (f"s3://KEY:HU@SH@bucket/x and s3://K:{HUSH}@@b/y", "s3://***@bucket/x and s3://***@b/y"),
])
def test_redact_hides_credentials_anywhere_in_a_text(url, shown):
    assert redact(url) == shown


@pytest.mark.parametrize("url", ["s3://bucket/runs/a", "s3://bucket/names/me@example.com/x", "/data/a@b.txt",
                                 "https://host:8080/c.txt?versionId=3", "file:///tmp/run"])
def test_redact_leaves_urls_without_credentials_alone(url):
    assert redact(url) == url


def test_storage_errors_that_echo_a_url_are_redacted():
    error = OSError(f"GET https://u:{HUSH}@host/c.txt?X-Amz-Signature=HUSH failed: 500")
    for local in (False, True):
        assert "HUSH" not in explain_storage_error(error, local=local)
    denied = PermissionError(f"https://u:{HUSH}@host/c.txt: Forbidden")
    assert "HUSH" not in explain_storage_error(denied) and "access denied" in explain_storage_error(denied)


@pytest.mark.parametrize("url", [f"s3://AKIAKEY:{HUSH}@bucket/x", "s3://AKIAHUSH@bucket/x",
                                 "S3://AKIAKEY:HUSH@bucket/x", "s3a://K:HUSH@bucket/x"])
def test_credentials_in_an_object_store_url_are_refused_without_showing_them(url):
    """s3fs would take them for part of the bucket name, which every later message would show."""
    with pytest.raises(MinGPTError, match="credentials do not go in the URL.*AWS_ACCESS_KEY_ID") as refused:
        open_fs(url)
    assert "HUSH" not in str(refused.value) and "***@bucket/x" in str(refused.value)


@pytest.mark.parametrize("url, words", [
    ("s3:/bucket/run", "neither a path nor a URL.*did you mean s3://bucket/run"),  # a typo: it made a folder "s3:"
    ("s3://", "names no bucket"),
    ("memory://run", "gone when the process ends"),  # it said "committed" of snapshots no one could ever read
])
def test_a_snapshot_dir_that_would_not_keep_the_snapshots_is_refused_before_any_work(tmp_path, monkeypatch, url, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MinGPTError, match=words):
        train_here(tmp_path, f"snapshot.dir={url}")
    assert list(tmp_path.iterdir()) == []  # no folder named after the URL, no data prepared


def test_a_file_system_that_cannot_connect_when_made_is_one_error_without_credentials(closed_port):
    """ftp:// uses the user and password in its URL, and connects as soon as it is opened."""
    with pytest.raises(MinGPTError, match="cannot reach the storage endpoint") as refused:
        open_fs(f"ftp://user:{HUSH.replace('/', '%2F')}@127.0.0.1:{closed_port}/runs")
    assert "HUSH" not in str(refused.value) and f"ftp://***@127.0.0.1:{closed_port}/runs" in str(refused.value)
    for password in (HUSH, "HU@SH", f"HU@{HUSH}"):  # a parser would take a piece for the host, and show it
        with pytest.raises(MinGPTError, match="write each '/' in it as %2F and each '@' as %40") as refused:
            open_fs(f"ftp://user:{password}@127.0.0.1:{closed_port}/runs")
        assert "HU" not in str(refused.value) and "wJalrX" not in str(refused.value)


def test_the_trainer_refuses_an_s3_url_with_credentials_and_never_shows_them(tmp_path, s3, procs):
    """Against a live S3 server: one line, exit 2, before any data work, nothing written to the bucket."""
    url = f"s3://AKIAKEY:{HUSH}@{s3.bucket}/run"
    rc, text = run(procs, [sys.executable, MAIN, *SMALL, f"snapshot.dir={url}",
                    f"data.prepared_dir={tmp_path / 'prepared'}"], tmp_path)
    assert rc == 2, text
    assert "HUSH" not in text and f"s3://***@{s3.bucket}/run" in text and "Traceback" not in text
    assert not (tmp_path / "prepared").exists() and s3_keys(s3) == []


@pytest.mark.parametrize("setting", ["data.corpus", "data.prepared_dir", "snapshot.dir", "model.init_from"])
@pytest.mark.parametrize("password", ["HU@SH", f"HU/SH@{HUSH}"])
def test_a_password_holding_an_at_sign_is_never_shown_in_part(tmp_path, closed_port, caplog, setting, password):
    url = f"https://user:{password}@127.0.0.1:{closed_port}/x"
    overrides = {"data.prepared_dir": str(tmp_path / "prepared"), "snapshot.dir": str(tmp_path / "snap"), setting: url}
    with pytest.raises(MinGPTError) as refused:
        train_here(tmp_path, *(f"{key}={value}" for key, value in overrides.items()))
    shown = str(refused.value) + caplog.text
    assert "SH" not in shown and "***@127.0.0.1" in shown, shown


def test_mingpt_prepare_never_shows_corpus_credentials(tmp_path, closed_port, capsys, procs):
    """An s3:// corpus with credentials is refused; an https:// one (basic auth, which HTTP does use)
    fails to connect, and the client's error, which names the URL, is shown without them."""
    rc, text = run(procs, [sys.executable, "-m", "mingpt.cli.prepare", "--corpus", f"s3://AKIAKEY:{HUSH}@bucket/c.txt",
                    "--out", str(tmp_path / "p")], tmp_path)
    assert rc == 2 and text.startswith("error: ") and len(text.splitlines()) == 1, text
    assert "HUSH" not in text and "s3://***@bucket/c.txt" in text
    for url in (f"http://user:{HUSH.replace('/', '%2F')}@127.0.0.1:{closed_port}/c.txt",
                f"http://127.0.0.1:{closed_port}/c.txt?token=HUSH"):
        assert prepare.main(["--corpus", url, "--out", str(tmp_path / "p")]) == 2
        captured = capsys.readouterr()
        assert "HUSH" not in captured.out + captured.err and captured.err.startswith("error: ")


# -- file: URLs ------------------------------------------------------------------------------------


def test_file_urls_name_the_same_local_path_as_the_plain_path(tmp_path):
    folder = tmp_path / "a b"
    for url in (f"file://{folder}", f"file://localhost{folder}", f"FILE://LocalHost{folder}", f"file:{folder}",
                "file://" + str(folder).replace(" ", "%20"), f"local://{folder}"):
        fs, path = open_fs(url)
        assert (type(fs), path) == (type(open_fs(str(folder))[0]), str(folder)), url


def test_a_relative_plain_path_is_under_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_fs("runs/a")[1] == str(tmp_path / "runs" / "a")


@pytest.mark.parametrize("url, problem", [
    ("file://otherhost/data/run", "names another machine"),
    ("file://rel/run", "names another machine"),
    (f"file://user:{HUSH}@localhost/data/run", "user name or password"),
    ("file://HUSH@localhost/data/run", "user name or password"),
    ("file:relative/run", "not absolute"),
    ("file://", "not absolute"),
    ("file:///data/run?x=1", "query or fragment"),
    ("file://[bad/data", "malformed"),
])
def test_other_file_urls_are_refused_with_what_to_write_instead(url, problem, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MinGPTError) as refused:
        open_fs(url)
    message = str(refused.value)
    assert problem in message and "use file:///path or file://localhost/path" in message
    assert "HUSH" not in message and len(message.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_trainer_refuses_a_file_url_with_a_password_and_writes_nothing(tmp_path, procs):
    """It used to commit snapshots into ./user:HUSH@localhost/..."""
    work = tmp_path / "work"
    work.mkdir()
    rc, text = run(procs, [sys.executable, MAIN, *SMALL, f"snapshot.dir=file://user:{HUSH}@localhost{tmp_path}/run",
                    f"data.prepared_dir={tmp_path / 'prepared'}"], work)
    assert rc == 2, text
    assert "HUSH" not in text and "user name or password" in text and "Traceback" not in text
    assert list(work.iterdir()) == [] and not (tmp_path / "run").exists()


def test_a_run_folder_given_as_a_file_url_is_the_plain_folder(tmp_path):
    for url in (f"file://localhost{tmp_path}/run", f"file://{tmp_path}/run/", f"file:{tmp_path}/run"):
        run = RunDir(url)
        assert run.local and run.path == str(tmp_path / "run") and run.tensorboard() == str(tmp_path / "run/tensorboard")


# -- local folders derived from a URL -------------------------------------------------------------


@pytest.mark.parametrize("url, below", [
    ("s3://b/../../../x", "x"),
    ("s3://b/runs/../../../../etc", "etc"),
    ("s3://b/./runs//a/", "b/runs/a"),
    ("s3://..", ""),
])
def test_tensorboard_folder_of_an_s3_run_stays_under_tensorboard(url, below, tmp_path, monkeypatch):
    """TensorBoard appends to its files, so an object-store run keeps them in ./tensorboard/<URL without
    scheme>: ".." in the key must not lead out of it. Written for real, then looked for."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    logger = TensorBoardLogger(RunDir(url), {})
    assert Path(logger.folder) == (work / "tensorboard" / below).resolve()
    logger.start(0)
    logger.log(1, {"train_loss": 2.0})
    logger.close()
    written = [p for p in tmp_path.rglob("events.out.tfevents.*")]
    assert written and all(p.is_relative_to(work / "tensorboard") for p in written)


def test_the_prepared_folder_is_a_local_path_or_file_url_and_never_named_after_a_secret(tmp_path):
    from mingpt.data.prepare import PrepareConfig, default_out_dir, out_dir

    assert out_dir(PrepareConfig(prepared_dir=f"file://localhost{tmp_path}/p")) == tmp_path / "p"
    assert out_dir(PrepareConfig(prepared_dir=f"file:{tmp_path}/p")) == tmp_path / "p"
    with pytest.raises(MinGPTError) as e:
        out_dir(PrepareConfig(prepared_dir=f"file://other-host{tmp_path}/p"))
    assert "\n" not in str(e.value)
    # An object store's folder is copied to this machine, to a folder never named after a secret.
    copy = out_dir(PrepareConfig(prepared_dir="s3://bucket/prepared?secret_access_key=HUSH"))
    assert copy.parent == Path("data/copies") and "HUSH" not in str(copy)
    assert out_dir(PrepareConfig(prepared_dir="s3://bucket/prepared", local_copy=str(tmp_path / "c"))) == tmp_path / "c"
    named = default_out_dir("https://user:HUSH@example.invalid", "char", None)
    assert "HUSH" not in str(named) and "user" not in str(named) and named.parent == Path("data")


def test_every_log_record_of_a_command_is_redacted_tracebacks_too(capfd):
    """Libraries log URLs as they got them (a storage client's retry warning, a traceback): the
    commands' logging redacts every record at the handler, whoever logged it."""
    import logging

    from mingpt.cli import configure_logging
    from mingpt.storage import RedactingFilter

    root = logging.getLogger()
    handler = logging.StreamHandler()  # stderr, as basicConfig makes it
    root.addHandler(handler)
    try:
        configure_logging(logging.WARNING)
        configure_logging(logging.WARNING)  # twice: one filter
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
        logging.getLogger("botocore.retries").warning("retrying %s", "s3://AKIA:HUSH/abc@bucket/key")
        try:
            raise OSError("cannot open https://user:HUSH@example.invalid/corpus.txt")
        except OSError:
            logging.getLogger("fsspec").exception("failed")
    finally:
        root.removeHandler(handler)
    err = capfd.readouterr().err
    assert "HUSH" not in err and "retrying s3://***@bucket/key" in err
    assert "OSError: cannot open https://***@example.invalid/corpus.txt" in err


@pytest.mark.parametrize("url", ["simplecache::s3://AKIAXX:HUSH@bucket/x.txt",
                                 "simplecache::file://user:HUSH@localhost/tmp/x"])
def test_every_link_of_an_fsspec_chain_is_checked_for_credentials(url):
    with pytest.raises(MinGPTError) as refused:
        open_fs(url)
    assert "HUSH" not in str(refused.value) and "\n" not in str(refused.value)
