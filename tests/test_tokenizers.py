import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import offline_env
from mingpt.errors import TokenizerError
from mingpt.tokenizers import (BPETokenizer, CharTokenizer, huggingface, load_tokenizer, load_tokenizer_folder,
                               tokenizer_from_dict, train_tokenizer)

TEXT = "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind to suffer\n" * 20
UNICODE = "Grüße aus Köln — 東京タワー, naïve café, emoji 🤖 and tabs\tand\r\nnewlines.  Spaces   too."


def test_char_vocabulary_is_the_sorted_set_of_characters():
    tok = train_tokenizer("char", "banana!")
    assert tok.chars == ["!", "a", "b", "n"]
    assert tok.encode("banana") == [2, 1, 3, 1, 3, 1]
    assert tok.decode(tok.encode("nab!")) == "nab!"


def test_char_encode_array_agrees_with_the_dictionary():
    tok = train_tokenizer("char", UNICODE)
    ids = tok.encode_array(UNICODE)
    assert ids.tolist() == [tok.chars.index(c) for c in UNICODE]
    assert tok.decode(ids.tolist()) == UNICODE


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_end_of_text_is_the_last_id_and_never_made_by_text(kind):
    says = "a corpus that says <|endoftext|> means the text"
    tok = train_tokenizer(kind, TEXT + says, vocab_size=300)
    assert tok.eot_id == tok.vocab_size - 1
    assert tok.decode([tok.eot_id]) == "<|endoftext|>"
    assert tok.eot_id not in tok.encode(says)
    assert load_tokenizer_from(tok).eot_id == tok.eot_id


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_tokenizer_files_from_before_end_of_text_load_without_it(kind):
    new = train_tokenizer(kind, TEXT, vocab_size=300)
    payload = json.loads(new.to_json())
    del payload["eot"]
    old = tokenizer_from_dict(payload)
    assert old.eot_id is None and old.vocab_size == new.vocab_size - 1  # the ids the old file had, no more
    assert old.decode(old.encode(TEXT)) == TEXT


def load_tokenizer_from(tok):
    return tokenizer_from_dict(json.loads(tok.to_json()))


def test_char_prompt_with_unknown_characters_names_them():
    tok = train_tokenizer("char", "abc")
    with pytest.raises(TokenizerError, match=r"2 character\(s\).*'x', 'z'.*bpe"):
        tok.encode("abzx")


@pytest.mark.parametrize("text", [TEXT, UNICODE, "", " ", "\x00\x01 binary-ish \xff"])
def test_bpe_round_trips_any_text(text):
    tok = train_tokenizer("bpe", TEXT, vocab_size=300)
    assert tok.decode(tok.encode(text)) == text


def test_bpe_learns_merges_and_compresses():
    tok = train_tokenizer("bpe", TEXT, vocab_size=300)
    assert tok.vocab_size == 300
    assert tok.ranks[:256] == [bytes([b]) for b in range(256)]
    assert len(tok.encode(TEXT)) < len(TEXT.encode()) / 2


@pytest.mark.parametrize("bad", [None, 0, 256, 100, "4096"])
def test_bpe_vocab_size_must_exceed_256(bad):
    with pytest.raises(TokenizerError, match="above 256"):
        train_tokenizer("bpe", TEXT, vocab_size=bad)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_and_load_give_identical_ids(tmp_path, kind):
    tok = train_tokenizer(kind, TEXT + UNICODE, vocab_size=320)
    path = tmp_path / "tok.json"
    tok.save(str(path))
    payload = json.loads(path.read_text())  # plain JSON, not a pickle
    assert payload["kind"] == kind and payload["format"] == "mingpt-tokenizer"
    again = load_tokenizer(str(path))
    assert type(again) is type(tok) and again.vocab_size == tok.vocab_size
    assert again.encode(TEXT + UNICODE) == tok.encode(TEXT + UNICODE)


