"""DeepSeek-V3 multi-token prediction: the paper's formula, HF names both ways, training with the MTP loss.

``transformers`` has no MTP forward, so the reference is the formula of the
DeepSeek-V3 report (sec. 2.2) written out here with plain tensor ops, its
transformer blocks ``TRM_k`` being transformers' own ``DeepseekV3DecoderLayer``
loaded with the modules' block weights:

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})) ; RMSNorm(h^{k-1}_i)]   (the checkpoints' column order: embedding first)
    h^k    = TRM_k(h'^k_{0:T-k}),   P^k_{i+k+1} = softmax(head(RMSNorm(h^k_i)))
    L_MTP  = lambda / D * sum_k CE(P^k, t)

Tolerance: 1e-5 absolute on O(1) losses in float32 (both sides run the same
float32 math in other summation orders, as in test_deepseek_v3's logit parity).
"""

import json

import attrs
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

import ftitan
from ftitan import random, tree
from ftitan.models import deepseek_v3 as ds
from ftitan.models import hf, mtp

ATOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ds.Config(
    vocab_size=96, dim=32, n_layers=3, n_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=12, ffn_dim=48, n_dense_layers=1, n_experts=8, top_k=2, moe_ffn_dim=16,
    n_groups=4, topk_groups=2, routed_scale=2.5, max_seq_len=64, n_mtp_layers=2, mtp_loss_weight=0.3,
)  # fmt: skip


def perturbed(params, seed=0):
    # weights x3 so logits are O(1); norms and the routing bias perturbed so mix-ups show
    g = torch.Generator().manual_seed(seed)
    return tree.map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else 3 * x, params)


