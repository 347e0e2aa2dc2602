"""HellaSwag: the file and lm-evaluation-harness's preprocessing, scoring checked against a reference scorer run
through transformers on the exported weights, `mingpt-eval hellaswag`, the metric during training at world sizes
1 and 2, its panel in mingpt-plot, a job offline without the file, and every bad input (a folder, a line too long,
a page that is not the file, a server that never answers) refused or given up on in one line before it costs much.
Nothing is downloaded from outside: the tests write small files in HellaSwag's format and serve them on
127.0.0.1."""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
import torch
from conftest import TEXT
from launch import REPO, SMALL, env, metrics, output, run, standalone, train_here

from mingpt.cli import eval as eval_command
from mingpt.errors import MinGPTError
from mingpt.jobenv import JobEnv
from mingpt.metrics import hellaswag, plot
from mingpt.metrics.hellaswag import Example, parse_examples, preprocess
from mingpt.metrics.scoring import Scored, Tally, encode, encode_all, score
from mingpt.tokenizers import CharTokenizer
from mingpt.training import benchmark, preparation
from mingpt.training.config import TrainerConfig

# In HellaSwag's format, with WikiHow's bracketed tags, in words the shared runs' char vocabulary holds (but for
# one example: "The" has a capital its corpus lacks), one context long enough to be cut to the block's 32 positions.
RECORDS = [
    {"activity_label": "Section 3", "ctx_a": "the owl jumps over 5 lazy dogs.", "ctx_b": "naïve café owners",
     "endings": ["count 21 coins.", "jump over the fox.", "sit on the dogs.", "doesn't it?"], "label": 0},
    {"activity_label": "Section 7", "ctx_a": "[header] the fox jumps. [title] count the coins.", "ctx_b": "",
     "endings": ["[step] the cat jumps over 7 dogs.", "Naïve owls count.", "the émeu jumps.", "it is 12."],
     "label": 2},
    {"activity_label": "Section 1", "ctx_a": "the cat jumps over 40 lazy dogs, doesn't it?", "ctx_b": "the owl",
     "endings": ["jumps.", "counts 7 coins.", "is lazy.", "owns a café."], "label": 1},
    {"activity_label": "Section 12", "ctx_a": " ".join(["the émeu jumps over 9 lazy dogs."] * 6),
     "ctx_b": "naïve owls",
     "endings": ["are counted.", "jump over the owl.", "sit.", "are lazy, aren't they?"], "label": 3},
    {"activity_label": "Section 5", "ctx_a": "naïve café owners count 35 coins.", "ctx_b": "section 6",
     "endings": ["is the next one.", "counts dogs.", "jumps over the fox.", "the owl."], "label": 0,
     "split": "val", "ind": 4},
    {"activity_label": "Section 2", "ctx_a": "the fox jumps.", "ctx_b": "s",
     "endings": ["ome dogs count.", "ections end.", "o it jumps.", "at."], "label": "3"},
]


def write_data(path, records=RECORDS, tail=""):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records) + tail, encoding="utf-8")
    return path


# -- the file and its preprocessing ----------------------------------------------------------------------------------


def test_preprocessing_is_lm_evaluation_harness_s():
    assert preprocess("  a [title] How to count coins [step] one  ") == "a. How to count coins one"
    assert preprocess("[header] the fox. [title] count") == " the fox.. count"  # stripped before, as lm-eval does
    examples = parse_examples(write_bytes(RECORDS), "data")
    assert examples[0] == Example("Section 3: the owl jumps over 5 lazy dogs. Naïve café owners",
                                  ("count 21 coins.", "jump over the fox.", "sit on the dogs.", "doesn't it?"), 0)
    assert examples[1].query == "Section 7: the fox jumps.. count the coins."  # ctx_b empty: the space stripped
    assert examples[1].choices[0] == " the cat jumps over 7 dogs."  # a tag at the start leaves its space
    assert examples[5].label == 3  # Hugging Face's copy gives labels as text


