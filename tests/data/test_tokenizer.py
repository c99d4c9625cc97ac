import json

import pytest

from ftitan.data import EOS, load_tokenizer, stdlib_corpus, tokenizer_for, train_tokenizer
from ftitan.data.tokenizer import TOKENIZER_FILE, TOKENIZER_SIZE_FILE


def test_vocab_and_eos(small_tokenizer, small_vocab):
    assert small_tokenizer.vocab_size == small_vocab
    assert small_tokenizer.decode([small_tokenizer.eos_id]) == EOS


def test_round_trip_on_held_out_source(small_tokenizer):
    for doc in stdlib_corpus(split="eval"):
        ids = small_tokenizer.encode(doc)
        assert len(ids) < len(doc.encode())  # merges compress real text
        assert small_tokenizer.decode(ids) == doc


@pytest.mark.parametrize(
    "text", ["", " leading space", "tabs\tand\nnewlines\r\n", "ünïcödé 日本語 🐍", "\x00\x7f"]
)
def test_round_trip_on_any_string(small_tokenizer, text):
    # byte-level: strings the tokenizer never saw still round-trip
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_encode_batch_matches_encode(small_tokenizer, small_docs):
    assert small_tokenizer.encode_batch(small_docs[:5]) == [small_tokenizer.encode(d) for d in small_docs[:5]]


def test_save_and_load(small_tokenizer, small_docs, tmp_path, small_vocab):
    train_tokenizer(small_docs, small_vocab, tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode(small_docs[0]) == small_tokenizer.encode(small_docs[0])
    assert load_tokenizer(tmp_path / TOKENIZER_FILE).eos_id == small_tokenizer.eos_id


def test_training_is_deterministic(small_tokenizer, small_docs, small_vocab):
    again = train_tokenizer(small_docs, small_vocab)
    assert again.hf.to_str() == small_tokenizer.hf.to_str()


def _must_not_be_read():
    raise AssertionError("tokenizer_for retrained instead of loading the cached tokenizer.json")
    yield  # pragma: no cover


def test_tokenizer_for_trains_once_then_loads(small_docs, tmp_path, small_vocab):
    first = tokenizer_for(tmp_path, iter(small_docs), small_vocab)
    assert (tmp_path / TOKENIZER_FILE).is_file()
    second = tokenizer_for(tmp_path, _must_not_be_read(), small_vocab)
    assert second.encode(small_docs[1]) == first.encode(small_docs[1])
    with pytest.raises(ValueError, match=f"cached tokenizer has vocab_size={small_vocab}"):
        tokenizer_for(tmp_path, _must_not_be_read(), small_vocab + 1)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="at least 257"):
        train_tokenizer(["abc"], 100)
    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        load_tokenizer(tmp_path)


def test_a_bpe_short_of_its_vocab_warns_and_its_run_dir_still_loads(tmp_path):
    docs = ["ab ab ab abc"] * 3  # a few merges at most: far below the 2048 tokens asked
    with pytest.warns(UserWarning, match=r"the corpus gave \d+ of the 2048 tokens asked"):
        first = tokenizer_for(tmp_path, iter(docs), 2048)
    assert first.vocab_size < 2048
    assert json.loads((tmp_path / TOKENIZER_SIZE_FILE).read_text()) == {"asked": 2048, "reached": first.vocab_size}
    with pytest.warns(UserWarning, match=rf"a BPE of {first.vocab_size} of the 2048 tokens asked"):
        again = tokenizer_for(tmp_path, _must_not_be_read(), 2048)  # a resumed run: the same ask, the cached BPE
    assert again.hf.to_str() == first.hf.to_str()
    with pytest.raises(ValueError, match="vocab_size=4096 was asked for"):
        tokenizer_for(tmp_path, _must_not_be_read(), 4096)  # another ask is still refused


def test_a_truncated_tokenizer_file_names_itself_and_the_fix(small_docs, tmp_path, small_vocab):
    train_tokenizer(small_docs[:5], small_vocab, tmp_path)
    file = tmp_path / TOKENIZER_FILE
    file.write_text(file.read_text()[:100])
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizer .*delete it and run again"):
        load_tokenizer(tmp_path)