def tokens_for(cfg, b=2, t=12, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def hf_blocks(cfg, params):
    """transformers' DeepseekV3 with n_layers + D layers, loaded with the main layers and the MTP blocks."""
    full = attrs.evolve(cfg, n_layers=cfg.n_layers + cfg.n_mtp_layers, n_mtp_layers=0)
    conf = transformers.DeepseekV3Config(**{k: v for k, v in hf.config_to_hf(full).items() if k != "architectures"})
    hm = transformers.DeepseekV3ForCausalLM._from_config(conf, attn_implementation="eager").eval()
    state = hf.to_hf(params, cfg, layout="module")
    want = hm.state_dict()
    assert set(want) <= set(state)  # every HF tensor comes from our export (MTP-only names left over)
    hm.load_state_dict({k: state[k] for k in want})
    return hm


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def paper_mtp_losses(cfg, params, hm, tokens):
    """The report's MTP losses with plain ops around HF's decoder layers."""
    t = tokens.shape[1]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
    x = hm.model.embed_tokens(tokens)
    cos_sin = hm.model.rotary_emb(x, pos)
    for layer in hm.model.layers[: cfg.n_layers]:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    h = hm.model.norm(x)  # h^0: the main model's final-normed hidden states
    losses = []
    for k in range(1, cfg.n_mtp_layers + 1):
        p, n = params["mtp"][str(k - 1)], t - k
        emb = params["embed"][tokens[:, k:]]  # Emb(t_{i+k}), i = 0 .. T-k-1
        h_in = torch.cat([rms(emb, p["enorm"], cfg.norm_eps), rms(h[:, :n], p["hnorm"], cfg.norm_eps)], -1) @ p["eh_proj"].T
        h = hm.model.layers[cfg.n_layers + k - 1](h_in, attention_mask=mask[..., :n, :n], position_ids=pos[:, :n],
                                                  position_embeddings=tuple(c[:, :n] for c in cos_sin))  # fmt: skip
        logits = rms(h, p["norm"], cfg.norm_eps) @ params["head"].T  # P^k_{i+k+1}
        losses.append(F.cross_entropy(logits[:, : n - 1].reshape(-1, cfg.vocab_size), tokens[:, k + 1 :].reshape(-1)))
    return losses


def test_mtp_loss_equals_the_papers_formula():
    m = ds.model(TINY)
    params = perturbed(m.init(random.key(0)))
    tokens = tokens_for(TINY)
    with torch.no_grad():
        logits, _, aux = m.apply_with_aux(params, tokens)
        want = paper_mtp_losses(TINY, params, hf_blocks(TINY, params), tokens)
        main, _ = ds.model(attrs.evolve(TINY, n_mtp_layers=0)).apply(
            {k: v for k, v in params.items() if k != "mtp"}, tokens)  # fmt: skip
    assert all(1.0 < w < 20.0 for w in want)  # O(1) losses, not degenerate
    mean = torch.stack(want).mean()
    assert (aux["mtp.ce_loss"] - mean).abs() <= ATOL, (aux["mtp.ce_loss"], want)
    # aux_loss_coef 0: the whole aux loss is lambda / D * sum_k CE_k
    assert (aux["loss"] - TINY.mtp_loss_weight * mean).abs() <= ATOL
    assert torch.equal(logits, main)  # the MTP modules leave the main model's logits alone
    assert aux["moe.tokens_per_expert"].shape == (TINY.n_moe_layers + TINY.n_mtp_layers, TINY.n_experts)


def test_mtp_loss_keeps_to_packed_documents():
    # two documents packed in one row score what they score as two rows: no target crosses documents
    m = ds.model(attrs.evolve(TINY, n_mtp_layers=1))
    params = perturbed(m.init(random.key(0)))
    docs = tokens_for(TINY, b=2, t=10)
    packed = docs.reshape(1, 20)
    segments = torch.tensor([[0] * 10 + [1] * 10])
    with torch.no_grad():
        _, _, rows = m.apply_with_aux(params, docs)
        _, _, pack = m.apply_with_aux(params, packed, segments=segments)
        _, _, leaky = m.apply_with_aux(params, packed)
    assert (pack["mtp.ce_loss"] - rows["mtp.ce_loss"]).abs() <= ATOL
    assert (leaky["mtp.ce_loss"] - rows["mtp.ce_loss"]).abs() > 1e-3  # without segments the row is one document


def test_too_short_rows_and_inference_skip_the_mtp_loss():
    m = ds.model(TINY)
    params = m.init(random.key(0))
    _, _, aux = m.apply_with_aux(params, tokens_for(TINY, t=2))
    assert "mtp.ce_loss" not in aux and aux["loss"] == 0.0
    _, _, aux = m.apply_with_aux(params, tokens_for(TINY, t=3))  # depth 1 scores one position, depth 2 none
    assert aux["moe.tokens_per_expert"].shape[0] == TINY.n_moe_layers + 1


# ------------------------------------------------------------------ HF names


def test_hf_export_names_and_round_trip(tmp_path):
    params = perturbed(ds.model(TINY).init(random.key(1)))
    hf.save_hf(params, TINY, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        for k, layer in enumerate((3, 4)):
            for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                         "input_layernorm", "self_attn.kv_a_proj_with_mqa", "mlp.gate", "mlp.experts.7.down_proj"):
                assert f"model.layers.{layer}.{name}.weight" in names, name
            assert torch.equal(f.get_tensor(f"model.layers.{layer}.eh_proj.weight"), params["mtp"][str(k)]["eh_proj"])
            assert torch.equal(f.get_tensor(f"model.layers.{layer}.shared_head.head.weight"), params["head"])
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 2
    cfg2, params2 = mtp.load_hf(tmp_path)
    assert cfg2 == attrs.evolve(TINY, mtp_loss_weight=0.3)
    for a, b in zip(tree.leaves(params2), tree.leaves(params), strict=True):
        assert torch.equal(a, b)


def test_main_model_loaders_skip_one_mtp_layer(tmp_path):
    # hf.load_hf and transformers read the main model (as DeepseekV3ForCausalLM does); the MTP layer is ignored
    cfg = attrs.evolve(TINY, n_mtp_layers=1)
    params = perturbed(ds.model(cfg).init(random.key(2)))
    hf.save_hf(params, cfg, tmp_path)
    cfg_main, main = hf.load_hf(tmp_path)
    assert cfg_main == attrs.evolve(cfg, n_mtp_layers=0)
    assert tree.structure(main) == tree.structure({k: v for k, v in params.items() if k != "mtp"})
    tokens = tokens_for(cfg)
    got, _ = ds.model(cfg).apply(params, tokens)
    hm = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (hm(input_ids=tokens).logits - got).abs().max() <= ATOL


def test_hub_layout_import(tmp_path):
    # a checkpoint laid out as deepseek-ai/DeepSeek-V3's: transformers writes layer L as a plain decoder layer,
    # the MTP module's own tensors sit beside it; every MTP leaf comes from its hub name
    full = attrs.evolve(TINY, n_layers=4, n_mtp_layers=0)
    torch.manual_seed(0)
    conf = transformers.DeepseekV3Config(**{k: v for k, v in hf.config_to_hf(full).items() if k != "architectures"})
    hm = transformers.DeepseekV3ForCausalLM._from_config(conf)
    hm.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(3)
    own = {"enorm.weight": (32,), "hnorm.weight": (32,), "eh_proj.weight": (32, 64), "shared_head.norm.weight": (32,)}
    state.update({f"model.layers.3.{k}": torch.randn(s, generator=g) for k, s in own.items()})
    state["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    hub = {**json.loads((tmp_path / "config.json").read_text()), "num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(hub))
    cfg, params = mtp.load_hf(tmp_path)
    assert cfg.n_layers == 3 and cfg.n_mtp_layers == 1
    p = params["mtp"]["0"]
    assert torch.equal(p["eh_proj"], state["model.layers.3.eh_proj.weight"])
    assert torch.equal(p["norm"], state["model.layers.3.shared_head.norm.weight"])
    assert torch.equal(p["block"]["attn"]["wkv_b"], state["model.layers.3.self_attn.kv_b_proj.weight"])
    assert torch.equal(p["block"]["moe"]["experts"]["w2"][5], state["model.layers.3.mlp.experts.5.down_proj.weight"])
    assert torch.equal(p["block"]["moe"]["router_bias"], state["model.layers.3.mlp.gate.e_score_correction_bias"])
    assert torch.equal(params["layers"]["2"]["attn"]["wo"], state["model.layers.2.self_attn.o_proj.weight"])
    cfg_main, _ = hf.load_hf(tmp_path)  # transformers' view: the main model, layer 3 ignored
    assert cfg_main.n_mtp_layers == 0


# ------------------------------------------------------------------ training


def test_trains_with_the_mtp_loss_and_balances_its_router():
    cfg = attrs.evolve(TINY, n_mtp_layers=1, vocab_size=64)
    m = ds.model(cfg)
    assert m.frozen == ("layers.*.moe.router_bias", "mtp.*.block.moe.router_bias")
    x = torch.arange(33).repeat(4, 1) * 7 % 64  # a learnable sequence
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    opt = ftitan.optim.chain(ftitan.optim.adamw(1e-2), ftitan.optim.freeze(m.frozen))
    step = ftitan.train.make_train_step(ftitan.train.next_token_loss(m), opt, update_buffers=m.update_buffers)

    def run(n):
        state, logs = ftitan.train.init_state(m.init(random.key(0)), opt), []
        for _ in range(n):
            state, metrics = step(state, batch)
            logs.append((metrics["loss"].item(), metrics["ce_loss"].item(), metrics["mtp.ce_loss"].item()))
        return logs, state, metrics

    logs, state, metrics = run(25)
    assert logs[-1][2] < 0.3 * logs[0][2] and logs[-1][1] < 0.3 * logs[0][1], logs
    loss, ce, mtp_ce = logs[0]
    assert abs(loss - (ce + cfg.mtp_loss_weight * mtp_ce)) < 1e-5
    load = metrics["moe.tokens_per_expert"]
    assert load.shape == (cfg.n_moe_layers + 1, cfg.n_experts)
    bias = state.params["mtp"]["0"]["block"]["moe"]["router_bias"]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0  # moved by update_buffers, not the optimizer
    assert run(3)[0] == logs[:3]  # bit-identical rerun


def test_compiled_loss_and_grad_match_eager():
    m = ds.model(attrs.evolve(TINY, n_mtp_layers=1, attn_impl="math"))
    params = perturbed(m.init(random.key(0)))
    x = tokens_for(TINY, t=9)
    batch = {"inputs": x[:, :-1], "targets": x[:, 1:]}
    fn = torch.func.grad_and_value(ftitan.train.next_token_loss(m), has_aux=True)
    (g, (v, _)), (gc, (vc, _)) = fn(params, batch), torch.compile(fn, fullgraph=True, backend="aot_eager")(params, batch)
    torch.testing.assert_close(vc, v, rtol=0, atol=1e-6)
    for a, b in zip(tree.leaves(gc), tree.leaves(g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert g["mtp"]["0"]["eh_proj"].abs().sum() > 0 and g["mtp"]["0"]["block"]["moe"]["router"].abs().sum() > 0


def test_mtp_recipe_trains_through_the_trainer_and_reloads(tmp_path):
    # `ftitan train --recipe deepseek-v3-debug-mtp`, shrunk (2 layers, V=384, 8 x 32 tokens, 30 eager steps)
    import ftitan as ft
    from ftitan.config import parse_train_args
    from ftitan.train.trainer import load_run, train

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(60), ft.data.stdlib_corpus())))
    cfg = parse_train_args([
        "--recipe", "deepseek-v3-debug-mtp", "--data.corpus", str(corpus), "--data.vocab-size", "384",
        "--model.vocab-size", "384", "--model.n-layers", "2", "--data.seq-len", "32", "--data.batch-size", "8",
        "--steps", "30", "--optim.warmup", "3", "--eval-every", "30", "--eval-batches", "1", "--log-every", "1",
        "--ckpt-every", "30", "--compile", "False", "--run-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    assert cfg.model.n_mtp_layers == 1
    out = train(cfg, progress=False)
    records = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    mtp_losses = [r["mtp.ce_loss"] for r in records]
    assert len(mtp_losses) == 30 and sum(mtp_losses[-5:]) / 5 < sum(mtp_losses[:5]) / 5 - 0.5, mtp_losses
    assert all(len(r["moe.tokens_per_expert"]) == cfg.model.n_moe_layers + 1 for r in records)
    _, _, params, _, step = load_run(tmp_path / "run")
    assert step == 30 and torch.equal(params["mtp"]["0"]["eh_proj"], out["params"]["mtp"]["0"]["eh_proj"])


def test_pipeline_stages_refuse_mtp():
    m = ds.model(TINY)
    params = m.init(random.key(0))
    with pytest.raises(NotImplementedError, match="n_mtp_layers=0 under pp"):
        m.stage(params, tokens_for(TINY), layers=range(2), first=True, last=False)
    h, _, _ = m.stage(params, tokens_for(TINY), layers=range(3), first=True, last=True)  # one stage: apply's loop
    assert h.shape == (2, 12, 32)


def test_flops_per_token_count_the_mtp_modules():
    # independent count: every matmul weight but the embedding table, experts scaled to those used, and the
    # head once more per module (the shared head scores each depth); attention over L + D blocks
    cfg = TINY
    params = ds.model(cfg).init(random.key(0), device="meta")
    n = 0
    for path, x in zip(*tree.flatten_with_paths(params)[:2], strict=True):
        if path == "embed" or x.dim() == 1:
            continue
        n += x.numel() * cfg.top_k // cfg.n_experts if ".experts." in path else x.numel()
    n += cfg.n_mtp_layers * cfg.vocab_size * cfg.dim
    attn = 3 * (cfg.n_layers + cfg.n_mtp_layers) * 64 * cfg.n_heads * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)  # fmt: skip
    assert ds.model(cfg).flops_per_token(64) == 6 * n + attn
