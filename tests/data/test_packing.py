import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftitan.data import encode_documents, pack, token_stream

EOS_ID = 0

documents = st.lists(st.lists(st.integers(1, 1000), max_size=40), min_size=1, max_size=20)


@settings(max_examples=100, deadline=None)
@given(docs=documents, seq_len=st.integers(1, 16))
def test_packing_law(docs, seq_len):
    stream = token_stream(docs, eos_id=EOS_ID)
    joined = [t for doc in docs for t in [*doc, EOS_ID]]  # every document followed by EOS
    assert stream.tolist() == joined
    if len(joined) < seq_len + 1:
        with pytest.raises(ValueError, match="shorter than one row"):
            pack(stream, seq_len=seq_len)
        return
    rows = pack(stream, seq_len=seq_len)
    num_rows = len(joined) // (seq_len + 1)
    assert rows.shape == (num_rows, seq_len + 1)
    assert rows.dtype == torch.int32
    # no padding, nothing lost but the final partial row
    assert rows.flatten().tolist() == joined[: num_rows * (seq_len + 1)]
    assert len(joined) - rows.numel() < seq_len + 1


def test_pack_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        pack(np.arange(10, dtype=np.int32), seq_len=0)
    with pytest.raises(ValueError, match="1-d token stream"):
        pack(np.zeros((2, 5), dtype=np.int32), seq_len=2)


def _must_not_be_read():
    raise AssertionError("encode_documents re-encoded instead of loading the cache")
    yield  # pragma: no cover


def test_encode_documents_matches_tokenizer_and_caches(small_tokenizer, small_docs, tmp_path):
    docs = small_docs[:10]
    cache = tmp_path / "tokens.npy"
    stream = encode_documents(iter(docs), small_tokenizer, cache=cache)
    expected = token_stream([small_tokenizer.encode(d) for d in docs], eos_id=small_tokenizer.eos_id)
    np.testing.assert_array_equal(stream, expected)
    assert stream.dtype == np.int32
    np.testing.assert_array_equal(encode_documents(_must_not_be_read(), small_tokenizer, cache=cache), stream)
    # decoding the stream gives the documents back, EOS-separated
    assert small_tokenizer.decode(stream.tolist()) == "".join(d + "<|eos|>" for d in docs)


@pytest.mark.parametrize("damage", ["truncate", "wrong_dtype"])
def test_an_unreadable_token_cache_is_encoded_again(small_tokenizer, small_docs, tmp_path, damage):
    docs, cache = small_docs[:3], tmp_path / "tokens.npy"
    stream = encode_documents(iter(docs), small_tokenizer, cache=cache)
    if damage == "truncate":  # a copy or a disk cut short
        cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    else:
        np.save(cache, stream.astype(np.int64))
    with pytest.warns(UserWarning, match=r"tokens\.npy: unreadable token cache .* encoding the corpus again"):
        again = encode_documents(iter(docs), small_tokenizer, cache=cache)
    np.testing.assert_array_equal(again, stream)
    np.testing.assert_array_equal(np.load(cache), stream)  # rebuilt on disk too
