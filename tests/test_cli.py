"""mingpt-prepare and mingpt-sample: bad input gets one line naming the flag, exit 2. Flags are checked
in this process (`main(argv)`); each command also runs as users type it."""

import json
import os
import subprocess
import sys

import pytest
from launch import BIN, REPO, env

from mingpt.cli import prepare, sample
from mingpt.launch import node

PREPARE = [sys.executable, "-m", "mingpt.cli.prepare"]
SAMPLE = [sys.executable, "-m", "mingpt.cli.sample"]


def command(args: list[str], cwd, **extra_env) -> tuple[int, str]:
    """Run a command line; its exit code and its output (stdout and stderr together)."""
    result = subprocess.run(args, cwd=cwd, env={**env(), **extra_env}, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


def assert_one_line_error(rc: int, text: str, *words: str) -> None:
    """Exit 2, and the whole output one line, "error: ..." with `words` in it."""
    assert rc == 2, text
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert all(w in lines[0] for w in words), text


S3_WORDS = {"forbidden": ["access denied", "credentials"], "unreachable": ["cannot reach", "AWS_ENDPOINT_URL_S3"]}


def s3_trouble(trouble: str, closed_port: int) -> dict:
    """Client environment for a foreign access key (the server answers 403) or a closed endpoint.
    One attempt: botocore's retries would only make the test slower."""
    if trouble == "forbidden":
        return {"AWS_ACCESS_KEY_ID": "AKIASOMEONEELSE", "AWS_MAX_ATTEMPTS": "1"}
    return {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{closed_port}", "AWS_MAX_ATTEMPTS": "1"}


# -- mingpt-prepare -----------------------------------------------------------------------------


@pytest.mark.parametrize("meta", [None, '{"format": "mingpt-prepared"}'], ids=["other files", "beside a meta.json"])
def test_prepare_refuses_a_folder_of_other_files_and_keeps_them(tmp_path, corpus_file, capsys, meta):
    """Files of the user's are never replaced, even beside a meta.json that says the folder is prepared data."""
    folder = tmp_path / "p"
    (folder / "docs").mkdir(parents=True)
    (folder / "docs" / "keep.txt").write_text("hi")
    if meta:
        (folder / "meta.json").write_text(meta)
    rc = prepare.main(["--corpus", str(corpus_file), "--out", str(folder)])
    assert_one_line_error(rc, capsys.readouterr().err, str(folder), "not empty", "empty or new folder", "--out")
    assert (folder / "docs" / "keep.txt").read_text() == "hi"
    assert sorted(p.name for p in folder.iterdir()) == ["docs", "meta.json"][:2 if meta else 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "p"]  # no temporary folder either


def test_a_meta_json_that_is_a_fifo_is_damaged_not_waited_on(tmp_path, corpus_file, capsys):
    folder = tmp_path / "p"
    assert prepare.main(["--corpus", str(corpus_file), "--out", str(folder), "--num-workers", "1"]) == 0
    (folder / "meta.json").unlink()
    os.mkfifo(folder / "meta.json")
    capsys.readouterr()
    assert prepare.main(["--verify", "--out", str(folder)]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "meta.json is damaged", "not a regular file")


@pytest.mark.multiproc
def test_prepare_uses_an_empty_folder_and_warns_of_a_small_bpe_vocabulary(tmp_path, corpus_file):
    folder = tmp_path / "empty"
    folder.mkdir()
    rc, text = command([*PREPARE, "--corpus", str(corpus_file), "--tokenizer", "bpe", "--vocab-size", "5000",
                        "--out", str(folder)], tmp_path)
    assert rc == 0, text
    got = json.loads((folder / "meta.json").read_text())["vocab_size"]
    assert got < 5000
    assert f"the corpus is too small for a BPE vocabulary of 5000: training stopped at {got} tokens" in text


@pytest.mark.parametrize("flags, words", [
    (["--tokenizer", "bpe", "--vocab-size", "99999999999999999999"], "at most 16777216"),  # an OverflowError traceback
    (["--tokenizer", "bpe", "--vocab-size", "300", "--bpe-sample-bytes", "0"], "--bpe-sample-bytes must be a positive"),
])
def test_prepare_refuses_sizes_out_of_range_in_one_line(tmp_path, corpus_file, capsys, flags, words):
    try:
        rc = prepare.main(["--corpus", str(corpus_file), "--out", str(tmp_path / "p"), *flags])
    except SystemExit as e:  # argparse's refusal of a flag: its usage line, then the error
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and words in err.splitlines()[-1] and "Traceback" not in err, err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("change", [{"source_sha256": []}, {"sources": [{"url": "x"}]}, {"sources": "abc"}])
def test_verify_names_a_description_whose_sources_are_not_ours(tmp_path, corpus_file, capsys, change):
    out = tmp_path / "p"
    assert prepare.main(["--corpus", str(corpus_file), "--out", str(out), "--num-workers", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, **change}))
    capsys.readouterr()
    assert_one_line_error(prepare.main(["--verify", "--out", str(out)]), capsys.readouterr().err,
                          "meta.json is damaged: its sources or their sha256")


def test_prepare_refuses_an_output_folder_inside_the_corpus_folder(tmp_path, corpus_file, capsys):
    """Its meta.json and token files would be read as corpus the next time: the tokens changed at every run."""
    (tmp_path / "books").mkdir()
    corpus_file.rename(tmp_path / "books" / "a.txt")
    rc = prepare.main(["--corpus", str(tmp_path / "books"), "--out", str(tmp_path / "books" / "prep")])
    assert_one_line_error(rc, capsys.readouterr().err, "is inside the corpus folder", "give one outside it")
    assert [p.name for p in (tmp_path / "books").iterdir()] == ["a.txt"]


@pytest.mark.parametrize("field, value", [("dtype", "uint32"), ("fingerprint", "0" * 64), ("train_tokens", -1)])
def test_a_tampered_description_is_refused_naming_the_field_not_prepared_over(tmp_path, corpus_file, capsys,
                                                                              field, value):
    out = tmp_path / "p"
    assert prepare.main(["--corpus", str(corpus_file), "--out", str(out), "--num-workers", "1"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, field: value}))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    rc = prepare.main(["--corpus", str(corpus_file), "--out", str(out), "--num-workers", "1"])
    assert_one_line_error(rc, capsys.readouterr().err, f"meta.json is damaged: its {field} is")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_preparing_other_data_into_a_link_replaces_the_link_and_leaves_nothing_beside_it(tmp_path, corpus_file):
    """The link is set aside, then removed (rmtree refuses links: `.link.stale-*` stayed for good); its target, a
    folder of the user's, is untouched."""
    assert prepare.main(["--corpus", str(corpus_file), "--out", str(tmp_path / "real"), "--num-workers", "1"]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()}
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "other.txt").write_text("other text, other characters: xyz 123\n" * 200)
    assert prepare.main(["--corpus", str(tmp_path / "other.txt"), "--out", str(tmp_path / "link"),
                         "--num-workers", "1"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "link", "other.txt", "real"]
    assert not (tmp_path / "link").is_symlink()
    assert {p.name: p.read_bytes() for p in (tmp_path / "real").iterdir()} == before


def test_a_token_file_that_is_a_link_is_damaged_never_read(tmp_path, corpus_file):
    """A train.bin linked to another file of the same size was trained on without a word."""
    from mingpt.data.prepared import DamagedData, PreparedData

    out = tmp_path / "p"
    assert prepare.main(["--corpus", str(corpus_file), "--out", str(out), "--num-workers", "1"]) == 0
    (tmp_path / "elsewhere.bin").write_bytes((out / "train.bin").read_bytes())
    (out / "train.bin").unlink()
    (out / "train.bin").symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(DamagedData, match="train.bin is not a regular file"):
        PreparedData(out)


def test_prepare_names_an_unknown_protocol(tmp_path, capsys):
    rc = prepare.main(["--corpus", "foo://x", "--out", str(tmp_path / "p")])
    assert_one_line_error(rc, capsys.readouterr().err, "foo", "--corpus")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("trouble", ["forbidden", "unreachable"])
def test_prepare_explains_an_s3_corpus_it_cannot_read(tmp_path, s3, closed_port, monkeypatch, capsys, trouble):
    (tmp_path / "c.txt").write_text("some text " * 100)
    import boto3

    boto3.client("s3", endpoint_url=s3.endpoint).upload_file(str(tmp_path / "c.txt"), s3.bucket, "c.txt")
    for name, value in s3_trouble(trouble, closed_port).items():
        monkeypatch.setenv(name, value)
    rc = prepare.main(["--corpus", f"s3://{s3.bucket}/c.txt", "--out", str(tmp_path / "p")])
    assert_one_line_error(rc, capsys.readouterr().err, f"s3://{s3.bucket}/c.txt", "--corpus", *S3_WORDS[trouble])
    assert not (tmp_path / "p").exists()


# -- mingpt-sample -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "flags, words",
    [
        (["--temperature", "nan"], ["--temperature", "finite"]),
        (["--temperature", "inf"], ["--temperature", "finite"]),
        (["--max-new-tokens", "-5"], ["--max-new-tokens", ">= 0"]),
        (["--num-samples", "0"], ["--num-samples", "positive"]),
        (["--num-samples", "-3"], ["--num-samples", "positive"]),
        (["--top-k", "0"], ["--top-k", "positive"]),
        (["--top-p", "1.5"], ["--top-p", "(0, 1]"]),
        (["--seed", "-1"], ["--seed", "[0, "]),
        (["--seed", str(2**63)], ["--seed", "[0, "]),
        (["--device", "bogus"], ["--device", "bogus", "cpu"]),
        (["--device", "cuda"], ["--device", "CUDA is not available", "--device cpu"]),
    ],
)
def test_sample_refuses_nonsense_flags(char_run, capsys, monkeypatch, flags, words):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # --device cuda is unavailable everywhere
    rc = sample.main([str(char_run), "--max-new-tokens", "5", *flags])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_line_error(rc, captured.err, *words)


