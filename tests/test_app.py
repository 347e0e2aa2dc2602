"""The Hydra application (train/main.py): bad configuration and input, Ctrl-C, and its own output.

Checks of values and inputs run in this process: Hydra composes the configuration from train/conf
as main.py does, and the trainer raises the error that main.py prints as one line. The command
itself runs once per kind of outcome: a bad value, a value of the wrong type (both exit 2), multirun,
and Ctrl-C."""

import json
import math
import re
import signal
import subprocess
import sys

import pytest
import torch
from hydra.errors import HydraException

from launch import MAIN, SMALL, assert_equal_weights, config, env, latest_step, manifests, output, train_here, wait_for
from mingpt.checkpoint.store import SnapshotError
from mingpt.errors import ConfigError, DataError, MinGPTError


def app(tmp_path, *overrides):
    """`python train/main.py SMALL OVERRIDES`, as a user runs it."""
    args = [sys.executable, MAIN, *SMALL, f"snapshot.dir={tmp_path / 'snap'}",
            f"data.prepared_dir={tmp_path / 'prepared'}", *overrides]
    return subprocess.run(args, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)


def one_line(error: BaseException) -> str:
    """The error's message, which main.py prints as the one line of its output."""
    message = str(error)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.max_steps=abc", ["trainer.max_steps", "abc"]),
        ("trainer.lr=-1", ["trainer.lr must be positive"]),
        ("snapshot.keep=1", ["snapshot.keep must be at least 2"]),
        ("trainer.precision=fp8", ["trainer.precision must be auto, fp32, bf16 or fp16"]),
        ("data.tokenizer=bpe", ["data.vocab_size must be an integer above 256"]),
        ("model.n_head=5", ["n_embd=48 is not divisible by n_head=5"]),
        ("model.arch=llama", ["model.arch must be one of gpt2, modern; got 'llama'"]),
        ("model.mlp=swiglu", ["model.mlp one of gelu, relu2", "mlp='swiglu'"]),
        ("trainer.optimizer=sgd", ["trainer.optimizer must be adamw or muon; got 'sgd'"]),
        ("trainer.muon_lr=0", ["trainer.muon_lr must be positive; got 0.0"]),
        ("trainer.muon_momentum=1", ["trainer.muon_momentum must be in [0, 1); got 1.0"]),
        ("trainer.muon_weight_decay=-0.1", ["trainer.muon_weight_decay must be >= 0"]),
        ("trainer.muon_lr=nan", ["trainer.muon_lr must be a finite number"]),
        ("trainer.no_such_key=1", ["no_such_key"]),
        ("model=gpt-huge", ["gpt-huge", "gpt-mini"]),
        ("trainer.lr=inf", ["trainer.lr must be a finite number"]),
        ("model.dropout=nan", ["model.dropout must be a finite number"]),
        ("seed=-1", ["seed must be an integer in [0, "]),
        (f"seed={2**63}", ["seed must be an integer in [0, "]),
        ("snapshot.lease_timeout_s=0", ["snapshot.lease_timeout_s must be"]),
        # Past int64, or past what torch's timedelta holds: a traceback in every worker.
        (f"trainer.max_steps={10**23}", [f"trainer.max_steps must be at most {2**63 - 1}"]),
        (f"trainer.dist_timeout_s={10**14}", ["trainer.dist_timeout_s must be a positive number of seconds, at most"]),
        # Hydra's `+` adds keys the schema lacks; misspelt, they would be ignored.
        ("+trainer.max_step=50", ["unknown setting trainer.max_step (did you mean trainer.max_steps?)"]),
        ("+snapshot.every_n=5", ["unknown setting snapshot.every_n (did you mean snapshot.every?)"]),
        ("+zzz=1", ["unknown setting zzz:"]),
        ("++model.n_layers=3", ["unknown setting model.n_layers (did you mean model.n_layer?)"]),
        # Without `+`: the same words, where Hydra's own error took seven lines and advised `+`.
        ("trainer.max_step=50", ["unknown setting trainer.max_step (did you mean trainer.max_steps?)"]),
        ("model=gpt-nanoo", ["model=gpt-nanoo is no model option (did you mean gpt-nano?): the options are"]),
        ("data=python-doc", ["data=python-doc is no data option (did you mean python-docs?)"]),
        ("~trainer.lr", ["~trainer.lr: settings cannot be deleted"]),
        ("trainer.lr.x=1", ["unknown setting trainer.lr.x:"]),
        # A byte that is not UTF-8, as Python gives it from a command line: Hydra's parser said LexerNoViableAlt.
        ("data.corpus=caf\udce9.txt", ["the setting 'data.corpus=caf\\udce9.txt' is not UTF-8 text: its '\\udce9' "
                                       "at character 15 is a lone surrogate"]),
        # Hydra settings that moved relative snapshot folders under another, or wrote Hydra's output beside them.
        ("hydra.job.chdir=true", ["the application keeps hydra.job.chdir as it is"]),
        ("hydra.run.dir=elsewhere", ["the application keeps hydra.run.dir as it is"]),
    ],
)
def test_bad_config_is_refused_naming_the_key(override, words):
    with pytest.raises((ConfigError, HydraException)) as refused:
        config(*SMALL, override)
    assert all(w in str(refused.value) for w in words), refused.value


