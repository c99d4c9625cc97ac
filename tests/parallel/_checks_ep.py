"""Expert-parallel parity checks (merged into ``_parity.py``'s launch): MoE families on 4 gloo ranks
vs a single-process run, loss and every gradient, with a nonzero balancing-loss coefficient.

Run alone: ``torchrun --standalone --nproc-per-node 4 tests/parallel/_parity.py ep2_dp_shard2_qwen3_moe``.
"""

from __future__ import annotations

import os

import attrs
import torch

import ftitan as ft
from ftitan import parallel
from ftitan.models import deepseek_v3, qwen3_moe
from ftitan.parallel import collectives as C
from ftitan.parallel import expert
from _parity import max_diff, parallel_grads  # torchrun puts this folder on sys.path

AUX_COEF = 0.1  # large enough that a mis-scaled balancing gradient would show far above 1e-5


def tiny_qwen3_moe(**kw) -> qwen3_moe.Config:
    base = qwen3_moe.Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8,
                            top_k=2, expert_dim=32, ffn_dim=128, max_seq_len=64, aux_loss_coef=AUX_COEF)  # fmt: skip
    return attrs.evolve(base, **kw)


def tiny_deepseek_v3(**kw) -> deepseek_v3.Config:
    base = deepseek_v3.Config(
        vocab_size=256, dim=64, n_layers=3, n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, ffn_dim=128, n_dense_layers=1, n_experts=8, top_k=2, moe_ffn_dim=32,
        n_shared_experts=1, n_groups=2, topk_groups=1, routed_scale=2.5, aux_loss_coef=AUX_COEF,
        bias_update_rate=0.01, max_seq_len=64,
    )  # fmt: skip
    return attrs.evolve(base, **kw)


FAMILIES = {"qwen3_moe": (qwen3_moe, tiny_qwen3_moe), "deepseek_v3": (deepseek_v3, tiny_deepseek_v3)}


def init_params(family: str, model, bias: str = "random"):
    """Params; DeepSeek-V3's router biases nonzero (``"random"``), or steering every token to experts
    0 and 1 (``"first_rank"``: under ep=2 the second rank's experts receive no rows)."""
    params = model.init(ft.random.key(0))
    if family == "deepseek_v3":
        for i in range(model.config.n_dense_layers, model.config.n_layers):
            moe = params["layers"][str(i)]["moe"]
            g = torch.Generator().manual_seed(10 + i)
            moe["router_bias"] = 0.05 * torch.randn(model.config.n_experts, generator=g)
            if bias == "first_rank":
                moe["router_bias"][:2] += 10.0
    return params


