"""What ``test_async``'s generator process runs: importable by name in the spawned child (test modules,
imported by pytest's importlib mode, are not)."""

from __future__ import annotations

import time

import torch


def make_factory(n: int, delay: float, fail_at: int | None):
    """Each batch records the params it was made from (``w``), so the test can check which version made it."""

    def make(params, index):
        if index == fail_at:
            raise ValueError("boom in the child")
        time.sleep(delay)
        return {"ids": torch.arange(index * n, (index + 1) * n), "x": torch.full((n, 3), float(index)),
                "w": params["w"].expand(n).clone()}  # fmt: skip

    return make