@pytest.mark.parametrize("parallelism", ["fsdp", "hsdp"])
def test_muon_with_a_sharded_model_is_refused_in_one_line_before_any_work(parallelism):
    """Each process would orthogonalise its shard of a matrix, not the matrix (auto: test_fsdp)."""
    with pytest.raises(ConfigError) as refused:
        config(*SMALL, "trainer.optimizer=muon", f"trainer.parallelism={parallelism}")
    assert one_line(refused.value) == (
        "trainer.parallelism must be auto or ddp with trainer.optimizer=muon: Muon orthogonalises whole matrices, "
        "which fsdp and hsdp shard (use trainer.optimizer=adamw to shard the model); got " + repr(parallelism))


@pytest.mark.multiproc
def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2_before_any_work(tmp_path):
    result = app(tmp_path, "trainer.lr=-1")
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.splitlines() == [result.stderr.strip()], result.stderr
    assert result.stderr.rstrip() == "error: trainer.lr must be positive; got -1.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no snapshot folder, no data, no Hydra output
    probe = "import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", probe, MAIN, "trainer.lr=-1"], cwd=tmp_path,
                            env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and not re.search(r"\|\s+torch$", result.stderr, re.M)  # nor torch's start-up


@pytest.mark.multiproc
def test_a_typo_in_a_setting_is_one_line_with_the_closest_match_and_exit_2(tmp_path):
    """With `+` or `++` too: test_bad_config_is_refused_naming_the_key."""
    result = app(tmp_path, "trainer.max_step=30")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == ["error: unknown setting trainer.max_step (did you mean trainer.max_steps?): "
                                          "`mingpt-train --cfg job` lists every setting"]
    assert "+" not in result.stderr.split("error: ", 1)[1] and sorted(tmp_path.iterdir()) == []


def test_the_gpt2_fineweb_edu_recipe_is_gpt2_124m_with_half_a_million_tokens_a_step_and_stays_overridable():
    cfg = config("recipe=gpt2-fineweb-edu", "trainer.max_steps=100", "data.corpus=/copy/*.parquet")
    shape = cfg.model.build(50257, cfg.data.block_size)
    assert (shape.n_layer, shape.n_head, shape.n_embd) == (12, 12, 768)
    assert cfg.model.build(50257, cfg.data.block_size).block_size == 1024 and cfg.data.tokenizer == "gpt2"
    assert cfg.trainer.global_batch_size * cfg.data.block_size == 524_288
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.trainer.weight_decay) == (6e-4, 700, 0.1)
    assert cfg.trainer.max_steps == 100 and cfg.data.corpus == "/copy/*.parquet"  # given after the recipe
    assert abs(config("recipe=gpt2-fineweb-edu").trainer.max_steps * 524_288 - 10e9) < 524_288  # decay to 10B tokens
    with pytest.raises(ConfigError, match=r"recipe=gpt2-fineweb is no recipe option \(did you mean gpt2-fineweb-edu"):
        config("recipe=gpt2-fineweb")