def write_bytes(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.mark.parametrize("line, words", [
    ("{not json", "line 2 is not JSON"),
    ("[1, 2]", "line 2 is not a JSON object"),
    ('{"activity_label": "a", "ctx_a": "b", "endings": ["x", "y"], "label": 0}', "line 2 has no text field 'ctx_b'"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "", "endings": "xy", "label": 0}', "'endings' must be a list"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "", "endings": ["x", "y"], "label": ""}',
     "the test split's labels are hidden"),
    ('{"activity_label": "a", "ctx_a": "b", "ctx_b": "", "endings": ["x", "y"], "label": 2}', "0 to 1; got 2"),
])
def test_a_malformed_line_is_one_line_naming_it(tmp_path, capsys, line, words, char_run):
    path = write_data(tmp_path / "bad.jsonl", RECORDS[:1], tail=line + "\n")
    with pytest.raises(MinGPTError, match=words):
        hellaswag.load_examples(str(path), "--data")
    assert eval_command.main(["hellaswag", str(char_run), "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--data: {path} line 2" in err


def test_a_url_is_fetched_once_into_a_private_cache_and_checked(tmp_path, monkeypatch):
    """A URL (here file-like through fsspec's memory file system) is copied into the cache once; the copy is read
    afterwards, its digest checked where the file's is known; a planted link or a shared folder is refused."""
    import fsspec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = write_bytes(RECORDS)
    url = "memory://hellaswag/hellaswag_val.jsonl"
    fsspec.filesystem("memory").pipe(url, data)
    assert hellaswag.load_examples(url, "--data") == parse_examples(data, url)
    cached = hellaswag.cache_path(url)
    folder = cached.parent
    assert cached.read_bytes() == data and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert cached.stat().st_mode & 0o022 == 0  # no one else may write it (nor reach it: its folder is 0700)
    fsspec.filesystem("memory").rm(url)
    assert len(hellaswag.load_examples(url, "--data")) == len(RECORDS)  # from the cache
    # A known URL's copy must be the known file.
    monkeypatch.setitem(hellaswag.KNOWN_SHA256, url, "0" * 64)
    with pytest.raises(MinGPTError, match="is not HellaSwag's validation file .* remove it"):
        hellaswag.load_examples(url, "--data")
    monkeypatch.delitem(hellaswag.KNOWN_SHA256, url)
    cached.unlink()
    cached.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MinGPTError, match="cannot read the cached copy"):
        hellaswag.load_examples(url, "--data")
    cached.unlink()
    folder.chmod(0o775)
    with pytest.raises(MinGPTError, match="not a folder that only this user can write"):
        hellaswag.load_examples(url, "--data")
    assert hellaswag.KNOWN_SHA256[hellaswag.PUBLIC_URL] == \
        "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"


# -- bad input: refused in one line naming the setting, or given up on, before it costs much --------------------------


@pytest.fixture
def raw_server():
    """raw_server(answer) -> (the URL of a server on 127.0.0.1, the connections it accepted): `answer(connection,
    stop)` talks to each in a thread of its own. Afterwards every socket is shut and every thread joined."""
    stop = threading.Event()
    sockets, threads = [], []

    def start(answer):
        listener = socket.create_server(("127.0.0.1", 0))
        sockets.append(listener)
        connections = []

        def accept():
            while True:
                try:
                    connection, _ = listener.accept()
                except OSError:  # shut at the end
                    return
                sockets.append(connection)
                connections.append(connection)
                spawn(answer, connection, stop)

        spawn(accept)
        return f"http://127.0.0.1:{listener.getsockname()[1]}/hellaswag_val.jsonl", connections

    def spawn(target, *args):
        threads.append(threading.Thread(target=target, args=args, daemon=True))
        threads[-1].start()

    yield start
    stop.set()
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept, recv or send on it
        except OSError:
            pass
        s.close()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in threads)


def never_answers(connection, stop):
    """A stuck proxy: the connection is accepted, and not one byte comes back."""
    stop.wait()


def drips(connection, stop):
    """A server that answers at once, then sends its body a byte at a time, forever: each read gets a byte in time."""
    connection.recv(65536)
    try:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/jsonl\r\n\r\n")
        while not stop.wait(0.05):
            connection.sendall(b" ")
    except OSError:  # the client gave up
        pass


def never_ends(connection, stop):
    """A server whose body has no end and no length."""
    connection.recv(65536)
    try:
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/jsonl\r\n\r\n")
        while not stop.is_set():
            connection.sendall(b"x" * 65536)
    except OSError:  # the client has read enough
        pass