def test_damaged_or_foreign_tokenizer_files_are_refused(tmp_path):
    tok = train_tokenizer("bpe", TEXT, vocab_size=300)
    path = tmp_path / "tok.json"
    tok.save(str(path))
    full = path.read_text()

    path.write_text(full[: len(full) // 2])  # truncated
    with pytest.raises(TokenizerError, match="damaged"):
        load_tokenizer(str(path))

    path.write_text(json.dumps({"hello": "world"}))  # some other JSON
    with pytest.raises(TokenizerError, match="not a mingpt tokenizer"):
        load_tokenizer(str(path))

    payload = json.loads(full)
    payload["ranks"][300 // 2] = "!!not base64!!"
    path.write_text(json.dumps(payload))
    with pytest.raises(TokenizerError, match="damaged bpe"):
        load_tokenizer(str(path))

    payload = json.loads(full)
    payload["kind"] = "wordpiece"
    path.write_text(json.dumps(payload))
    with pytest.raises(TokenizerError, match="unknown tokenizer kind 'wordpiece'"):
        load_tokenizer(str(path))

    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))

    path.write_text(json.dumps({**json.loads(CharTokenizer("ab").to_json()), "chars": "ab\udcff"}))
    with pytest.raises(TokenizerError, match="a char vocabulary must be UTF-8 text: its '.udcff' at character 2"):
        load_tokenizer(str(path))  # a vocabulary that sampling could never write out


# What Python makes of b"caf\xe9" in a command line (a byte that is not UTF-8), then of a JSON escape "\ud800".
NOT_UTF8 = "caf\udce9 \ud800"


@pytest.mark.parametrize("kind", ["char", "bpe", "Hugging Face char", "Hugging Face bpe"])
def test_text_that_is_not_utf8_is_one_tokenizer_error_for_every_tokenizer(tmp_path, kind):
    """No tokenizer encodes a lone surrogate, nor replaces it in silence (tiktoken's encode_ordinary would)."""
    tok = train_tokenizer(kind.split()[-1], TEXT, vocab_size=300)
    if kind.startswith("Hugging Face"):  # the same vocabulary as a Hugging Face folder, read back
        for name, data in huggingface.tokenizer_files(tok, 64).items():
            (tmp_path / name).write_bytes(data)
        tok = load_tokenizer_folder(str(tmp_path))
    for encode in (tok.encode, tok.encode_array):
        with pytest.raises(TokenizerError) as refused:
            encode(NOT_UTF8)
        assert str(refused.value) == ("the text is not UTF-8: its '\\udce9' at character 3 is a lone surrogate "
                                      "(Python's stand-in for a byte that is not UTF-8, or half of a UTF-16 pair from a "
                                      "JSON escape)")


def test_bpe_decode_bytes_of_a_split_character():
    tok = BPETokenizer.train(TEXT, 300)  # never saw '東', so it is three byte tokens
    ids = tok.encode("東")
    assert len(ids) == 3
    assert b"".join(tok.decode_bytes([i]) for i in ids) == "東".encode()


@pytest.mark.multiproc
def test_named_encoding_offline_names_the_cache_variable(tmp_path, closed_port):
    # In a subprocess, so tiktoken's in-process registry starts empty; downloads go to a
    # closed loopback port.
    code = "from mingpt.tokenizers import train_tokenizer; train_tokenizer('gpt2', '')"
    result = subprocess.run([sys.executable, "-c", code], env=offline_env(tmp_path, closed_port),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "TokenizerError" in result.stderr
    assert "cannot load the tiktoken encoding 'gpt2'" in result.stderr
    assert "TIKTOKEN_CACHE_DIR" in result.stderr


def test_unknown_named_encoding_lists_known_ones():
    with pytest.raises(TokenizerError, match="unknown tiktoken encoding 'gpt5'.*cl100k_base"):
        train_tokenizer("gpt5", "")


@pytest.mark.multiproc
def test_named_encoding_that_tiktoken_can_load_works_and_round_trips(tmp_path, closed_port):
    # A tiktoken plugin (the tiktoken_ext namespace) provides an encoding without any download,
    # which exercises the whole named-encoding path offline.
    plugin = tmp_path / "plugins" / "tiktoken_ext"
    plugin.mkdir(parents=True)
    (plugin / "mingpt_test_enc.py").write_text(textwrap.dedent("""
        def _bytes_only():
            return {"name": "bytes_only", "pat_str": r"\\S+|\\s+",
                    "mergeable_ranks": {bytes([b]): b for b in range(256)}, "special_tokens": {}}
        ENCODING_CONSTRUCTORS = {"bytes_only": _bytes_only}
    """))
    code = textwrap.dedent(f"""
        from mingpt.errors import TokenizerError
        from mingpt.tokenizers import train_tokenizer, load_tokenizer
        tok = train_tokenizer("bytes_only", "")
        assert tok.kind == "tiktoken" and tok.vocab_size == 256
        text = {UNICODE!r}
        assert tok.decode(tok.encode(text)) == text
        try:
            tok.encode({NOT_UTF8!r})
            raise AssertionError("a lone surrogate was encoded")
        except TokenizerError as e:
            assert "is a lone surrogate" in str(e)
        tok.save({str(tmp_path / 'tok.json')!r})
        assert load_tokenizer({str(tmp_path / 'tok.json')!r}).encode(text) == tok.encode(text)
        print("ok")
    """)
    env = offline_env(tmp_path, closed_port)
    env["PYTHONPATH"] = str(tmp_path / "plugins")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert json.loads((tmp_path / "tok.json").read_text())["name"] == "bytes_only"


def test_char_decode_of_an_out_of_range_id():
    with pytest.raises(TokenizerError, match="out of range"):
        CharTokenizer(list("ab")).decode([0, 5])


def test_encode_array_is_encode_as_integers():
    tok = train_tokenizer("bpe", TEXT, vocab_size=300)
    ids = tok.encode_array("to be <|endoftext|>")  # special tokens are text here too
    assert np.issubdtype(ids.dtype, np.integer) and ids.tolist() == tok.encode("to be <|endoftext|>")


def test_tiktokens_private_tables_are_read_on_the_tiktoken_the_tests_run_on_and_their_absence_is_one_line(monkeypatch):
    import tiktoken

    from mingpt.tokenizers.bpe import BPE_PATTERN, TIKTOKEN_TESTED

    tokenizer = BPETokenizer.train("the cat sat on the mat. " * 40, 280)
    ranks, pattern = tokenizer.tables()
    assert tiktoken.__version__.startswith(TIKTOKEN_TESTED + ".")
    assert pattern == BPE_PATTERN and sorted(ranks, key=ranks.get) == tokenizer.ranks
    monkeypatch.delattr(tokenizer.encoding, "_pat_str")
    with pytest.raises(TokenizerError) as refused:
        tokenizer.tables()
    assert f"mingpt is tested with tiktoken {TIKTOKEN_TESTED}" in str(refused.value) and "\n" not in str(refused.value)