def test_the_small_presets_train_todays_recipe_and_the_published_gpts_gpt2s_unless_told_otherwise():
    """Unset, model.arch is the preset's, and trainer.optimizer Muon for a modern model trained from scratch under
    ddp (auto too): the default job is modern + Muon, which reaches a lower loss in its time (docs/benchmarks.md)."""
    def recipe(*overrides: str) -> tuple[str, str]:
        cfg = config(*overrides)
        return cfg.model.build(65, 32).arch, cfg.trainer.optimizer

    assert recipe() == recipe("model=gpt-mini") == recipe("trainer.parallelism=ddp") == ("modern", "muon")
    assert recipe("model=gpt2") == recipe("model=openai-gpt") == recipe("model.arch=gpt2") == ("gpt2", "adamw")
    assert recipe("trainer.parallelism=fsdp") == recipe("trainer.optimizer=adamw") == ("modern", "adamw")
    assert recipe("model=gpt2", "model.arch=modern") == ("modern", "muon")
    assert config("model.init_from=/some/gpt2").trainer.optimizer == "adamw"  # the weights' architecture, unknown yet


def test_the_gpt2_muon_recipe_is_gpt2_124m_modern_with_muon_at_half_a_million_tokens_a_step():
    cfg = config("recipe=gpt2-muon-fineweb-edu")
    shape = cfg.model.build(50257, cfg.data.block_size)
    assert (shape.n_layer, shape.n_head, shape.n_embd, shape.arch) == (12, 12, 768, "modern")
    assert cfg.trainer.optimizer == "muon" and cfg.trainer.global_batch_size * cfg.data.block_size == 524_288
    assert cfg.trainer.parallelism in ("auto", "ddp") and cfg.data.tokenizer == "gpt2"


@pytest.mark.parametrize("before", [True, False])
def test_group_options_and_settings_on_the_command_line_win_over_the_recipe(before):
    """Before the recipe or after it: what the command line says wins over what the recipe says."""
    mine = ["model=gpt-nano", "data=python-docs-bpe", "trainer.lr=1e-3", "snapshot.every=7"]
    cfg = config(*(mine + ["recipe=gpt2-fineweb-edu"] if before else ["recipe=gpt2-fineweb-edu"] + mine))
    assert cfg.model.name == "gpt-nano" and cfg.model.build(300, 32).n_layer == 3
    assert cfg.data.tokenizer == "bpe" and cfg.data.corpus == "python-docs"
    assert (cfg.trainer.lr, cfg.snapshot.every) == (1e-3, 7)
    assert cfg.trainer.warmup_steps == 700  # the rest is the recipe's


