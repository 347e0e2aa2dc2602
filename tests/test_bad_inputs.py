"""Bad input from outside is one line and exit 2, never a traceback: Hugging Face model and tokenizer
folders that are truncated, garbage, mismatched or pickles (model.init_from, data.tokenizer), and
mingpt-torchrun's node counts and rendezvous endpoint. Every bad file here is a real file on disk."""

import http.server
import json
import os
import re
import socket
import subprocess
import threading

import pytest
import torch
from conftest import TEXT
from launch import BIN, MAIN, env, train_here
from torch.distributed import TCPStore

from mingpt.cli import prepare, torchrun
from mingpt.errors import ConfigError, MinGPTError, TokenizerError
from mingpt.interop import hf
from mingpt.interop.pretrained import open_pretrained
from mingpt.launch import checks
from mingpt.launch import node as launch_node
from mingpt.model import GPT, GPTConfig
from mingpt.tokenizers import BPETokenizer, CharTokenizer, huggingface, load_tokenizer_folder

MARKER = "UNPICKLED-AND-RAN-CODE"


class RunsCode:
    """What a malicious pytorch_model.bin holds: unpickling it calls print (harmless here, visible)."""

    def __reduce__(self):
        return print, (MARKER,)


def one_line(text: str) -> str:
    assert "Traceback" not in text and text.count("\n") <= 1, text
    return text.strip()


