"""HellaSwag: the file and lm-evaluation-harness's preprocessing, scoring checked against a reference scorer run
through transformers on the exported weights, `mingpt-eval hellaswag`, the metric during training at world sizes
1 and 2, its panel in mingpt-plot, and a job offline without the file. Nothing is downloaded: the tests write
small files in HellaSwag's format."""

import json
import socket
import subprocess
import sys

import pytest
import torch

from conftest import TEXT
from launch import REPO, SMALL, env, metrics, run, standalone, train_here
from mingpt.cli import eval as eval_command
from mingpt.errors import MinGPTError
from mingpt.metrics import hellaswag, plot
from mingpt.metrics.hellaswag import Example, parse_examples, preprocess
from mingpt.metrics.scoring import Scored, Tally, encode, encode_all, score
from mingpt.tokenizers import CharTokenizer

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
        hellaswag.load_examples(str(path))
    assert eval_command.main(["hellaswag", str(char_run), "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} line 2" in err


def test_a_url_is_fetched_once_into_a_private_cache_and_checked(tmp_path, monkeypatch):
    """A URL (here file-like through fsspec's memory file system) is copied into the cache once; the copy is read
    afterwards, its digest checked where the file's is known; a planted link or a shared folder is refused."""
    import fsspec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = write_bytes(RECORDS)
    url = "memory://hellaswag/hellaswag_val.jsonl"
    fsspec.filesystem("memory").pipe(url, data)
    assert hellaswag.load_examples(url) == parse_examples(data, url)
    cached = hellaswag.cache_path(url)
    folder = cached.parent
    assert cached.read_bytes() == data and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert oct(cached.stat().st_mode & 0o777) == "0o600"
    fsspec.filesystem("memory").rm(url)
    assert len(hellaswag.load_examples(url)) == len(RECORDS)  # from the cache
    # A known URL's copy must be the known file.
    monkeypatch.setitem(hellaswag.KNOWN_SHA256, url, "0" * 64)
    with pytest.raises(MinGPTError, match="is not HellaSwag's validation file .* remove it"):
        hellaswag.load_examples(url)
    monkeypatch.delitem(hellaswag.KNOWN_SHA256, url)
    cached.unlink()
    cached.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MinGPTError, match="cannot read the cached copy"):
        hellaswag.load_examples(url)
    cached.unlink()
    folder.chmod(0o775)
    with pytest.raises(MinGPTError, match="not a folder that only this user can write"):
        hellaswag.load_examples(url)
    assert hellaswag.KNOWN_SHA256[hellaswag.PUBLIC_URL] == \
        "0aa3b88843990f3f10a97b9575c94d7b71fb2205240ba04ae4884d9e9c992588"


def test_a_server_that_never_answers_is_given_up_on_as_offline(tmp_path, monkeypatch):
    """A listening socket that accepts and never sends a byte (a stuck proxy): the fetch ends at its timeout, as
    offline, naming where to put the file, instead of holding the job's start for aiohttp's 5 minutes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(hellaswag, "FETCH_TIMEOUT_S", 1)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/hellaswag_val.jsonl"
        with pytest.raises(hellaswag.HellaSwagUnavailable, match="cannot fetch .* put the file at"):
            hellaswag.load_examples(url)


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

            def log_message(self, format, *args):
                requests.append(self.requestline)

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