def batch_for(b: int, t: int, vocab: int, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tokens; the first row's first 5 targets ignored, so ranks carry unequal loss weights."""
    tok = torch.randint(0, vocab, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    targets = tok[:, 1:].clone()
    targets[0, :5] = ft.train.IGNORE_INDEX
    return {"inputs": tok[:, :-1], "targets": targets}


def _moe_placements(sharded) -> dict[str, dict]:
    """``{path: {"placement": "(ep, -, dp_shard)", "local": [2, 32, 32]}}`` of the MoE leaves as stored."""
    out = {}
    for path, x in zip(*ft.tree.flatten_with_paths(sharded)[:2], strict=True):
        if ".moe." in path:
            out[path] = {"placement": str(parallel.sharding_of(x)), "local": list(x.to_local().shape)}
    return out


def grads_check(name: str, family: str, degrees: dict[str, int], *, bias: str = "random", rules=None, **cfg) -> dict:
    module, make_cfg = FAMILIES[family]
    model = module.model(make_cfg(**cfg))
    params = init_params(family, model, bias)
    batch = batch_for(8, 16, model.config.vocab_size)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    ref_g, (ref_l, ref_aux) = ft.train.value_and_grad(loss_fn)(params, batch)
    no_aux = module.model(make_cfg(**{**cfg, "aux_loss_coef": 0.0}))
    g0, _ = ft.train.value_and_grad(ft.train.next_token_loss(no_aux, chunk_size=24))(params, batch)

    total, full, aux, sent, sharded = parallel_grads(model, params, loss_fn, batch, degrees, rules)
    return {
        "check": name,
        "loss_diff": abs(float(total) - float(ref_l)),
        "grad_diff": max_diff(full, ref_g),
        "grad_scale": max(float(x.abs().max()) for x in ft.tree.leaves(ref_g)),
        "aux_grad_scale": max_diff(ref_g, g0),  # how much the balancing loss moves the gradients
        "load_diff": float((aux["moe.tokens_per_expert"] - ref_aux["moe.tokens_per_expert"]).abs().max()),
        "aux_loss_diff": abs(float(aux["moe.aux_loss"]) - float(ref_aux["moe.aux_loss"])),
        "all_to_all_bytes": int(sent["all_to_all"]),
        "placements": _moe_placements(sharded),
    }


def steps_check(name: str, degrees: dict[str, int], n_steps: int = 3, compile: bool | str = False) -> dict:
    """``n_steps`` of AdamW on DeepSeek-V3 with ``update_buffers`` (router-bias balancing), parallel vs single;
    ``compile``: the parallel step's gradient compiled (fullgraph), which must not recompile after step 1."""
    model = deepseek_v3.model(tiny_deepseek_v3())
    params = init_params("deepseek_v3", model)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    opt = ft.optim.chain(
        ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(lr=3e-3, weight_decay=0.1), ft.optim.freeze(model.frozen)
    )
    batches = [batch_for(8, 16, 256, seed=100 + i) for i in range(n_steps)]
    ref_step = ft.train.make_train_step(loss_fn, opt, update_buffers=model.update_buffers)
    state = ft.train.init_state(params, opt)
    ref = []
    for b in batches:
        state, m = ref_step(state, b)
        ref.append(m)

    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    step = parallel.make_train_step(loss_fn, opt, layout, update_buffers=model.update_buffers, compile=compile)
    pstate = ft.train.init_state(sharded, opt)
    got = []
    for i, b in enumerate(batches):
        with torch._dynamo.config.patch(error_on_recompile=bool(compile) and i > 0, capture_scalar_outputs=False):
            pstate, m = step(pstate, parallel.shard_batch(b, layout))
        got.append(m)
    final = parallel.unshard(pstate.params)

    def biases(p):
        return [p["layers"][str(i)]["moe"]["router_bias"] for i in range(1, model.config.n_layers)]

    def metric_diff(key):
        return max(float((a[key] - b[key]).abs().max()) for a, b in zip(got, ref, strict=True))

    return {
        "check": name,
        "losses": [float(m["loss"]) for m in got],
        "ref_losses": [float(m["loss"]) for m in ref],
        "loss_diff": max(abs(float(a["loss"]) - float(b["loss"])) for a, b in zip(got, ref, strict=True)),
        "load_diff": metric_diff("moe.tokens_per_expert"),
        "aux_loss_diff": metric_diff("moe.aux_loss"),
        "max_load_diff": metric_diff("moe.max_load"),
        "bias_diff": max_diff(biases(final), biases(state.params)),
        "bias_moved": max_diff(biases(final), biases(params)),
        "param_diff": max_diff(final, state.params),
    }


def _local_loss(family: str, degrees: dict[str, int], **cfg):
    """``(layout, local loss, local params, local batch, MoE layers)`` of a tiny family on ``degrees``."""
    module, make_cfg = FAMILIES[family]
    model = module.model(make_cfg(**cfg))
    params = init_params(family, model)
    layout = parallel.Layout(parallel.mesh(**degrees))
    sharded = parallel.shard_params(params, model.param_axes, layout.rules, layout)
    loss_fn = ft.train.next_token_loss(model, chunk_size=24)
    local_loss = parallel.make_parallel_loss(loss_fn, layout, ft.tree.map(parallel.sharding_of, sharded))
    batch = parallel.shard_batch(batch_for(8, 16, model.config.vocab_size), layout)
    n_moe = sum(1 for p in ft.tree.flatten_with_paths(params)[0] if p.endswith(".moe.experts.w1"))
    return layout, local_loss, parallel.to_local(sharded), batch, n_moe


def exchange_counts_check(name: str, family: str, degrees: dict[str, int], kind: str) -> dict:
    """All-to-alls this rank issues in one forward and in one gradient (eager), with the ``kind`` exchange."""
    layout, local_loss, local, batch, n_moe = _local_loss(family, degrees)
    with parallel.use(layout), expert.exchange(kind):
        with C.count_calls() as forward, torch.no_grad():
            local_loss(local, batch)
        with C.count_calls() as step:
            ft.train.value_and_grad(local_loss, impl="autograd")(local, batch)
    return {"check": name, "n_moe_layers": n_moe, "forward": dict(forward), "step": dict(step)}


def _is_a2a(node) -> bool:
    return node.target is torch.ops._c10d_functional.all_to_all_single.default


def _matmuls_in_flight(nodes) -> list[int]:
    """For each all-to-all in graph order, the matmuls between it and the wait on its result (work that
    overlaps the exchange)."""
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        if _is_a2a(n):
            wait = min(index[u] for u in n.users if u.target is torch.ops._c10d_functional.wait_tensor.default)
            out.append(sum(1 for m in nodes[index[n] + 1 : wait] if m.target in (torch.ops.aten.mm.default,
                                                                                 torch.ops.aten.addmm.default)))  # fmt: skip
    return out


def compiled_grads_check(name: str, family: str, degrees: dict[str, int], **cfg) -> dict:
    """The gradient of the parallel loss compiled with fullgraph=True and ``capture_scalar_outputs=False``
    (any ``.item()`` / ``.tolist()``, i.e. a host sync, breaks the graph and fails the compile) vs eager;
    the all-to-alls in the captured graph; the ``"sync"`` exchange refused under compile."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    layout, local_loss, local, batch, n_moe = _local_loss(family, degrees, **cfg)
    graphs = []

    def capture(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    grad_fn = ft.train.value_and_grad(local_loss, impl="autograd")
    compiled = torch.compile(grad_fn, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    flags = dict(trace_autograd_ops=True, capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False)
    with parallel.use(layout):
        ref_g, (ref_l, _) = grad_fn(local, batch)
        with torch._dynamo.config.patch(**flags):
            g, (l, _) = compiled(local, batch)
            try:
                with expert.exchange("sync"):  # refused while its forward is traced
                    torch.compile(local_loss, fullgraph=True, backend="aot_eager")(local, batch)
                sync_error = ""
            except Exception as e:  # noqa: BLE001 - what the sync exchange raises under compile
                sync_error = f"{type(e).__name__}: {e} | cause: {e.__cause__!r}"
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    return {
        "matmuls_in_flight": _matmuls_in_flight(nodes),
        "check": name,
        "n_moe_layers": n_moe,
        "loss_diff": abs(float(l) - float(ref_l)),
        "grad_diff": max_diff(g, ref_g),
        "graphs": len(graphs),
        "graph_all_to_all": sum(1 for n in nodes if _is_a2a(n)),
        "graph_all_to_all_splits": sorted({str(n.args[1]) for n in nodes if _is_a2a(n)}),
        "sync_error": sync_error[-1500:],
    }


EP2_DP2 = {"ep": 2, "dp_shard": 2}
CHECKS = {
    "ep2_dp_shard2_qwen3_moe": lambda: grads_check("ep2_dp_shard2_qwen3_moe", "qwen3_moe", EP2_DP2),
    "ep2_dp_shard2_deepseek_v3": lambda: grads_check("ep2_dp_shard2_deepseek_v3", "deepseek_v3", EP2_DP2),
    "ep4_qwen3_moe": lambda: grads_check("ep4_qwen3_moe", "qwen3_moe", {"ep": 4}),
    "dp_shard4_qwen3_moe": lambda: grads_check("dp_shard4_qwen3_moe", "qwen3_moe", {"dp_shard": 4}),
    "ep2_dp_shard2_deepseek_v3_idle_rank": lambda: grads_check(
        "ep2_dp_shard2_deepseek_v3_idle_rank", "deepseek_v3", EP2_DP2, bias="first_rank"
    ),
    "tp2_ep2_qwen3_moe": lambda: grads_check("tp2_ep2_qwen3_moe", "qwen3_moe", {"ep": 2, "tp": 2}),
    "tp2_ep2_deepseek_v3_no_sp": lambda: grads_check(
        "tp2_ep2_deepseek_v3_no_sp", "deepseek_v3", {"ep": 2, "tp": 2},
        rules=parallel.default_rules().with_rule("norm_seq", ("cp",)),
    ),  # fmt: skip
    "cp2_ep2_qwen3_moe": lambda: grads_check("cp2_ep2_qwen3_moe", "qwen3_moe", {"ep": 2, "cp": 2}),
    "tp2_cp2_deepseek_v3": lambda: grads_check("tp2_cp2_deepseek_v3", "deepseek_v3", {"tp": 2, "cp": 2}),
    "steps_ep2_dp_shard2_deepseek_v3": lambda: steps_check("steps_ep2_dp_shard2_deepseek_v3", EP2_DP2),
    "ep_exchange_padded_deepseek_v3": lambda: exchange_counts_check(
        "ep_exchange_padded_deepseek_v3", "deepseek_v3", EP2_DP2, "padded"
    ),
    "ep_exchange_sync_deepseek_v3": lambda: exchange_counts_check(
        "ep_exchange_sync_deepseek_v3", "deepseek_v3", EP2_DP2, "sync"
    ),
    "ep_exchange_padded_qwen3_moe_ep4": lambda: exchange_counts_check(
        "ep_exchange_padded_qwen3_moe_ep4", "qwen3_moe", {"ep": 4}, "padded"
    ),
    # one MoE layer (no dense one): dynamo traces every layer, and the counts are per MoE layer
    "ep_compiled_grads_deepseek_v3": lambda: compiled_grads_check(
        "ep_compiled_grads_deepseek_v3", "deepseek_v3", EP2_DP2, n_layers=1, n_dense_layers=0
    ),
    "ep2_dp_shard2_qwen3_moe_sync": lambda: _sync(grads_check, "ep2_dp_shard2_qwen3_moe_sync", "qwen3_moe", EP2_DP2),
    "ep2_dp_shard2_qwen3_next": lambda: _qwen3_next("ep2_dp_shard2_qwen3_next", EP2_DP2),
    "ep2_dp_shard2_deepseek_v3_triton": lambda: _triton(
        grads_check, "ep2_dp_shard2_deepseek_v3_triton", "deepseek_v3", EP2_DP2
    ),
}
if os.environ.get("FTITAN_SLOW_CHECKS"):  # compiled steps, tp: ~1-2 min of compiling; the slow tier
    CHECKS.update({
        "steps_ep2_dp_shard2_deepseek_v3_compiled": lambda: steps_check(
            "steps_ep2_dp_shard2_deepseek_v3_compiled", EP2_DP2, compile="aot_eager"
        ),
        "ep_compiled_grads_qwen3_moe_tp2": lambda: compiled_grads_check(
            "ep_compiled_grads_qwen3_moe_tp2", "qwen3_moe", {"ep": 2, "tp": 2}
        ),
    })  # fmt: skip


def _triton(check, name: str, *args, **kw) -> dict:
    """``check`` of a ``kernels="triton"`` model with the Triton kernels run in the interpreter (the launch
    inherits pytest's ``TRITON_INTERPRET=1``), counting the permute kernels' calls."""
    from ftitan.kernels import op, permute

    if os.environ.get("TRITON_INTERPRET") != "1":
        return {"check": name, "error": "needs TRITON_INTERPRET=1 in the launch's environment"}
    calls = [0]
    original = permute._Dispatch.apply

    def counted(*a):
        calls[0] += 1
        return original(*a)

    permute._Dispatch.apply = counted
    try:
        with op.interpret():
            result = check(name, *args, kernels="triton", **kw)
    finally:
        permute._Dispatch.apply = original
    return {**result, "permute_dispatch_calls": calls[0]}


def _qwen3_next(name: str, degrees: dict[str, int]) -> dict:
    """Qwen3-Next (Gated DeltaNet layers, its gated shared expert applied outside the MoE seam) under EP:
    ``_checks_qwen3_next``'s gradient check on an ep layout."""
    from _checks_qwen3_next import grads

    return grads(name, "qwen3_next", True, degrees)


def _sync(check, *args, **kw) -> dict:
    """``check`` with the previous (host-synchronized) exchange: it keeps its parity too."""
    with expert.exchange("sync"):
        return check(*args, **kw)
