"""Hugging Face GPT-2 weights and tokenizers in (model.init_from, data.tokenizer) and out (mingpt-export),
checked against transformers itself. Nothing is downloaded: the models are tiny and random, made here."""

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

from conftest import TEXT
from launch import BIN, env, metrics, train_here
from mingpt.cli import export, sample
from mingpt.interop import hf
from mingpt.tokenizers import huggingface, load_tokenizer_folder
from mingpt.data.prepared import PreparedData
from mingpt.errors import TokenizerError
from mingpt.data.sampler import window_order
from mingpt.tokenizers import EOT, BPETokenizer, CharTokenizer

transformers = pytest.importorskip("transformers")  # a test extra: installed by .ci/run
tokenizers = pytest.importorskip("tokenizers")

SAMPLES = ["Hello world!", "  two  spaces\tand a tab\n", "doesn't 12345 émeu", "Section 3: the owl", ""]


def hf_bpe(vocab_size: int = 400):
    """A byte-level BPE trained by Hugging Face's own `tokenizers`, GPT-2's layout, end-of-text last."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.add_special_tokens([EOT])
    return tok


def gpt2_folder(path, vocab_size: int, n_positions: int = 64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(path)
    return model


def test_a_hugging_face_byte_level_bpe_converts_to_the_same_ids(tmp_path):
    tok = hf_bpe()
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer_folder(str(tmp_path))
    assert ours.vocab_size == tok.get_vocab_size() and ours.eot_id == tok.token_to_id(EOT)
    for text in [TEXT[:2000], *SAMPLES]:
        assert ours.encode(text) == tok.encode(text).ids
    # The same vocabulary as GPT-2's slow files, vocab.json + merges.txt, converts the same way.
    slow = tmp_path / "slow"
    slow.mkdir()
    tok.model.save(str(slow))
    vocab = json.loads((slow / "vocab.json").read_text())
    (slow / "vocab.json").write_text(json.dumps({**vocab, EOT: tok.token_to_id(EOT)}))
    assert load_tokenizer_folder(str(slow)).encode(TEXT[:2000]) == ours.encode(TEXT[:2000])
    # Exported again, GPT-2's split pattern also gets the slow files, which give the same ids.
    again = tmp_path / "again"
    again.mkdir()
    for name, data in huggingface.tokenizer_files(ours, max_length=64).items():
        (again / name).write_bytes(data)
    from_files = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(again / "vocab.json"),
                                                                      str(again / "merges.txt")))
    from_files.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert from_files.encode(TEXT[:2000]).ids == ours.encode(TEXT[:2000])


def test_tokenizers_that_would_give_other_ids_are_refused(tmp_path):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)  # <pad> takes id 0, before the bytes
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="ids do not follow the merge order"):
        load_tokenizer_folder(str(tmp_path))


@pytest.mark.parametrize("make", [lambda: CharTokenizer.train(TEXT + "".join(SAMPLES)), lambda: BPETokenizer.train(TEXT, 400)],
                         ids=["char", "bpe"])
def test_exported_tokenizers_encode_and_decode_as_ours_in_transformers(tmp_path, make):
    ours = make()
    for name, data in huggingface.tokenizer_files(ours, max_length=64).items():
        (tmp_path / name).write_bytes(data)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in [TEXT[:2000], *SAMPLES]:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids
        assert theirs.decode(ids) == text
    assert theirs.eos_token_id == ours.eot_id
    assert load_tokenizer_folder(str(tmp_path)).to_dict() == ours.to_dict()  # and back, as it was


def first_batch(prepared, block_size: int, batch: int, seed: int = 1337):
    blocks = PreparedData(prepared).split("train", block_size)
    starts = window_order("random", len(blocks.tokens), block_size, seed).starts(0, batch)
    return blocks.windows(starts)


def test_training_from_a_gpt2_folder_starts_from_its_weights_and_tokenizer(tmp_path):
    folder = tmp_path / "tiny-gpt2"
    tok = hf_bpe()
    reference = gpt2_folder(folder, tok.get_vocab_size())
    tok.save(str(folder / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(TEXT)
    overrides = [f"model.init_from={folder}", f"data.corpus={tmp_path / 'corpus.txt'}", "trainer.log_every=1"]
    text = train_here(tmp_path, *overrides, "trainer.max_steps=2")
    assert "data.tokenizer: the tokenizer of model.init_from" in text
    assert "2 layers, 2 heads, 32 wide, vocab 401, bias True (instead of model=gpt-nano)" in text
    assert "initialised from model.init_from=" in text
    # The first step's loss is what transformers computes with the folder's weights on the same batch
    # (block 32 of the folder's 64 positions: the position table is cropped).
    x, y = first_batch(tmp_path / "prepared", 32, 8)
    with torch.no_grad():
        expected = F.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten()).item()
    first = next(m for m in metrics(tmp_path / "snap") if "train_loss" in m)
    assert first["train_loss"] == pytest.approx(expected, rel=1e-5)
    # A restart resumes its own snapshot and never reads the folder's weights again.
    (folder / "model.safetensors").unlink()
    text = train_here(tmp_path, *overrides, "trainer.max_steps=3")
    assert "is not read: this run resumes from its own snapshot" in text and "done: step 3" in text


def test_a_block_size_beyond_the_folder_positions_is_a_config_error(tmp_path):
    folder = tmp_path / "tiny-gpt2"
    gpt2_folder(folder, 300, n_positions=16)
    with pytest.raises(Exception, match="exceeds the 16 positions"):
        hf.hf_model_config(str(folder), 32)


@pytest.mark.parametrize("run", ["char_run", "bpe_run"])
def test_an_exported_snapshot_computes_and_generates_as_in_mingpt(tmp_path, request, capsys, run):
    snap = request.getfixturevalue(run)
    out = tmp_path / "exported"
    assert export.main([str(snap), str(out)]) == 0
    # GPT-2's slow tokenizer files only come with GPT-2's split pattern, which neither run has.
    assert capsys.readouterr().out == f"wrote config.json, model.safetensors, tokenizer.json, tokenizer_config.json " \
                                      f"to {out}\n"
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    from mingpt.checkpoint.load import load_model, open_snapshot

    ours, our_tok = load_model(open_snapshot(str(snap)), torch.device("cpu"))
    ids = torch.tensor([our_tok.encode(TEXT[:200])[:32]])
    assert tok.encode(TEXT[:200])[:32] == ids[0].tolist()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ours(ids)[0], atol=1e-4)
    # Greedy generation gives the same text as mingpt-sample --temperature 0.
    prompt = "Section 1"
    assert sample.main([str(snap), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "20"]) == 0
    sampled = capsys.readouterr().out
    generated = model.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=20, do_sample=False,
                               pad_token_id=tok.eos_token_id)  # both stop early at end-of-text
    assert tok.decode(generated[0], skip_special_tokens=True) in sampled
    # And the export loads back as a starting point.
    (tmp_path / "corpus.txt").write_text(TEXT)
    text = train_here(tmp_path, f"data.corpus={tmp_path / 'corpus.txt'}", f"model.init_from={out}",
                      "trainer.max_steps=1")
    assert f"initialised from model.init_from={out}" in text


@pytest.mark.multiproc
def test_export_refuses_a_folder_that_is_not_empty_and_writes_nothing_there(tmp_path, char_run):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    done = subprocess.run([str(BIN / "mingpt-export"), str(char_run), str(tmp_path / "out")], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"error: {tmp_path / 'out'} exists and is not empty; give a new folder\n"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_fine_tuning_from_a_mingpt_snapshot_takes_its_weights_and_tokenizer_only(tmp_path, char_run):
    # Another corpus; the tokenizer of the snapshot (its characters), block 16 of its 32 positions.
    (tmp_path / "other.txt").write_text(TEXT[::-1])
    text = train_here(tmp_path, f"data.corpus={tmp_path / 'other.txt'}", f"model.init_from={char_run}",
                      "data.block_size=16", "trainer.max_steps=1", "trainer.log_every=1")
    assert "data.tokenizer: the tokenizer of model.init_from" in text and "step-000000040" in text
    from mingpt.checkpoint.load import load_model, open_snapshot

    model, _ = load_model(open_snapshot(str(char_run)), torch.device("cpu"))
    x, y = first_batch(tmp_path / "prepared", 16, 8)
    with torch.no_grad():
        expected = model(x, y)[1].item()
    first = next(m for m in metrics(tmp_path / "snap") if "train_loss" in m)
    assert first["train_loss"] == pytest.approx(expected, rel=1e-5)