@pytest.mark.multiproc
def test_sample_of_no_new_tokens_prints_the_prompt(char_run, procs):
    result = procs.run([str(BIN / "mingpt-sample"), str(char_run), "--prompt", "the cat", "--max-new-tokens", "0"],
                       "sample")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the cat\n" and result.stderr == f"# {char_run}/step-000000040 (step 40)\n"


@pytest.mark.parametrize("run", ["char_run", "bpe_run"])
def test_a_prompt_of_bytes_that_are_not_utf8_is_one_line_and_exit_2(request, run):
    """As a shell passes $'\\xff\\xfe hello': Python gives the bytes as lone surrogates, which no tokenizer can
    encode. A new Python, as users start it: the bytes reach sys.argv as they would."""
    result = subprocess.run([str(BIN / "mingpt-sample"), str(request.getfixturevalue(run)), "--prompt",
                             b"\xff\xfe hello", "--max-new-tokens", "3"], env=env(), capture_output=True, text=True,
                            timeout=120)
    assert_one_line_error(result.returncode, result.stderr, "--prompt: the text is not UTF-8: its '\\udcff' at "
                                                            "character 0 is a lone surrogate")
    assert result.stdout == ""


@pytest.mark.parametrize("trouble", ["forbidden", "unreachable"])
def test_sample_explains_an_s3_snapshot_it_cannot_read(s3, closed_port, monkeypatch, capsys, trouble):
    for name, value in s3_trouble(trouble, closed_port).items():
        monkeypatch.setenv(name, value)
    rc = sample.main([f"s3://{s3.bucket}/run"])
    assert_one_line_error(rc, capsys.readouterr().err, f"s3://{s3.bucket}/run", *S3_WORDS[trouble])