def gpt2_folder(path, vocab_size: int, n_layer: int = 2):
    """A GPT-2 folder as mingpt-export writes it (which transformers loads: see test_hf.py)."""
    path.mkdir()
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=32, n_layer=n_layer, n_head=2, n_embd=32, bias=True))
    for name, data in hf.hf_files(model, eot_id=None).items():
        (path / name).write_bytes(data)
    return path


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def truncate(path, keep: float = 0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def a_pickle_that_runs_code(folder):
    (folder / "model.safetensors").unlink()
    torch.save({"wte.weight": torch.zeros(3), "payload": RunsCode()}, folder / "pytorch_model.bin")


BAD_MODEL_FOLDERS = {
    "config.json is not JSON": (lambda f: truncate(f / "config.json"), "config.json (JSONDecodeError"),
    "config.json is not an object": (lambda f: (f / "config.json").write_text("[1, 2]"), "a JSON list, not an object"),
    "config.json lacks a size": (lambda f: edit_config(f, n_layer=None), "no whole number for n_layer"),
    "truncated safetensors": (lambda f: truncate(f / "model.safetensors"), "model.safetensors (SafetensorError"),
    "garbage safetensors": (lambda f: (f / "model.safetensors").write_bytes(b"\x07" * 100),
                            "model.safetensors (SafetensorError"),
    "more layers in config.json": (lambda f: edit_config(f, n_layer=3), "missing blocks.2."),
    "other widths in config.json": (lambda f: edit_config(f, n_embd=64), "misshapen wte.weight (50, 32), not (50, 64)"),
    "a pickle that runs code": (a_pickle_that_runs_code, "pytorch_model.bin (not tensors alone"),
}


@pytest.mark.parametrize("damage", BAD_MODEL_FOLDERS)
def test_a_bad_init_from_folder_is_one_line_naming_what_is_wrong(tmp_path, capsys, damage):
    spoil, expected = BAD_MODEL_FOLDERS[damage]
    folder = gpt2_folder(tmp_path / "gpt2", vocab_size=50)
    spoil(folder)
    with pytest.raises(MinGPTError) as raised:
        open_pretrained(str(folder), 16).load()  # what the trainer calls: the config first, the weights at start
    assert expected in one_line(str(raised.value))
    assert MARKER not in capsys.readouterr().out


def test_the_trainer_refuses_a_pickle_in_init_from_without_running_it(tmp_path, capsys):
    """In the trainer, after its tokenizer prepared the data, the weights are refused, never unpickled."""
    tokenizer = CharTokenizer.train(TEXT)
    folder = gpt2_folder(tmp_path / "gpt2", vocab_size=tokenizer.vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    a_pickle_that_runs_code(folder)
    (tmp_path / "corpus.txt").write_text(TEXT)
    with pytest.raises(MinGPTError, match="unpickling those could run code") as raised:
        train_here(tmp_path, f"model.init_from={folder}", f"data.corpus={tmp_path / 'corpus.txt'}")
    one_line(str(raised.value))
    assert MARKER not in capsys.readouterr().out


def test_the_trainer_explains_a_config_json_that_is_not_json_before_any_data_work(tmp_path):
    """Our own error (train/main.py prints those as one line and exits 2: test_app), not json's."""
    folder = gpt2_folder(tmp_path / "gpt2", vocab_size=50)
    truncate(folder / "config.json")
    with pytest.raises(MinGPTError, match=r"config.json \(JSONDecodeError"):
        train_here(tmp_path, f"model.init_from={folder}")
    assert not (tmp_path / "prepared").exists()


def hf_tokenizer_folder(path):
    """tokenizer.json, vocab.json and merges.txt of a byte-level BPE with GPT-2's split pattern."""
    path.mkdir()
    trained = BPETokenizer.train(TEXT, 300)
    for name, data in huggingface.tokenizer_files(BPETokenizer(huggingface.GPT2_PATTERN, trained.ranks),
                                                  max_length=64).items():
        (path / name).write_bytes(data)
    return path


def cut_merges_mid_line(folder):
    data = (folder / "merges.txt").read_bytes().rstrip(b"\n")
    (folder / "merges.txt").write_bytes(data[: data.rindex(b" ") + 1])  # the last line is one token


def cut_merges_at_a_line(folder):
    lines = (folder / "merges.txt").read_text().splitlines(keepends=True)
    (folder / "merges.txt").write_text("".join(lines[: len(lines) // 2]))


def slow_files_only(folder):
    (folder / "tokenizer.json").unlink()


def mingpt_tokenizer_json(folder):
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (folder / name).unlink()
    CharTokenizer.train(TEXT).save(str(folder / "tokenizer.json"))
    truncate(folder / "tokenizer.json")


BAD_TOKENIZER_FOLDERS = {
    "truncated tokenizer.json": (lambda f: truncate(f / "tokenizer.json"), "tokenizer.json (JSONDecodeError"),
    "truncated vocab.json": (lambda f: (slow_files_only(f), truncate(f / "vocab.json")), "vocab.json (JSONDecodeError"),
    "merges.txt cut at a line": (lambda f: (slow_files_only(f), cut_merges_at_a_line(f)), "merges are truncated"),
    "merges.txt cut in a line": (lambda f: (slow_files_only(f), cut_merges_mid_line(f)), "merges are truncated"),
    "merges.txt cut in a character": (lambda f: (slow_files_only(f), (f / "merges.txt").write_bytes(b"a \xc3")),
                                      "merges.txt (UnicodeDecodeError"),
    "truncated mingpt tokenizer.json": (mingpt_tokenizer_json, "tokenizer.json (JSONDecodeError"),
}


@pytest.mark.parametrize("damage", BAD_TOKENIZER_FOLDERS)
def test_a_truncated_tokenizer_folder_is_one_line_and_exit_2(tmp_path, capsys, damage):
    spoil, expected = BAD_TOKENIZER_FOLDERS[damage]
    folder = hf_tokenizer_folder(tmp_path / "tok")
    spoil(folder)
    with pytest.raises(TokenizerError) as raised:
        load_tokenizer_folder(str(folder))
    assert expected in one_line(str(raised.value))
    (tmp_path / "corpus.txt").write_text(TEXT)
    status = prepare.main(["--corpus", str(tmp_path / "corpus.txt"), "--tokenizer", str(folder),
                           "--out", str(tmp_path / "prepared")])
    assert status == 2 and expected in one_line(capsys.readouterr().err)


BAD_TORCHRUN_ARGS = [
    ["--nnodes=0"], ["--nnodes=-1"], ["--nnodes=3:1"], ["--nnodes=a"], ["--nnodes=1:2:3"],
    ["--nproc-per-node=0"], ["--nproc-per-node=-2"], ["--nproc-per-node=many"],
    ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:70000"],
    ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-conf=is_host=perhaps"],
    ["--rdzv-conf=foo"], ["--rdzv-conf=join_timeout=abc"], ["--rdzv-backend=nope"], ["--max-restarts=-1"],
    ["--rdzv-backend=static"], ["--nnodes=1", "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-backend=etcd"],
    ["--rdzv-conf=keep_alive_interval=0"], ["--rdzv-conf=keep_alive_max_attempt=0"], ["--rdzv-conf=join_timeout=0"],
    ["--nnodes=2", "--rdzv-endpoint=user:HUSH@example.invalid:29500"],
]


@pytest.mark.parametrize("args", BAD_TORCHRUN_ARGS, ids=" ".join)
def test_mingpt_torchrun_refuses_bad_counts_in_one_line(capsys, args):
    assert torchrun.main([*args, "--no-python", "true"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and args[-1].split("=")[0] in line and "HUSH" not in line


def test_a_command_as_the_training_script_without_no_python_is_one_line(capsys, tmp_path, monkeypatch):
    """torchrun ran `python mingpt-train`, in every worker: "can't open file", after the data was prepared."""
    monkeypatch.chdir(tmp_path)
    assert torchrun.main(["--standalone", "--nproc-per-node=1", "mingpt-train", "trainer.max_steps=1"]) == 2
    assert "mingpt-train is not a file; a command on the PATH, such as mingpt-train, needs --no-python" in \
        one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_mingpt_rendezvous_names_the_lighthouse_port_it_chose_when_that_is_out_of_range(capsys):
    """--port 65535 put the Lighthouse on 65536: the error named a --lighthouse-port the user never gave."""
    from mingpt.cli import rendezvous

    with pytest.raises(SystemExit) as refused:
        rendezvous.main(["--port", "65535"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--lighthouse-port must be in 1..65535, got 65536 (--port + 1: give --lighthouse-port below 65536)")


def test_live_with_no_store_at_its_endpoint_is_one_line_at_once(capsys, closed_port):
    """The endpoint is this machine's, so the check takes this node for the store's host; under --live the store is
    mingpt-rendezvous's, never the agent's: nothing there is one line (it was a traceback after 12 s)."""
    assert torchrun.main(["--live", "--nnodes=2", f"--rdzv-endpoint=127.0.0.1:{closed_port}", "--no-python",
                          "true"]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"--live: no rendezvous store answers at 127.0.0.1:{closed_port}" in line
    assert f"start mingpt-rendezvous --port {closed_port} there first" in line


@pytest.mark.multiproc
def test_without_rdzv_backend_the_agent_meets_on_c10d_where_torchruns_default_failed(tmp_path, procs):
    """torchrun's default backend, static, gave a traceback at the first rendezvous (the agent keeps a job going on
    c10d): with none named, the endpoint given is c10d's."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = procs.run([str(BIN / "mingpt-torchrun"), "--nnodes=1", "--nproc-per-node=1",
                      f"--rdzv-endpoint=127.0.0.1:{port}", "--no-python", "echo", "ran"], "agent")
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-3000:]


@pytest.mark.multiproc
def test_a_port_that_closes_each_connection_is_one_line_with_no_cpp_stack(tmp_path, procs):
    """torch's store client logs each failed try with a C++ stack trace, and one still retrying at exit aborted the
    process (status 134): one line, exit 2."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def close_each() -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            connection.close()

    threading.Thread(target=close_each, daemon=True).start()
    try:
        done = procs.run([str(BIN / "mingpt-torchrun"), "--nnodes=1", "--nproc-per-node=1",
                          f"--rdzv-endpoint=127.0.0.1:{port}", "--no-python", "true"], "agent")
    finally:
        stop.set()
        server.close()
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_line(done.stderr).startswith(f"error: --rdzv-endpoint=127.0.0.1:{port}: 127.0.0.1:{port} accepts "
                                            "connections but does not answer as a rendezvous store")


def test_an_unreachable_rendezvous_store_is_one_line_with_the_readme_check(capsys, closed_port):
    # is_host=0: this node is a client, as every node but the store's host is (the store here would be local).
    args = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{closed_port}",
            "--rdzv-conf=is_host=0,read_timeout=1", "--no-python", "true"]
    assert torchrun.main(args) == 2
    line = one_line(capsys.readouterr().err)
    assert f"no rendezvous store answers at 127.0.0.1:{closed_port}" in line
    assert f"nc -zv 127.0.0.1 {closed_port}" in line and "mingpt-rendezvous" in line


@pytest.mark.parametrize("conf, expected", [
    ("is_host=0", "accepts connections but does not answer as a rendezvous store within 2 s; 127.0.0.1:{port} "
                  "answered 'HTTP/1.0 "),
    ("", "accepts connections but does not answer as a rendezvous store within 2 s"),  # this machine hosts
    ("is_host=1", "this node is to host the rendezvous store, but port {port} is taken on this machine "
                  "(127.0.0.1:{port} answered 'HTTP/1.0 "),
], ids=["client", "host-inferred", "host-told"])
def test_a_port_that_answers_but_is_no_rendezvous_store_is_one_line_in_seconds(monkeypatch, conf, expected):
    """torch's store client, pointed at an HTTP server, waits for good whatever its timeout; and an agent that
    hosts the store, finding its port taken, becomes such a client (or, told to host, fails with a traceback)."""
    monkeypatch.setattr(checks, "STORE_ANSWER_S", 2.0)
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    port = web.server_address[1]
    try:
        # read_timeout far past pytest's timeout: ending at all, "within 2 s", is giving up on the unanswered
        # question after STORE_ANSWER_S, not waiting for torch's client nor for the rendezvous's read_timeout.
        with pytest.raises(ConfigError, match=re.escape(expected.format(port=port))):
            checks.check_endpoint(f"127.0.0.1:{port}", f"{conf},read_timeout=600".lstrip(","))
    finally:
        web.shutdown()
        web.server_close()


def test_a_rendezvous_store_already_on_the_port_is_joined_unless_this_node_was_told_to_host_it():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # a store answers at once
    checks.check_endpoint(f"127.0.0.1:{store.port}", "is_host=0,read_timeout=30")
    checks.check_endpoint(f"127.0.0.1:{store.port}", "read_timeout=30")  # another agent of this machine hosts it
    with pytest.raises(ConfigError, match=f"to host the rendezvous store, but port {store.port} is taken"):
        checks.check_endpoint(f"127.0.0.1:{store.port}", "is_host=1")
    with socket.socket() as free:  # a free port: this node will host the store there
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    checks.check_endpoint(f"127.0.0.1:{port}", "is_host=1")
    checks.check_endpoint(f"127.0.0.1:{port}", "")


def test_a_node_started_before_the_store_waits_for_it():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    starting = threading.Event()  # connections are refused until the store starts, a second from now
    stores = []

    def start_store():
        starting.set()
        stores.append(TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))

    late = threading.Timer(1.0, start_store)
    late.start()
    try:
        checks.check_endpoint(f"127.0.0.1:{port}", "is_host=0,read_timeout=30")
        assert starting.is_set()  # it returned once the store came up, not before
    finally:
        late.cancel()
        late.join()
    stores.clear()


def test_mingpt_torchrun_names_an_unresolvable_endpoint_at_once(tmp_path):
    # .invalid never resolves (RFC 2606); without DNS here, resolving fails at once all the same.
    done = subprocess.run([str(BIN / "mingpt-torchrun"), "--nnodes=1:2", "--rdzv-backend=c10d",
                           "--rdzv-endpoint=store.invalid:29500", "--rdzv-id=job", "--no-python", "true"],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    line = one_line(done.stderr)
    assert line.startswith("error: --rdzv-endpoint=store.invalid:29500: cannot resolve 'store.invalid'")
    assert "nc -zv store.invalid 29500" in line


@pytest.mark.parametrize("payload", [
    {"model": {"type": "BPE"}},  # no vocab
    {"model": {"type": "BPE", "vocab": []}},  # a list where an object belongs
    {"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"id": 1}]},  # an added token without content
    {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]}, "pre_tokenizer": {"type": "ByteLevel"}},
])
def test_a_tokenizer_json_of_another_shape_is_one_line(tmp_path, payload):
    (tmp_path / "tokenizer.json").write_text(json.dumps(payload))
    with pytest.raises(TokenizerError) as refused:
        load_tokenizer_folder(str(tmp_path) + "/")
    assert str(refused.value).startswith(str(tmp_path)) and "\n" not in str(refused.value)


def test_mingpt_torchrun_refuses_a_bad_override_before_any_agent_or_data_work(tmp_path, capsys, monkeypatch):
    """The data step before joining composes the job's configuration: a typo is one line, and nothing runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torchrun.run, "run", lambda args: pytest.fail("the agent started"))
    assert torchrun.main(["--standalone", "--nproc-per-node=1", MAIN, "+trainer.max_step=5"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: unknown setting trainer.max_step (did you mean trainer.max_steps?): "
                                "`mingpt-train --cfg job` lists every setting"]
    assert list(tmp_path.iterdir()) == []


def test_mingpt_torchrun_prepares_only_for_a_mingpt_application(tmp_path, monkeypatch):
    """Another script (no conf/config.yaml beside it) is launched as torchrun would, with no data step."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)  # main sets it: undone after the test
    script = tmp_path / "other.py"
    script.write_text("print('hello')\n")
    started = []
    monkeypatch.setattr(torchrun.run, "run", started.append)
    monkeypatch.setattr(launch_node, "prepare_data", lambda cfg: pytest.fail("prepared data for another script"))
    assert torchrun.main(["--standalone", "--nproc-per-node=1", str(script), "model=gpt-nano"]) == 0
    assert len(started) == 1 and started[0].training_script_args == ["model=gpt-nano"]


@pytest.mark.parametrize("kind", ["fifo", "zeros", "folder"])
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json"])
def test_special_files_in_a_model_or_tokenizer_folder_are_one_line_never_read(tmp_path, kind, name):
    """A FIFO would block the read for ever, /dev/zero fill the memory, a folder fail with a traceback."""
    path = tmp_path / name
    {"fifo": lambda: os.mkfifo(path), "zeros": lambda: path.symlink_to("/dev/zero"), "folder": path.mkdir}[kind]()
    with pytest.raises(MinGPTError) as refused:
        open_pretrained(str(tmp_path), 32) if name == "config.json" else load_tokenizer_folder(str(tmp_path) + "/")
    assert one_line(str(refused.value)).startswith(f"{path} is not a regular file")


def test_a_manifest_whose_model_config_outgrows_its_weights_is_refused_before_allocating(tmp_path, char_run, capsys,
                                                                                       caplog):
    """A hand-edited model_config of a trillion parameters: refused from the manifest's byte counts, never
    allocated; the run folder falls back to the snapshot before it."""
    import shutil

    from mingpt.cli import sample

    run = tmp_path / "run"
    shutil.copytree(char_run, run)
    manifest_path = run / "step-000000040" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["model_config"].update(n_layer=10_000, n_embd=4096, n_head=32)
    manifest_path.write_text(json.dumps(manifest))
    assert sample.main([str(run), "--max-new-tokens", "5", "--seed", "1"]) == 0
    assert "(step 20)" in capsys.readouterr().err
    assert "step-000000040 is damaged (the manifest's model_config describes at least 2,013," in caplog.text
    assert sample.main([str(run / "step-000000040"), "--max-new-tokens", "5"]) == 2
    assert "more than its weights'" in capsys.readouterr().err