def test_the_users_own_config_folder_is_searched_for_options(tmp_path):
    """--config-dir (or hydra.searchpath) adds the user's own group options, and groups; the typo check knows
    them, and the configuration composed before Hydra starts (mingpt-torchrun's) reads the flag as Hydra does."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mine.yaml").write_text("corpus: mine.txt\n")
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "tiny.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 7\n")
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "seeded.yaml").write_text("# @package _global_\nseed: 5\n")
    for flags in (["--config-dir", str(tmp_path)], [f"-cd={tmp_path}"], [f"hydra.searchpath=[file://{tmp_path}]"]):
        cfg = config(*flags, "data=mine", "recipe=tiny", "+extra=seeded")
        assert (cfg.data.corpus, cfg.trainer.max_steps, cfg.seed) == ("mine.txt", 7, 5)
    with pytest.raises(ConfigError, match="data=mines is no data option .did you mean mine.*python-docs"):
        config("--config-dir", str(tmp_path), "data=mines")
    with pytest.raises(ConfigError, match="data=mine is no data option"):
        config("data=mine")  # without the folder


@pytest.mark.multiproc
def test_a_value_of_the_wrong_type_or_a_users_yaml_that_is_not_yaml_is_one_line_and_exit_2(tmp_path):
    """Hydra's own errors took 5-90 lines and exit 1."""
    (tmp_path / "mine" / "data").mkdir(parents=True)
    (tmp_path / "mine" / "data" / "broken.yaml").write_text("corpus: [unclosed\n")
    for args, words in [(["trainer.max_steps=abc"], "trainer.max_steps=abc: Value 'abc' of type 'str' could not be "
                                                    "converted to Integer"),
                        (["--config-dir", str(tmp_path / "mine"), "data=broken"], "broken.yaml"),
                        (["+model=gpt-nano"], "model appears more than once")]:
        result = app(tmp_path, *args)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and words in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_unwritable_snapshot_dir_is_reported_before_the_data_work(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(SnapshotError) as refused:
        train_here(tmp_path, f"snapshot.dir={tmp_path / 'a-file' / 'snaps'}")
    assert "cannot write snapshots to" in one_line(refused.value) and "snapshot.dir" in str(refused.value)
    assert not (tmp_path / "prepared").exists()


def test_missing_corpus_is_reported(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        train_here(tmp_path, f"data.corpus={tmp_path / 'nope.txt'}")


def test_snapshot_of_another_model_shape_is_refused(tmp_path):
    train_here(tmp_path, "trainer.max_steps=5")
    with pytest.raises(SnapshotError) as refused:
        train_here(tmp_path, "trainer.max_steps=10", "model=gpt-micro")
    message = one_line(refused.value)
    assert "different model" in message and "n_layer=3 (config asks for 4)" in message
    assert "new snapshot.dir" in message
    assert latest_step(tmp_path / "snap") == 5  # nothing overwritten


def test_snapshot_of_another_tokenizer_is_refused(tmp_path):
    # Two corpora with the same number of distinct characters: same shapes, other vocabularies.
    (tmp_path / "one.txt").write_text("abcdefgh " * 300)
    (tmp_path / "two.txt").write_text("stuvwxyz " * 300)
    train_here(tmp_path, "trainer.max_steps=5", f"data.corpus={tmp_path / 'one.txt'}")
    with pytest.raises(SnapshotError, match="another tokenizer"):
        train_here(tmp_path, "trainer.max_steps=10", f"data.corpus={tmp_path / 'two.txt'}")


@pytest.mark.parametrize("override", ["data.corpus=foo://x", "snapshot.dir=foo://x"])
def test_unknown_protocol_is_one_line(tmp_path, override):
    with pytest.raises(MinGPTError) as refused:
        train_here(tmp_path, override)
    message = one_line(refused.value)
    assert "foo" in message and override.split("=")[0] in message


@pytest.mark.parametrize("trouble", ["forbidden", "unreachable"])
def test_s3_corpus_it_cannot_read_is_one_line(tmp_path, s3, closed_port, monkeypatch, trouble):
    from test_cli import S3_WORDS, s3_trouble

    for name, value in s3_trouble(trouble, closed_port).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MinGPTError) as refused:
        train_here(tmp_path, f"data.corpus=s3://{s3.bucket}/corpus.txt")
    words = [f"cannot list the corpus s3://{s3.bucket}/corpus.txt (data.corpus", *S3_WORDS[trouble]]
    assert all(w in one_line(refused.value) for w in words), refused.value
    assert not (tmp_path / "prepared").exists()


@pytest.mark.parametrize("tampered", ["tokenizer", "tokenizer and meta"])
def test_tokenizer_smaller_than_the_data_is_a_data_error(tmp_path, corpus_file, tampered):
    from mingpt.data.prepare import PrepareConfig, prepare
    from mingpt.tokenizers import CharTokenizer

    prepared = prepare(PrepareConfig(corpus=str(corpus_file), prepared_dir=tmp_path / "prepared"))
    CharTokenizer(list("ab")).save(str(prepared / "tokenizer.json"))  # 3 ids (end-of-text too); the data uses more
    if tampered == "tokenizer and meta":  # now only the ids themselves show it
        meta = json.loads((prepared / "meta.json").read_text())
        (prepared / "meta.json").write_text(json.dumps({**meta, "vocab_size": 3, "eot_id": 2}))
    with pytest.raises(DataError) as refused:
        train_here(tmp_path, f"data.corpus={corpus_file}", "trainer.max_steps=5")
    words = ["vocabulary of 3 but the data was prepared with"] if tampered == "tokenizer" \
        else ["beyond the tokenizer's vocabulary of 3"]
    assert all(w in one_line(refused.value) for w in [*words, "prepare the data again"]), refused.value


def test_prepared_dir_of_other_files_is_refused_and_kept(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep.txt").write_text("hi")
    with pytest.raises(DataError) as refused:
        train_here(tmp_path, f"data.prepared_dir={folder}")
    message = one_line(refused.value)
    assert f"{folder} is not empty" in message and "data.prepared_dir" in message and "empty or new folder" in message
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


def test_global_batch_smaller_than_the_world_is_explained_before_any_work(tmp_path, monkeypatch):
    """As torchrun starts the first of two workers: refused before the lease, the data or the process group."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="trainer.global_batch_size=1 cannot be served by 2 processes"):
        train_here(tmp_path, "trainer.global_batch_size=1", "trainer.micro_batch_size=1")
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_finishes_the_step_and_snapshots(tmp_path, procs):
    job = procs.start([sys.executable, MAIN, *SMALL, "model=gpt-micro", "trainer.max_steps=100000",
                       "snapshot.every=10", f"snapshot.dir={tmp_path / 'snap'}"], "job")
    wait_for(lambda: latest_step(tmp_path / "snap") >= 10, 120, "the first snapshot", [job])
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=60) == 0, output(job)
    stopped = int(re.search(r"stopped at step (\d+) on request", output(job))[1])
    assert manifests(tmp_path / "snap")[-1]["step"] == stopped  # a snapshot of the very step it stopped at


def test_multirun_is_refused(capsys):
    from mingpt.cli.train import refuse_multirun as refuse  # what the command runs before Hydra starts

    for flag in ["-m", "--multirun", "hydra.mode=MULTIRUN"]:
        with pytest.raises(SystemExit) as stopped:
            refuse([flag, "seed=1,2"])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and flag in err and "one command per setting" in err
    refuse(["seed=1", "trainer.max_steps=2"])  # no multirun: nothing to say


@pytest.mark.multiproc
def test_multirun_on_the_command_line_writes_nothing(tmp_path):
    result = subprocess.run([sys.executable, MAIN, "-m", "seed=1,2", "trainer.max_steps=2"], cwd=tmp_path, env=env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: -m (Hydra multirun)"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_second_ctrl_c_ends_at_once_with_one_line(tmp_path, procs, s3):
    # The server holds the final snapshot's upload, so the job is surely inside its orderly stop
    # when the second Ctrl-C comes, however fast this machine is.
    hold = s3.add("PUT", r"/step-\d+/", "hold", count=float("inf"))
    job = procs.start([sys.executable, MAIN, *SMALL, "trainer.max_steps=100000", "snapshot.every=100000",
                       f"snapshot.dir=s3://{s3.bucket}/run", f"data.prepared_dir={tmp_path / 'prepared'}"], "job")
    wait_for(lambda: "step 5/100000" in output(job), 120, "training", [job])
    job.send_signal(signal.SIGINT)
    assert hold.holding.wait(timeout=60), output(job)
    job.send_signal(signal.SIGINT)
    hold.released.set()
    assert job.wait(timeout=60) == 130, output(job)
    text = output(job)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    # One line says so (the held upload, released, may still log from its thread while the process exits).
    assert sum(line.startswith("interrupted (SIGINT): ") for line in text.splitlines()) == 1, text


def test_the_modern_architecture_trains_resumes_bitwise_and_is_refused_where_its_weights_cannot_go(tmp_path):
    """model.arch=modern trains, and a run stopped at step 5 goes on to step 10 exactly as one that never stopped,
    with dropout (its masks are drawn from the data position, not from the process's history).
    A run of it resumed as model.arch=gpt2 is refused as a model of another size is, nothing overwritten; and GPT-2's
    architecture cannot start from its weights (model.init_from), nor export to Hugging Face."""
    from mingpt.checkpoint.load import open_model
    from mingpt.interop import hf

    modern = ["model.arch=modern", "model.dropout=0.1", "trainer.max_steps=10"]
    train_here(tmp_path / "whole", *modern)
    train_here(tmp_path / "stopped", *modern[:2], "trainer.max_steps=5")
    train_here(tmp_path / "stopped", *modern)
    weights = lambda run: torch.load(run / "snap" / "step-000000010" / "model.pt", weights_only=True)
    whole, resumed = weights(tmp_path / "whole"), weights(tmp_path / "stopped")
    assert "wpe.weight" not in whole and all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert manifests(tmp_path / "whole" / "snap")[-1]["model_config"]["rotary"] is True  # the snapshot records it

    with pytest.raises(SnapshotError) as refused:
        train_here(tmp_path / "whole", "trainer.max_steps=12")
    assert "different model" in one_line(refused.value) and "rotary=True (config asks for False)" in str(refused.value)
    assert "Use the settings of that run (model.arch=modern)" in str(refused.value)  # the one setting that resumes it
    assert latest_step(tmp_path / "whole" / "snap") == 10
    train_here(tmp_path / "gpt2", "trainer.max_steps=2")
    with pytest.raises(ConfigError) as refused:
        train_here(tmp_path / "new", f"model.init_from={tmp_path / 'gpt2' / 'snap'}", "model.arch=modern")
    assert "has the gpt2 architecture, and model.rotary=True" in str(refused.value)
    assert not (tmp_path / "new" / "prepared").exists()  # refused before the data work
    _, model, _ = open_model(str(tmp_path / "whole" / "snap"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="rotary positions, rmsnorm, QK-norm, a relu2 MLP, which Hugging Face"):
        hf.hf_files(model, None)


def test_muon_trains_resumes_bitwise_and_a_run_resumes_with_its_own_optimizer_only(tmp_path):
    """trainer.optimizer=muon (with model.arch=modern) lowers the loss, and a run stopped at step 5 goes on to step
    10 exactly as one that never stopped: weights, Muon's momentum and AdamW's moments, all in its snapshots. A run
    resumed with the other optimizer is refused in one line, nothing overwritten, either way; a snapshot that records
    none (made before Muon came) is AdamW's."""
    muon = ["model.arch=modern", "trainer.optimizer=muon", "trainer.max_steps=10"]
    whole, stopped, adamw = tmp_path / "whole", tmp_path / "stopped", tmp_path / "adamw"
    train_here(whole, *muon)
    train_here(stopped, *muon[:2], "trainer.max_steps=5")
    train_here(stopped, *muon)
    saved = lambda run, name: torch.load(run / "snap" / "step-000000010" / name, weights_only=True)
    assert_equal_weights(saved(whole, "model.pt"), saved(stopped, "model.pt"))
    optimizer, resumed = saved(whole, "optimizer.pt"), saved(stopped, "optimizer.pt")
    assert optimizer["param_groups"] == resumed["param_groups"]
    torch.testing.assert_close(optimizer["state"], resumed["state"], rtol=0, atol=0)
    assert set(optimizer["state"]["blocks.0.mlp.c_fc.weight"]) == {"momentum_buffer"}  # Muon's
    assert set(optimizer["state"]["wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}  # AdamW's
    manifest = manifests(whole / "snap")[-1]
    assert manifest["optimizer"] == "muon" and manifest["metrics"] == manifests(stopped / "snap")[-1]["metrics"]
    # The untied head starts at zero: the first loss is ln(vocabulary) exactly.
    assert manifest["metrics"]["train_loss"] < 0.85 * math.log(manifest["model_config"]["vocab_size"])

    with pytest.raises(SnapshotError) as refused:
        train_here(whole, "model.arch=modern", "trainer.max_steps=12")
    assert "trained with trainer.optimizer=muon (config asks for adamw)" in one_line(refused.value)
    assert latest_step(whole / "snap") == 10
    train_here(adamw, "model.arch=modern", "trainer.max_steps=2")
    manifest_file = adamw / "snap" / "step-000000002" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest.pop("optimizer") == "adamw"
    manifest_file.write_text(json.dumps(manifest))  # as snapshots were written before Muon came
    with pytest.raises(SnapshotError, match=r"trainer.optimizer=adamw \(config asks for muon\)"):
        train_here(adamw, *muon)
    assert "resumed from" in train_here(adamw, "model.arch=modern", "trainer.max_steps=3")