def test_a_sample_ends_where_the_model_ends_its_document(capsys):
    from types import SimpleNamespace

    import torch

    from mingpt.cli.sample import write_samples
    from mingpt.tokenizers import CharTokenizer

    tok = CharTokenizer("ab")

    class Model:  # stands in for GPT.stream: "a", "b", end-of-text, then "a" that must not be written
        def stream(self, prompt, max_new_tokens, **kwargs):
            yield from (torch.tensor([i]) for i in [0, 1, tok.eot_id, 0])

    args = SimpleNamespace(num_samples=1, prompt="a", max_new_tokens=4, temperature=1.0, top_k=None, top_p=None,
                           seed=1)
    write_samples(Model(), tok, torch.tensor([[0]]), args)
    assert capsys.readouterr().out == "aab\n"


@pytest.mark.parametrize("command", ["eval", "export", "plot", "prepare", "rendezvous", "sample", "snapshot"])
def test_every_command_says_its_version_and_shows_its_defaults(command, capsys):
    import importlib

    import mingpt

    main = importlib.import_module(f"mingpt.cli.{command}").main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"mingpt-{command} {mingpt.__version__}\n"
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "--version" in capsys.readouterr().out


def test_mingpt_train_version_is_mingpts_with_torchs_and_hydras(capsys, monkeypatch):
    import hydra

    import mingpt
    from mingpt.cli import train

    monkeypatch.setattr(sys, "argv", ["mingpt-train", "model=gpt-nano", "--version"])
    with pytest.raises(SystemExit) as done:
        train.main()
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(f"mingpt-train {mingpt.__version__} (torch ")
    assert out.endswith(f", Hydra {hydra.__version__})\n") and out.count("\n") == 1


