"""Sharded saves on real gloo ranks, loaded under other layouts (``_sharded.py``; one launch per world)."""

from __future__ import annotations

import pytest

from tests.parallel.conftest import launch


@pytest.fixture(scope="module")
def four() -> dict[str, dict]:
    return launch("../checkpoint/_sharded.py")


def _ok(r: dict) -> dict:
    assert "error" not in r, r["error"]
    return r


def _check_save(r: dict, backend: str, loads: tuple[str, ...]) -> None:
    assert r["backend"] == backend and r["world_size"] == 4 and len(r["files"]) == 4
    # each rank's file holds exactly the blocks it holds first (a replicated block once, plain leaves on
    # rank 0): together the state's bytes, nothing twice
    assert r["written"] == r["expected"] and sum(r["written"]) == r["total"]
    # dp_shard 2 x tp 2: a quarter of the sharded leaves each, plus rank 0's replicated share
    assert max(r["written"][1:]) == min(r["written"][1:]) < r["written"][0] < 1.02 * r["total"] / 4
    for name in loads:  # the saved values, bit for bit; each rank read exactly the bytes it holds
        assert r[f"load_{name}"] and r[f"reads_{name}"], name
    assert r["load_one_process"]


def test_sharded_save_reloads_under_other_layouts(four):
    _check_save(_ok(four["save_sync"]), "sync", ("same", "two_ranks_dp_shard2", "two_ranks_tp2", "pp2_dp_shard2"))
    _check_save(_ok(four["save_dcp"]), "dcp", ("same",))


def test_a_corrupt_chunk_on_one_rank_makes_every_rank_fall_back(four):
    r = _ok(four["fallback"])
    assert r["steps"] == [1, 1, 1, 1] and r["exact"] and r["warned"]
    assert r["all_corrupt"] == [True] * 4  # none valid: one error on every rank, naming both checkpoints


def test_ranks_that_disagree_on_plain_leaves_fail_the_save(four):
    assert _ok(four["plain_mismatch"])["raised"] == [True] * 4


@pytest.mark.slow  # a writer subprocess per rank
def test_torch_checkpointing_writes_each_ranks_blocks():
    r = _ok(launch("../checkpoint/_sharded.py", "save_torch_checkpointing")["save_torch_checkpointing"])
    _check_save(r, "torch-checkpointing", ("same",))


@pytest.mark.slow  # 8 ranks: saved under dp_shard 4 x tp 2, loaded under dp_shard 8 and pp 2 x dp_shard 2 x tp 2
def test_eight_ranks_reshard():
    r = _ok(launch("../checkpoint/_sharded.py", "save_sync", nproc=8)["save_sync"])
    assert r["written"] == r["expected"] and sum(r["written"]) == r["total"] and len(r["files"]) == 8
    for name in ("same", "dp_shard8", "pp2_dp_shard2_tp2"):
        assert r[f"load_{name}"] and r[f"reads_{name}"], name
    assert r["load_one_process"]


def test_uneven_splits_save_and_reshard(four):
    r = _ok(four["uneven"])  # 10 rows and 3 columns over 4 ranks: one rank's column block is empty
    assert r["shard0"] and r["shard1"] and r["replicate"]
