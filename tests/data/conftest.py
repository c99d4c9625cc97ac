import itertools

import pytest

from ftitan.data import stdlib_corpus, train_tokenizer

SMALL_VOCAB = 384  # 256 bytes + 127 merges + <|eos|>: trains in well under a second


@pytest.fixture(scope="session")
def small_vocab() -> int:
    return SMALL_VOCAB


@pytest.fixture(scope="session")
def small_docs() -> list[str]:
    """A deterministic slice of the train split: enough text for real merges, fast to train on."""
    return list(itertools.islice(stdlib_corpus(split="train"), 40))


@pytest.fixture(scope="session")
def small_tokenizer(small_docs, tmp_path_factory):
    return train_tokenizer(small_docs, SMALL_VOCAB, tmp_path_factory.mktemp("tok"))
