"""Shared helpers for the streaming tests: shard writers, documents, batch and state comparisons."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import torch

import ftitan.data as fd

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_jsonl(path, texts, *, field="text", blank_every=0):
    lines = []
    for i, t in enumerate(texts):
        lines.append(json.dumps({field: t, "id": i}) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("\n")
    path.write_text("".join(lines))
    return path


def write_parquet(path, texts, *, field="text", row_group_size=4):
    pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), path, row_group_size=row_group_size)
    return path


def texts(n: int) -> list[str]:
    """Distinct documents of varied length (1 to 40 words)."""
    return [f"<{i}> " + " ".join(WORDS[(i * k + k) % len(WORDS)] for k in range(i * 7 % 40 + 1)) for i in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def assert_same_state(a, b):
    for name, x, y in zip(fd.StreamState._fields, a, b, strict=True):
        assert torch.equal(x, y), name