def test_a_folder_or_a_fifo_is_one_line_naming_the_setting(tmp_path, capsys, char_run):
    """mingpt-eval --data DIR (or a FIFO, or nothing there): one line naming --data, exit 2, no traceback."""
    folder = tmp_path / "hellaswag"
    folder.mkdir()
    os.mkfifo(tmp_path / "fifo")
    for path, what in ((folder, "is a folder"), (tmp_path / "fifo", "is not a regular file"),
                       (tmp_path / "missing.jsonl", "cannot read")):
        assert eval_command.main(["hellaswag", str(char_run), "--data", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: --data: ") and str(path) in err and what in err, err
        assert "Traceback" not in err


def test_a_training_job_refuses_a_folder_in_one_line_before_its_data_work(tmp_path, procs):
    """trainer.hellaswag_data=DIR: in the job (train/main.py) and in mingpt-torchrun's agent, one line naming the
    setting, before the corpus is prepared."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    folder = tmp_path / "hellaswag"
    folder.mkdir()
    settings = [f"data.corpus={tmp_path / 'corpus.txt'}", "trainer.hellaswag_every=1",
                f"trainer.hellaswag_data={folder}"]
    with pytest.raises(MinGPTError, match=f"^trainer.hellaswag_data: {folder} is a folder; give HellaSwag's"):
        train_here(tmp_path, *settings)
    agent = procs.start([*standalone(1), *SMALL, *settings, f"snapshot.dir={tmp_path / 'snap'}",
                         f"data.prepared_dir={tmp_path / 'prepared'}"], "agent")
    assert agent.wait(timeout=120) == 2
    lines = [line for line in output(agent).splitlines() if "trainer.hellaswag_data" in line]
    assert len(lines) == 1 and f"{folder} is a folder" in lines[0] and "Traceback" not in output(agent)
    assert not (tmp_path / "prepared").exists()


def test_a_line_too_long_is_refused_by_its_characters_before_it_is_parsed(tmp_path, capsys, char_run):
    """An example with a 20 MB ending: refused at MAX_LINE_CHARS characters (a line of that many is an example),
    with no more of it decoded: the memory it takes stays far below the line's size."""
    limit = hellaswag.MAX_LINE_CHARS
    record = dict(RECORDS[0], endings=["a", "b"], label=0)
    padding = limit - len(json.dumps(dict(record, ctx_a=""), ensure_ascii=False))
    exactly = dict(record, ctx_a="é" * padding)  # the limit in characters, not bytes
    assert len(json.dumps(exactly, ensure_ascii=False)) == limit
    data = write_data(tmp_path / "at-the-limit.jsonl", [exactly]).read_bytes()
    assert parse_examples(data, "data")[0].query.endswith("é" * padding + " Naïve café owners")
    over = dict(exactly, ctx_a="é" * (padding + 1))
    with pytest.raises(MinGPTError, match=f"data line 1 is longer than {limit:,} characters"):
        parse_examples(write_data(tmp_path / "over.jsonl", [over]).read_bytes(), "data")

    huge = write_data(tmp_path / "huge.jsonl", [RECORDS[0], dict(record, endings=["a", "b" * (20 << 20)])])
    data = huge.read_bytes()
    tracemalloc.start()
    try:
        with pytest.raises(MinGPTError, match="line 2 is longer than"):
            parse_examples(data, "data")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # the line is 20 MB
    assert eval_command.main(["hellaswag", str(char_run), "--data", str(huge)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --data: {huge} line 2 is longer than {limit:,} characters: not a HellaSwag example; " \
                  f"{hellaswag.GIVE_THE_FILE}\n"


def test_a_file_larger_than_the_limit_is_read_no_further(tmp_path, monkeypatch, raw_server):
    """A local file, or a URL whose body never ends: MAX_BYTES are read, and it is refused as not HellaSwag's."""
    monkeypatch.setattr(hellaswag, "MAX_BYTES", 1 << 20)
    big = write_data(tmp_path / "big.jsonl", RECORDS * 3000)
    assert big.stat().st_size > 2 << 20
    with pytest.raises(MinGPTError, match=f"^--data: {big} is larger than 1 MB: not HellaSwag's"):
        hellaswag.load_examples(str(big), "--data")
    url, _ = raw_server(never_ends)
    with pytest.raises(MinGPTError, match="^--data: the file at .* is larger than 1 MB") as refused:
        hellaswag.load_examples(url, "--data")
    assert not isinstance(refused.value, hellaswag.HellaSwagUnavailable)  # a mistake, not a network to wait for
    assert not list(hellaswag.cache_folder().glob(f"*{hellaswag.cache_path(url).name[:12]}*"))


@pytest.mark.parametrize("answer", [never_answers, drips])
def test_a_fetch_is_given_up_on_at_one_deadline_for_all_its_requests(tmp_path, monkeypatch, raw_server, answer):
    """A server that never answers (a stuck proxy), or answers a byte at a time: the whole fetch ends at
    FETCH_TIMEOUT_S, as offline, after one request, naming where to put the file; nothing is cached."""
    monkeypatch.setattr(hellaswag, "FETCH_TIMEOUT_S", 2)
    url, connections = raw_server(answer)
    started = time.monotonic()
    with pytest.raises(hellaswag.HellaSwagUnavailable, match="^--data: cannot fetch .* \\(not done within 2 s\\); "
                                                            "put the file at"):
        hellaswag.load_examples(url, "--data")
    assert time.monotonic() - started < 2 + 20
    assert len(connections) == 1
    assert not hellaswag.cache_path(url).exists()
    assert not list(hellaswag.cache_folder().glob(f".{hellaswag.cache_path(url).name}.*"))


def test_an_object_store_s_fetch_is_given_up_on_at_the_deadline(s3, monkeypatch):
    """s3://: fetched and cached like any URL; a GET held by the server is cancelled at FETCH_TIMEOUT_S."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint)
    client.put_object(Bucket=s3.bucket, Key="hellaswag_val.jsonl", Body=write_bytes(RECORDS))
    client.put_object(Bucket=s3.bucket, Key="held.jsonl", Body=write_bytes(RECORDS))
    fetched = f"s3://{s3.bucket}/hellaswag_val.jsonl"
    try:
        assert len(hellaswag.load_examples(fetched, "--data")) == len(RECORDS)
        assert hellaswag.cache_path(fetched).read_bytes() == write_bytes(RECORDS)
        monkeypatch.setattr(hellaswag, "FETCH_TIMEOUT_S", 2)
        held = s3.add("GET", r"/held\.jsonl$", "hold", count=float("inf"))
        url = f"s3://{s3.bucket}/held.jsonl"
        started = time.monotonic()
        with pytest.raises(hellaswag.HellaSwagUnavailable, match="not done within 2 s"):
            hellaswag.load_examples(url, "--data")
        assert time.monotonic() - started < 2 + 20 and held.hits >= 1
        assert not hellaswag.cache_path(url).exists()
    finally:
        hellaswag.cache_path(fetched).unlink(missing_ok=True)


def test_only_what_parsed_is_cached_and_a_bad_cached_copy_is_named(tmp_path, served):
    """A URL that serves an HTML page: refused, naming the URL, and nothing kept; once the server serves the file,
    it is fetched and cached. A cached copy that does not parse is named, with how to have it fetched again."""
    page = tmp_path / "hellaswag_val.jsonl"
    page.write_text("<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n")
    url, requests = served(page)
    cached = hellaswag.cache_path(url)
    with pytest.raises(MinGPTError, match=f"^--data: the file fetched from {url} line 1 is not JSON .* it is not "
                                          "kept"):
        hellaswag.load_examples(url, "--data")
    assert not cached.exists() and not list(cached.parent.glob(f".{cached.name}.*"))
    write_data(page)  # the server fixed
    assert len(hellaswag.load_examples(url, "--data")) == len(RECORDS)
    assert cached.read_bytes() == page.read_bytes() and len(requests) == 2
    cached.write_text("<html>\n")
    with pytest.raises(MinGPTError, match=f"^--data: the cached copy {cached} line 1 is not JSON .*; remove it, and "
                                          f"it is fetched again from {url}$"):
        hellaswag.load_examples(url, "--data")
    cached.unlink()
    assert len(hellaswag.load_examples(url, "--data")) == len(RECORDS) and len(requests) == 3


def test_the_agent_fetches_once_for_its_node_and_its_workers_read_its_copy(tmp_path, served, closed_port, caplog):
    """mingpt-torchrun's agent fetches the file (preparation.fetch_hellaswag); its workers read its copy and
    request nothing. Where the agent could not fetch it, it warns once, and its workers neither fetch nor warn."""
    url, requests = served(write_data(tmp_path / "hellaswag_val.jsonl"))
    job = TrainerConfig(hellaswag_every=5, hellaswag_data=url)
    worker = JobEnv(hellaswag_fetched=preparation.fetch_hellaswag(job))  # as the agent tells its workers
    assert worker.hellaswag_fetched == "cached" and len(requests) == 1
    assert len(benchmark.read_hellaswag(job, worker)) == len(RECORDS) and len(requests) == 1
    hellaswag.cache_path(url).unlink()  # gone after the agent fetched it: the workers say so, and fetch nothing
    with caplog.at_level(logging.WARNING, logger="mingpt"):
        assert benchmark.read_hellaswag(job, worker) is None
    assert len(requests) == 1 and f"has no copy at {hellaswag.cache_path(url)}" in caplog.text
    caplog.clear()

    offline = TrainerConfig(hellaswag_every=5, hellaswag_data=f"http://127.0.0.1:{closed_port}/hellaswag_val.jsonl")
    with caplog.at_level(logging.INFO, logger="mingpt"):
        worker = JobEnv(hellaswag_fetched=preparation.fetch_hellaswag(offline))
        assert benchmark.read_hellaswag(offline, worker) is None
    assert worker.hellaswag_fetched == "unavailable"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.startswith("trainer.hellaswag_data: cannot fetch") and "goes on without the HellaSwag" in warning


# -- scoring ---------------------------------------------------------------------------------------------------------


def test_the_score_is_the_sum_of_the_continuation_s_log_probabilities_and_acc_norm_divides_by_characters():
    tok = CharTokenizer("abc :")
    example = Example("a: b", ("c", "ab ca"), label=1)
    encoded = encode(example, tok, block_size=6)
    # The query's tokens, then " c" / " ab ca": the windows are cut on the left to block_size + 1 tokens.
    assert encoded.continuation_tokens == (2, 6)
    assert encoded.windows[0] == tuple(tok.encode("a: b c")) and encoded.windows[1] == tuple(tok.encode("b ab ca"))
    assert encoded.lengths == (1, 5)
    assert encode(Example("a: b", ("c", "x"), 0), tok, 6) is None  # a character the vocabulary lacks
    assert encode(Example("a", ("abcabcab",), 0), tok, 6) is None  # an ending longer than the block

    class Uniform(torch.nn.Module):
        """The same log-probability for every token: a choice's score is its token count times that."""

        def forward(self, idx):
            return torch.zeros(*idx.shape, tok.vocab_size), None

    [scored] = score(Uniform(), [encoded], torch.device("cpu"))
    per_token = torch.log(torch.tensor(1 / tok.vocab_size)).item()
    assert scored.logprobs == pytest.approx((2 * per_token, 6 * per_token))
    assert scored.normalised == pytest.approx((2 * per_token, 6 * per_token / 5))
    assert (scored.choice, scored.choice_norm) == (0, 1)
    tally = Tally()
    tally.add(scored)
    tally.add(Scored((0.0, 0.0), (0.0, 0.0), 0, 1))  # a tie goes to the first choice, as numpy's argmax
    assert (tally.correct, tally.correct_norm, tally.count) == (1, 2, 2)


def reference_scores(folder, examples: list[Example]) -> list[tuple[int, int, list[float]]]:
    """lm-evaluation-harness's loglikelihood for each choice, one sequence at a time, with transformers' GPT-2 and
    the exported tokenizer: (choice, choice_norm, normalised scores) of each example."""
    import transformers

    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    positions = model.config.n_positions
    found = []
    for example in examples:
        sums = []
        for choice in example.choices:
            context = tok.encode(example.query)
            continuation = tok.encode(example.query + " " + choice)[len(context):]
            window = (context + continuation)[-(positions + 1):][:-1]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([window])).logits[0], dim=-1)
            tail = logprobs[len(window) - len(continuation):]
            sums.append(tail.gather(1, torch.tensor(continuation)[:, None]).sum().item())
        normalised = [s / len(c) for s, c in zip(sums, example.choices)]
        found.append((max(range(len(sums)), key=sums.__getitem__), max(range(len(sums)), key=normalised.__getitem__),
                      normalised))
    return found


@pytest.mark.parametrize("run", ["bpe_run", "char_run"])
def test_mingpt_eval_chooses_as_the_reference_scorer_on_the_exported_weights(tmp_path, request, capsys, run):
    pytest.importorskip("transformers")
    from mingpt.cli import export

    snap = request.getfixturevalue(run)
    data = write_data(tmp_path / "hellaswag_val.jsonl")
    examples = parse_examples(data.read_bytes(), "data")
    scores = tmp_path / "scores.jsonl"
    if run == "bpe_run":  # as users type it, once
        done = subprocess.run([sys.executable, "-m", "mingpt.cli.eval", "hellaswag", str(snap), "--data", str(data),
                               "--batch-size", "4", "--scores", str(scores)], env={**env(), "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        out = done.stdout
    else:
        assert eval_command.main(["hellaswag", str(snap), "--data", str(data), "--scores", str(scores)]) == 0
        captured = capsys.readouterr()
        out = captured.out
        assert "1 of 6 examples skipped" in captured.err  # "The": a capital the char corpus lacks
    ours = [json.loads(line) for line in scores.read_text().splitlines()]
    tally = Tally(sum(s["choice"] == s["label"] for s in ours), sum(s["choice_norm"] == s["label"] for s in ours),
                  len(ours))
    assert out == f"hellaswag: {len(ours)} examples | acc {tally.acc:.4f} | acc_norm {tally.acc_norm:.4f}\n"
    assert len(ours) == (6 if run == "bpe_run" else 5)

    assert export.main([str(snap), str(tmp_path / "exported")]) == 0
    reference = reference_scores(tmp_path / "exported", [examples[s["index"]] for s in ours])
    assert [(s["choice"], s["choice_norm"]) for s in ours] == [(choice, norm) for choice, norm, _ in reference]
    for mine, (_, _, normalised) in zip(ours, reference):
        assert mine["normalised"] == pytest.approx(normalised, rel=1e-5, abs=1e-5)
    # Batched and one at a time agree (padding on the right changes nothing).
    from mingpt.checkpoint.load import load_model, open_snapshot

    model, tok = load_model(open_snapshot(str(snap)), torch.device("cpu"))
    encoded, _ = encode_all(examples, tok, model.config.block_size)
    one_by_one = [score(model, [e], torch.device("cpu"))[0] for e in encoded]
    flat = lambda rows: [x for row in rows for x in row]
    assert flat(s.logprobs for s in one_by_one) == pytest.approx(flat(s["logprobs"] for s in ours), rel=1e-5)


# -- during training -------------------------------------------------------------------------------------------------


@pytest.fixture
def served():
    """serve(path) -> (the URL of `path` on an HTTP server on 127.0.0.1, the request lines it answered); the
    copies fetched into the machine's cache are removed afterwards."""
    import http.server
    import threading

    servers, urls = [], []

    def serve(path):
        requests = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(path.parent), **kwargs)

            def log_request(self, code="-", size="-"):
                requests.append(self.requestline)

            def log_message(self, format, *args):  # (an error is logged twice: its request above, and here)
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.server_address[1]}/{path.name}")
        return urls[-1], requests

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()
    for url in urls:
        hellaswag.cache_path(url).unlink(missing_ok=True)


def hellaswag_records(snap) -> dict[int, tuple]:
    return {m["step"]: (m["hellaswag_acc"], m["hellaswag_acc_norm"], m["hellaswag_examples"]) for m in metrics(snap)
            if "hellaswag_acc" in m}


@pytest.mark.slow
@pytest.mark.multiproc
def test_training_scores_hellaswag_every_n_steps_alike_at_world_sizes_1_and_2_and_plots_it(tmp_path, procs,
                                                                                          served):
    """Two processes (torchrun, the model sharded) and one train the same job with the metric on; every N steps
    and at the end each logs the same accuracies over all the examples (to metrics.jsonl and TensorBoard), and
    mingpt-plot draws the panel. Not in tokens/s: the progress record after one counts its time apart (other_s; no
    snapshot, no val loss in between). The file comes from a URL: mingpt-torchrun fetches it once for its node,
    before it joins, and its workers and the other job read that copy."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "corpus.txt").write_text(TEXT)
    # 17 examples, batches of 1 at micro-batch 4: 9 and 8 under fsdp, where the second process runs one more
    # (its forward is a collective) that counts nothing.
    write_data(tmp_path / "hellaswag_val.jsonl", (RECORDS * 3)[:17])
    url, requests = served(tmp_path / "hellaswag_val.jsonl")
    settings = [f"data.corpus={tmp_path / 'corpus.txt'}", f"data.prepared_dir={tmp_path / 'prepared'}",
                "data.tokenizer=bpe", "data.vocab_size=300", "trainer.max_steps=12", "snapshot.every=100",
                "trainer.hellaswag_every=5", f"trainer.hellaswag_data={url}"]
    two = run(procs, standalone(2), [*SMALL, *settings, f"snapshot.dir={tmp_path / 'two'}",
                                     "trainer.loggers=[jsonl,tensorboard]", "trainer.parallelism=fsdp"], "two")
    assert "is in this machine's cache" in two.split("joining the job")[0]  # fetched before the node joined
    fetched = list(requests)
    text = train_here(tmp_path, *settings, f"snapshot.dir={tmp_path / 'one'}")
    assert requests == fetched and [line.split()[0] for line in fetched].count("GET") == 1, requests  # one fetch
    one, two = hellaswag_records(tmp_path / "one"), hellaswag_records(tmp_path / "two")
    assert sorted(one) == [5, 10, 12] and one == two
    assert all(count == 17 for _, _, count in one.values())
    assert next(m for m in metrics(tmp_path / "one") if m["step"] == 10 and "train_loss" in m)["other_s"] > 0
    assert f"step 12 | hellaswag acc_norm {one[12][1]:.4f} | acc {one[12][0]:.4f} | 17 examples" in text
    board = EventAccumulator(str(tmp_path / "two" / "tensorboard"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("eval/hellaswag_acc_norm")] == \
        [(step, pytest.approx(values[1])) for step, values in sorted(two.items())]

    from mingpt.cli import plot as plot_command

    assert plot_command.main([str(tmp_path / "two"), "-o", str(tmp_path / "loss.png")]) == 0
    drawn = plot.figure(plot.curves(plot.read_records(str(tmp_path / "two"))), "run", plot.pyplot())
    panel = drawn.axes[1]
    assert panel.get_ylabel() == "hellaswag"
    assert [tuple(xy) for xy in panel.lines[0].get_xydata()] == [(s, two[s][1]) for s in sorted(two)]
    assert panel.lines[1].get_ydata()[0] == plot.GPT2_124M_ACC_NORM


def test_offline_without_the_file_a_job_says_where_to_put_it_in_one_line_and_trains(tmp_path, closed_port,
                                                                                      monkeypatch):
    """A URL that cannot be reached (a closed port on this machine: nothing leaves it) and no copy in the cache: one
    warning line naming the cache path, and the job trains to the end without the metric."""
    monkeypatch.setattr(hellaswag, "cache_folder", lambda: tmp_path / "cache")  # (not XDG_CACHE_HOME: MFU's probe)
    (tmp_path / "corpus.txt").write_text(TEXT)
    url = f"http://127.0.0.1:{closed_port}/hellaswag_val.jsonl"
    text = train_here(tmp_path, f"data.corpus={tmp_path / 'corpus.txt'}", "trainer.max_steps=3",
                      "trainer.hellaswag_every=1", f"trainer.hellaswag_data={url}")
    warnings = [line for line in text.splitlines() if "HellaSwag" in line]
    assert len(warnings) == 1 and f"put the file at {hellaswag.cache_path(url)}" in warnings[0], warnings
    assert str(tmp_path / "cache") in warnings[0] and "training goes on without the HellaSwag metric" in warnings[0]
    assert not hellaswag_records(tmp_path / "snap") and max(m["step"] for m in metrics(tmp_path / "snap")) == 3


@pytest.mark.slow
@pytest.mark.multiproc
def test_under_mingpt_torchrun_a_file_that_cannot_be_had_is_one_request_and_one_warning(tmp_path, procs, served):
    """A URL that answers 404: mingpt-torchrun's agent asks once for its node, before it joins, and warns once; its
    two workers ask nothing and say nothing, and train to the end without the metric."""
    (tmp_path / "corpus.txt").write_text(TEXT)
    url, requests = served(tmp_path / "hellaswag_val.jsonl")  # no such file
    text = run(procs, standalone(2), [*SMALL, f"data.corpus={tmp_path / 'corpus.txt'}",
                                      f"data.prepared_dir={tmp_path / 'prepared'}", f"snapshot.dir={tmp_path / 'snap'}",
                                      "trainer.max_steps=3", "trainer.hellaswag_every=1",
                                      f"trainer.hellaswag_data={url}"], "job")
    warnings = [line for line in text.splitlines() if "HellaSwag" in line]
    assert len(warnings) == 1 and "trainer.hellaswag_data: cannot fetch" in warnings[0], warnings
    assert warnings[0] in text.split("joining the job")[0] and len(requests) == 1, requests
    assert not hellaswag_records(tmp_path / "snap") and max(m["step"] for m in metrics(tmp_path / "snap")) == 3
