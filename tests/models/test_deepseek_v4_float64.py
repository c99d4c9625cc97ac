"""DeepSeek-V4 in float64: forward-mode and forward-over-reverse derivatives against central differences.

Complements the family matrix (``tests/transforms/test_models.py``: 2 layers, sliding + csa, every
compressed entry kept) with every layer kind and a live sparse selection: ``hca`` and ``csa`` layers,
a window shorter than the row, ``index_topk`` 3 of up to 6 csa entries, 3 hyper-connection streams,
a hash-routed first block and one MTP module (in the loss). What it pins:

- no float32 island in a float64 run (rope rotation, compressor gates, indexer scores, mHC mixing and
  norms all follow ``torch.promote_types(dtype, float32)``): a float32 step would leave ~1e-7 relative
  noise, ~1e-1 after the 1e-6 difference quotient;
- the hash table is read as ids by rounding, so a step on the (frozen, float32) table leaves the routing;
- the indexer's KL cuts its inputs and target from the reverse pass with ``torch.no_grad`` (not
  ``detach``), so a ``jvp`` of the gradient sees how the gradient moves with them.

Tolerances as the matrix's (its docstring gives the error budget): step 1e-6 along a direction at the
params' scale, rtol 1e-6, atol 1e-8; every discrete choice (routing, hash lookups, the indexer's top-k)
is recorded and asserted identical at ``p + h v`` and ``p - h v``.
"""

from typing import Any

import pytest
import torch
from torch.func import grad, jvp

import ftitan
from ftitan import random, tree
from ftitan.models import deepseek_v4 as v4
from ftitan.nn import hash_moe
from ftitan.nn import sparse_attention as sa

STEP = 1e-6
F64_FD = {"rtol": 1e-6, "atol": 1e-8}
CFG = v4.Config(
    vocab_size=64, dim=32, n_layers=3, n_heads=4, head_dim=16, rope_dim=8, q_lora_rank=24, o_groups=2, o_lora_rank=8,
    layer_types=("hca", "csa", "sliding"), csa_rate=4, hca_rate=8, window=8, index_heads=2, index_head_dim=12,
    index_topk=3, n_experts=8, top_k=2, expert_dim=16, n_hash_layers=1, hc_mult=3, hc_sinkhorn_iters=4,
    n_mtp_layers=1,
)  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Choices:
    """Records the experts of every MoE layer and the indexer's top-k masks."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[torch.Tensor] = []
        route, select = hash_moe.route, sa._select

        def recording_route(*args: Any, **kwargs: Any) -> Any:
            out = route(*args, **kwargs)
            self.calls.append(out.experts.clone())
            return out

        def recording_select(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = select(*args, **kwargs)
            self.calls.append(out.clone())
            return out

        monkeypatch.setattr(hash_moe, "route", recording_route)
        monkeypatch.setattr(sa, "_select", recording_select)

    def take(self) -> list[torch.Tensor]:
        out, self.calls = self.calls, []
        return out


def _assert_same(*runs: list[torch.Tensor]) -> None:
    for run in runs[1:]:
        assert len(run) == len(runs[0]) > 0
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a, b), "a finite-difference step changed a discrete choice; use a smaller step"


def _batch() -> dict[str, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (2, 25), generator=torch.Generator().manual_seed(2))
    return {"inputs": x[:, :-1], "targets": x[:, 1:]}


def _setup() -> tuple[Any, Any, Any, dict[str, torch.Tensor]]:
    m = v4.model(CFG)
    params = m.init(random.key(0), dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    # at the params' scale (init std 0.02), as the family matrix
    v = tree.map(lambda x: 0.02 * torch.randn(x.shape, generator=g, dtype=x.dtype), params)
    return m, params, v, _batch()


def _axpy(a: float, x: Any, y: Any) -> Any:
    return tree.map(lambda xi, yi: yi + a * xi, x, y)


def test_selection_is_live_in_this_config(monkeypatch):
    m, params, _, batch = _setup()
    choices = _Choices(monkeypatch)
    m.apply(params, batch["inputs"])
    masks = [c for c in choices.take() if c.dtype == torch.bool]
    assert len(masks) == 1 and masks[0].sum(-1).max() == CFG.index_topk  # some queries drop completed entries
    assert (masks[0].shape[-1] > CFG.index_topk) and not masks[0][:, -1].all()


def test_jvp_of_logits_equals_central_differences(monkeypatch):
    m, params, v, batch = _setup()

    def logits(p: Any) -> torch.Tensor:
        return m.apply(p, batch["inputs"])[0]

    choices = _Choices(monkeypatch)
    plus = logits(_axpy(STEP, v, params))
    at_plus = choices.take()
    minus = logits(_axpy(-STEP, v, params))
    _assert_same(at_plus, choices.take())
    out, tangent = jvp(logits, (params,), (v,))
    assert out.dtype == tangent.dtype == torch.float64
    torch.testing.assert_close(tangent, (plus - minus) / (2 * STEP), **F64_FD)
    assert tangent.abs().max() > 1e-3


def test_hessian_vector_product_equals_central_differences_of_grad(monkeypatch):
    # the loss carries the MTP loss and the indexer's KL (indexer_loss_coef 1): the KL's gradient reaches the
    # indexer only, and moves with the main attention's probabilities and the indexer's inputs, which the
    # jvp must see
    m, params, v, batch = _setup()
    loss_fn = ftitan.train.next_token_loss(m)

    def grad_of(p: Any) -> Any:
        return grad(lambda q: loss_fn(q, batch)[0])(p)

    choices = _Choices(monkeypatch)
    plus = grad_of(_axpy(STEP, v, params))
    first = choices.take()
    minus = grad_of(_axpy(-STEP, v, params))
    _assert_same(first, choices.take())
    _, hvp = jvp(grad_of, (params,), (v,))
    fd = tree.map(lambda a, b: (a - b) / (2 * STEP), plus, minus)
    torch.testing.assert_close(hvp, fd, **F64_FD)
    indexer = [x for path, x in zip(*tree.flatten_with_paths(hvp)[:2], strict=True) if ".indexer." in path]
    assert indexer and max(x.abs().max() for x in indexer) > 1e-5  # the indexer's block is not zero


def test_a_nudged_hash_table_routes_the_same():
    # ids 1.0 - 1 ulp truncated to 0 before: a float32 step on the table moved tokens to other experts
    _, params, _, batch = _setup()
    p = params["layers"]["0"]["moe"]
    x = torch.randn(batch["inputs"].numel(), CFG.dim, dtype=torch.float64)
    kw = dict(top_k=CFG.top_k, routed_scale=CFG.routed_scale)
    base = hash_moe.route(x, p, batch["inputs"].flatten(), **kw)
    for toward in (-1.0, 1.0):
        table = torch.nextafter(p["hash_table"], torch.full_like(p["hash_table"], toward * 1e9))
        nudged = hash_moe.route(x, {**p, "hash_table": table}, batch["inputs"].flatten(), **kw)
        assert torch.equal(nudged.experts, base.experts)
        torch.testing.assert_close(nudged.weights, base.weights, rtol=0, atol=0)


def test_float32_and_bfloat16_runs_keep_their_compute_dtype():
    # the float64 promotions leave the other dtypes' math as it was (parity with transformers: bit-equal)
    m = v4.model(CFG)
    for dtype in (torch.float32, torch.bfloat16):
        logits, _, aux = m.apply_with_aux(m.init(random.key(0), dtype=dtype), _batch()["inputs"])
        assert logits.dtype == dtype and aux["indexer.kl"].dtype == torch.float32
        assert aux["mtp.loss"].dtype == torch.float32