def test_mingpt_torchrun_reads_the_scripts_config_dir_as_hydra_does(tmp_path, monkeypatch):
    """The configuration mingpt-torchrun composes before its node joins (to prepare the data) comes from the
    script's own flags too: --config-dir is a folder of the user's configs, not an override."""
    from mingpt.cli import torchrun

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)  # main sets it: undone after the test
    (tmp_path / "mine" / "data").mkdir(parents=True)
    (tmp_path / "mine" / "data" / "mine.yaml").write_text("corpus: my-corpus.txt\n")
    prepared, started = [], []
    monkeypatch.setattr(node, "prepare_data", lambda cfg: prepared.append(cfg) or tmp_path)
    monkeypatch.setattr(torchrun.run, "run", started.append)
    script = ["--config-dir", str(tmp_path / "mine"), "data=mine", "model=gpt-nano"]
    assert torchrun.main(["--standalone", "--nproc-per-node=1", str(REPO / "train" / "main.py"), *script]) == 0
    assert [cfg.data.corpus for cfg in prepared] == ["my-corpus.txt"] and prepared[0].model.name == "gpt-nano"
    assert started[0].training_script_args == script  # the script gets its flags as they were given


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--cfg=job"], ["--help"], ["--version"], ["--info"]])
def test_mingpt_torchrun_prepares_no_data_for_a_script_that_only_prints(tmp_path, monkeypatch, flags):
    """With Hydra's printing flags the workers print and end: tokenizing a corpus first took as long as preparing
    it, and a corpus that is not there made --help fail."""
    from torch.distributed import run


    monkeypatch.chdir(tmp_path)
    args = run.parse_args(["--standalone", str(REPO / "train" / "main.py"), "data.corpus=/no/such/corpus", *flags])
    node.prepare_before_joining(args, node.job_config(args))
    assert list(tmp_path.iterdir()) == []


def test_mingpt_torchrun_help_says_first_what_it_adds_to_torchrun(capsys):
    from mingpt.cli import torchrun

    with pytest.raises(SystemExit) as done:
        torchrun.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith("mingpt-torchrun: torch's torchrun") and out.index("watchdog") < out.index("usage:")
    assert torchrun._asks_for_help(["--nproc-per-node=2", "train/main.py", "--help"]) is False  # the script's


def test_the_commands_answer_help_without_importing_torch():
    """torch takes over a second to import: the commands import it once their flags are read."""
    commands = ["eval", "export", "plot", "prepare", "rendezvous", "sample", "snapshot", "train"]
    code = (f"import sys; [__import__('mingpt.cli.' + c) for c in {commands!r}]; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
    # mingpt-train's --help is Hydra's: it composes the configuration, which needs no torch either.
    code = ("import sys; sys.argv = ['mingpt-train', '--help']; from mingpt.cli import train\n"
            "try:\n    train.main()\nexcept SystemExit:\n    pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'no torch')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "recipe: gpt2-fineweb-edu" in result.stdout and result.stdout.strip().endswith("no torch")


@pytest.mark.multiproc
def test_a_non_editable_install_trains_with_mingpt_train_from_another_folder(tmp_path):
    """`pip install .` (a wheel, not editable), then `mingpt-train` in a folder without the checkout: the
    Hydra configs of train/conf come with the package."""
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(REPO)],
                   check=True, timeout=300, capture_output=True)
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300,
                   capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    installed = {**env(), "PYTHONPATH": str(site)}  # the installed copy first, before the editable checkout
    where = subprocess.run([sys.executable, "-c", "import mingpt.training.app as a; print(a.CONF_DIR)"], cwd=work,
                           env=installed, capture_output=True, text=True, check=True)
    assert where.stdout.strip().startswith(str(site))
    result = subprocess.run([str(site / "bin" / "mingpt-train"), "model=gpt-nano", "data.block_size=32",
                             "trainer.max_steps=2", "trainer.eval_every=0"], cwd=work, env=installed,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: step 2" in result.stderr and (work / "snapshots" / "run").is_dir()
