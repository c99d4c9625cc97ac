"""Muse Glimmer text decoder: published size (vs HF on meta), HF parity both ways on disk, KV-cache
generation, training.

Parity tolerance: max abs logit difference <= 1e-5 in float32, as for the other families. The
reference is the text path of ``transformers.MuseGlimmerForConditionalGeneration`` (eager attention)
on tiny random configs whose logits reach into the tanh soft-cap's bend (|logits| > 0.6 cap), with
sliding windows shorter than the sequence, NoPE layers and perturbed (non-zero) centered norms. The
residual stream of these configs grows to ~25 over 5 layers (post-norms add unit-RMS outputs), and
ftitan and HF then differ by a few float32 ulps there (~3e-5 absolute, 1e-6 relative); the head is
kept at std 0.15 so that this stays under 1e-5 on the logits (measured <= 6.6e-6, batch_invariant the largest).
"""

import json

import attrs
import pytest
import safetensors.torch
import torch
import transformers

import ftitan as ft
from ftitan import random, tree
from ftitan.infer import generate, init_cache, make_decode_step, make_prefill
from ftitan.models import hf, muse_glimmer, muse_glimmer_hf

ATOL = 1e-5
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def test_published_flavor_matches_hf_on_meta():
    hcfg = transformers.MuseGlimmerConfig()  # the reference config (Muse-Glimmer-30B)
    cfg = muse_glimmer.Config.muse_glimmer_30b()
    assert hf.config_from_hf(hcfg.to_dict()) == cfg == muse_glimmer.FLAVORS["muse_glimmer_30b"]()
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (
        6656, 52, 32, 2, 128, 202_048)  # fmt: skip
    assert cfg.windows.count(None) == 13 and cfg.windows[-1] is None and cfg.windows[-2] == 2048
    assert cfg.thetas[3] == 0.0 and cfg.thetas[0] == 10_000.0
    params = muse_glimmer.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    with torch.device("meta"):
        hm = transformers.MuseGlimmerForConditionalGeneration(hcfg)
    text = sum(p.numel() for n, p in hm.named_parameters() if n.startswith(("model.language_model.", "lm_head.")))
    assert tree.size(params) == text == 27_854_780_928
    # export writes the multimodal names (Family.export_prefix): every text parameter of HF's, in both layouts
    text = {n for n, _ in hm.named_parameters() if n.startswith(("model.language_model.", "lm_head."))}
    assert set(hf.to_hf(params, cfg)) == text == set(hf.to_hf(params, cfg, layout="module"))


def test_flops_per_token_counts_windows():
    cfg = muse_glimmer.Config.muse_glimmer_30b()
    d, hd = cfg.dim, cfg.n_heads * cfg.head_dim
    weights = cfg.n_layers * (3 * d * hd + 2 * d * cfg.n_kv_heads * cfg.head_dim + 3 * d * cfg.ffn_dim)
    weights += cfg.vocab_size * d
    # T <= window: every layer is causal over the whole sequence
    assert muse_glimmer.flops_per_token(cfg, 2048) == 6 * weights + 12 * hd * 52 * 1024
    # T = 8192: 13 global layers see 4096 keys on average, 39 sliding ones 2048 * (1 - 1/8)
    assert muse_glimmer.flops_per_token(cfg, 8192) == 6 * weights + 12 * hd * (13 * 4096 + 39 * 1792)


# ------------------------------------------------------------------ config and params

TINY = muse_glimmer.Config(vocab_size=96, dim=32, n_layers=5, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=40,
                           window=4, max_seq_len=64)  # fmt: skip


@pytest.mark.parametrize(
    "change,message",
    [
        ({"n_kv_heads": 3}, "not a multiple of n_kv_heads"),
        ({"window": 0}, "window=0"),
        ({"logit_softcap": 0.0}, "logit_softcap=0.0"),
        ({"layer_types": ("sliding_attention",) * 4}, "layer_types: 4 entries for n_layers=5"),
        ({"layer_types": ("local",) * 5}, r"unknown \['local'\]"),
        ({"layer_rope_theta": (1.0, -1.0, 0, 0, 0)}, "finite values >= 0"),
        ({"layer_types": "sliding_attention"}, "expected a sequence"),
    ],
)
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        attrs.evolve(TINY, **change)


def test_defaults_spelled_out_are_the_same_config():
    spelled = attrs.evolve(TINY, layer_types=["full_attention", *["sliding_attention"] * 3, "full_attention"],
                           layer_rope_theta=[0, 1e4, 1e4, 1e4, 0])  # fmt: skip
    assert spelled == TINY and spelled.layer_types is None and hash(spelled) == hash(TINY)
    assert TINY.windows == (None, 4, 4, 4, None) and TINY.thetas == (0.0, 1e4, 1e4, 1e4, 0.0)
    assert ft.models.registry.config_from_dict(json.loads(json.dumps(ft.models.registry.config_to_dict(
        attrs.evolve(TINY, layer_types=("full_attention",) * 5))))).windows == (None,) * 5  # fmt: skip


def test_params_tree_layout_and_axes():
    m = muse_glimmer.model(TINY)
    params = m.init(random.key(0))
    layer = params["layers"]["0"]
    assert set(layer) == {"attn_norm", "attn", "attn_post_norm", "mlp_norm", "mlp", "mlp_post_norm"}
    assert set(layer["attn"]) == {"wq", "wk", "wv", "wg", "wo"}
    assert tuple(layer["attn"]["wg"].shape) == (32, 32) and m.param_axes["layers"]["0"]["attn"]["wg"] == (
        "heads", "embed")  # fmt: skip
    assert all(float(layer[k].abs().sum()) == 0 for k in ("attn_norm", "mlp_post_norm"))  # centered: scale 1 + 0
    assert torch.equal(params["norm"], torch.ones(32))  # the final norm is a plain scaled one
    torch.testing.assert_close(m.head(params), params["head"] * TINY.output_multiplier)


# ------------------------------------------------------------------ HF parity

CONFIGS = {
    # default layer pattern (global NoPE layers 0 and 4 of 5), window 4 over 20 tokens, strong soft-cap
    "default_pattern": muse_glimmer.Config(vocab_size=96, dim=64, n_layers=5, n_heads=4, n_kv_heads=2, head_dim=16,
                                           ffn_dim=80, window=4, max_seq_len=128, output_multiplier=0.7,
                                           logit_softcap=2.0),
    # explicit patterns: a global RoPE layer, a sliding NoPE layer; multi-query; H * Dh != D
    "custom_pattern": muse_glimmer.Config(vocab_size=80, dim=48, n_layers=3, n_heads=4, n_kv_heads=1, head_dim=8,
                                          ffn_dim=64, window=3, max_seq_len=64, rope_theta=500.0,
                                          layer_types=("full_attention", "sliding_attention", "sliding_attention"),
                                          layer_rope_theta=(500.0, 0.0, 500.0), qk_scale=2.0, output_multiplier=1.0,
                                          logit_softcap=4.0),
}  # fmt: skip


def hf_config(cfg):
    text = {k: v for k, v in hf.config_to_hf(cfg)["text_config"].items() if k != "model_type"}
    text = transformers.MuseGlimmerTextConfig(**text, bos_token_id=None, eos_token_id=None)
    return transformers.MuseGlimmerConfig(text_config=text.to_dict(), vision_config=TINY_VISION,
                                          out_hidden_size=128, projector_hidden_size=32)  # fmt: skip


def hf_model(cfg, seed=0):
    torch.manual_seed(seed)
    m = transformers.MuseGlimmerForConditionalGeneration._from_config(hf_config(cfg), attn_implementation="eager")
    with torch.no_grad():  # centered norms off 0 (HF inits zeros) so mix-ups show; a head that reaches the cap
        for name, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.15 if name == "lm_head.weight" else 0.02))
    return m.eval()


def ftitan_params(cfg, seed=0):
    params = muse_glimmer.model(cfg).init(random.key(seed))
    g = torch.Generator().manual_seed(seed)

    def perturb(path, x):
        if path == "head":
            return 7.5 * x  # std 0.15: logits into the soft-cap's bend
        return x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else x

    return tree.map_with_path(perturb, params)


def tokens_for(cfg, b=2, t=20, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def hf_logits(m, tokens, position_ids=None):
    with torch.no_grad():
        return m(input_ids=tokens, position_ids=position_ids).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_save_pretrained_then_load_hf(name, tmp_path):
    cfg = CONFIGS[name]
    hm = hf_model(cfg)
    hm.save_pretrained(tmp_path)
    names = safetensors.torch.load_file(tmp_path / "model.safetensors").keys()
    assert "model.vision_tower.ln_post.weight" in names  # a multimodal checkpoint: vision names are ignored
    cfg2, params = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    tokens = tokens_for(cfg)
    want = hf_logits(hm, tokens)
    assert want.abs().max() > 0.6 * cfg.logit_softcap  # the soft-cap bends these logits
    for impl in ("sdpa", "math", "batch_invariant"):
        got, _ = muse_glimmer.model(attrs.evolve(cfg, attn_impl=impl)).apply(params, tokens)
        assert (got - want).abs().max() <= ATOL, impl
    pos = torch.tensor([list(range(5, 25)), list(range(30, 50))])
    got, _ = muse_glimmer.model(cfg).apply(params, tokens, positions=pos)
    assert (got - hf_logits(hm, tokens, pos)).abs().max() <= ATOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_hf_then_from_pretrained_and_load_hf(name, tmp_path):
    cfg = CONFIGS[name]
    params = ftitan_params(cfg)
    tokens = tokens_for(cfg)
    got, _ = muse_glimmer.model(cfg).apply(params, tokens)
    hf.save_hf(params, cfg, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "muse_glimmer"
    assert written["architectures"] == ["MuseGlimmerForConditionalGeneration"]
    names = safetensors.torch.load_file(tmp_path / "model.safetensors").keys()
    assert "model.language_model.layers.0.self_attn.gate_proj.weight" in names and "lm_head.weight" in names
    cfg2, params2 = hf.load_hf(tmp_path)
    assert cfg2 == cfg
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(params2), tree.leaves(params), strict=True))
    cfg3, params3 = hf.load_hf_sharded(tmp_path)  # leaf by leaf, through the same multimodal names
    assert cfg3 == cfg
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(params3), tree.leaves(params), strict=True))
    # the written config's text part, read by transformers, is the config; the vision tower (absent from the
    # file, initialized afresh) is kept tiny here. No key_mapping: the names are the multimodal class's own
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.config_from_hf(loaded.to_dict()) == cfg
    hm, info = transformers.MuseGlimmerForConditionalGeneration.from_pretrained(
        tmp_path, config=hf_config(cfg), attn_implementation="eager", output_loading_info=True
    )
    assert info["missing_keys"] and all(k.startswith("model.vision_") for k in info["missing_keys"]), info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert torch.equal(hm.model.language_model.layers[0].self_attn.gate_proj.weight,
                       params["layers"]["0"]["attn"]["wg"])  # fmt: skip
    assert (got - hf_logits(hm.eval(), tokens)).abs().max() <= ATOL


def test_streamed_export_writes_what_save_hf_writes(tmp_path):
    from ftitan.models.hf_export import save_hf_streamed

    cfg = CONFIGS["custom_pattern"]
    params = ftitan_params(cfg)
    flat = dict(zip(tree.paths(params), tree.leaves(params), strict=True))
    hf.save_hf(params, cfg, tmp_path / "whole")
    save_hf_streamed(flat.__getitem__, cfg, tmp_path / "streamed")
    assert (tmp_path / "whole/config.json").read_text() == (tmp_path / "streamed/config.json").read_text()
    whole, streamed = (safetensors.torch.load_file(tmp_path / d / "model.safetensors") for d in ("whole", "streamed"))
    assert list(streamed) == list(hf.to_hf(params, cfg)) and whole.keys() == streamed.keys()
    assert all(torch.equal(whole[n], streamed[n]) for n in whole)


def test_import_errors_name_the_tensors():
    cfg = CONFIGS["custom_pattern"]
    params = ftitan_params(cfg)
    mm = hf.to_hf(params, cfg)  # the multimodal checkpoint's names: text under model.language_model.
    assert len(mm) == 12 * 3 + 3 and sum(k.startswith("model.language_model.") for k in mm) == 12 * 3 + 2
    vision = {"model.vision_tower.layers.0.attn.q_proj.weight": torch.zeros(2, 2),
              "model.vision_projection.weight": torch.zeros(2, 2), "model.vision_adapter.fc1.weight": torch.zeros(1)}
    again = hf.from_hf({**mm, **vision}, cfg)
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(again), tree.leaves(params), strict=True))
    gone = "model.language_model.layers.1.self_attn.gate_proj.weight"
    with pytest.raises(KeyError, match=r"missing \[model.layers.1.self_attn.gate_proj.weight\]"):
        hf.from_hf({k: v for k, v in mm.items() if k != gone}, cfg)
    with pytest.raises(KeyError, match=r"unexpected \[model.layers.3.mlp.up_proj.weight\]"):
        hf.from_hf({**mm, "model.language_model.layers.3.mlp.up_proj.weight": torch.zeros(1)}, cfg)
    wrong = {**mm, "model.language_model.layers.0.self_attn.gate_proj.weight": torch.zeros(3, 48)}
    with pytest.raises(ValueError, match=r"layers.0.attn.wg \(from model.layers.0.self_attn.gate_proj.weight\)"):
        hf.from_hf(wrong, cfg)


def test_config_conversion_refusals():
    d = transformers.MuseGlimmerConfig().to_dict()
    text = d["text_config"]
    assert muse_glimmer_hf.config_from_hf(text) == hf.config_from_hf(d)  # a bare text config reads the same
    cfg = hf.config_from_hf(d)
    assert hf.config_from_hf(json.loads(json.dumps(hf.config_to_hf(cfg)))) == cfg
    other = {**text, "layer_rope_theta": [5e5 if t else 0 for t in text["layer_rope_theta"]]}
    with pytest.raises(ValueError, match=r"bases \[500000.0\] other than rope_parameters.rope_theta=10000.0"):
        muse_glimmer_hf.config_from_hf(other)
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        muse_glimmer_hf.config_from_hf({**text, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        muse_glimmer_hf.config_from_hf({**text, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="sliding_window=None"):
        muse_glimmer_hf.config_from_hf({**text, "sliding_window": None})


def test_stages_compose_and_packed_documents_stay_apart():
    cfg = CONFIGS["default_pattern"]
    model, params = muse_glimmer.model(cfg), ftitan_params(cfg)
    tokens = tokens_for(cfg, b=1, t=16)
    want, _ = model.apply(params, tokens, logits=False)
    first = model.stage(params, tokens, layers=range(2), first=True, last=False)
    rest = model.stage(params, first.h, layers=range(2, 5), first=False, last=True)
    assert torch.equal(rest.h, want) and rest.stats == {}
    # two documents in one row (windows and positions restart at the second): each as if alone
    segments = torch.tensor([[0] * 7 + [1] * 9])
    got, _ = model.apply(params, tokens, segments=segments)
    for doc in (slice(0, 7), slice(7, 16)):
        alone, _ = model.apply(params, tokens[:, doc])
        torch.testing.assert_close(got[:, doc], alone, rtol=0, atol=ATOL)


# ------------------------------------------------------------------ generation with the KV cache

PROMPTS = [[5, 17, 3, 48, 41, 9, 60, 7], [11, 2], [70, 71, 72, 73, 74]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_prefill_then_decode_equal_the_full_forward(side):
    cfg, steps = CONFIGS["default_pattern"], 6  # window 4: prompts and decoding run past it
    model, params = muse_glimmer.model(cfg), ftitan_params(cfg)
    t = max(map(len, PROMPTS))
    rows = [p + [0] * (t - len(p)) if side == "right" else [0] * (t - len(p)) + p for p in PROMPTS]
    tokens, lengths = torch.tensor(rows), torch.tensor([len(p) for p in PROMPTS])
    cache = init_cache(model, params, batch=len(PROMPTS), slots=t + steps)
    logits, cache = make_prefill(model)(params, tokens, cache, lengths=lengths, padding=side)
    seqs, got = [list(p) for p in PROMPTS], [[logits[i]] for i in range(len(PROMPTS))]
    decode_step = make_decode_step(model)
    for step in range(steps):
        nxt = torch.tensor([(7 * step + 13 * i) % cfg.vocab_size for i in range(len(PROMPTS))])
        for i, s in enumerate(seqs):
            s.append(int(nxt[i]))
        logits, cache = decode_step(params, nxt, cache)
        for i in range(len(PROMPTS)):
            got[i].append(logits[i])
    for i, s in enumerate(seqs):  # each row alone, no padding, no cache
        full, _ = model.apply(params, torch.tensor([s]))
        assert full.abs().max() > 0.6 * cfg.logit_softcap  # the steps soft-cap their logits as apply does
        torch.testing.assert_close(torch.stack(got[i]), full[0, len(PROMPTS[i]) - 1 :], rtol=0, atol=ATOL)


def test_greedy_generate_equals_argmax_of_the_full_forward():
    cfg = CONFIGS["custom_pattern"]
    model, params = muse_glimmer.model(cfg), ftitan_params(cfg)
    out = generate(model, params, PROMPTS, max_new_tokens=6)
    for prompt, new in zip(PROMPTS, out, strict=True):
        seq = list(prompt)
        for _ in range(6):
            logits, _ = model.apply(params, torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
        assert new == seq[len(prompt) :]
    # the compiled decode steps (static shapes; the windows are constants of the graph) give the same tokens
    assert generate(model, params, PROMPTS, max_new_tokens=6, compile="aot_eager") == out


# ------------------------------------------------------------------ training


def test_debug_config_trains_compiles_and_is_deterministic():
    cfg = attrs.evolve(muse_glimmer.Config.debug(), vocab_size=256, dim=64, n_layers=2, n_heads=4, head_dim=16,
                       ffn_dim=128, window=8)  # fmt: skip
    m = muse_glimmer.model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    opt = ft.optim.adamw(3e-3)
    step = ft.train.make_train_step(ft.train.next_token_loss(m), opt)
    state = ft.train.init_state(m.init(random.key(0)), opt)
    # compiled (aot_eager: the same aten ops) equals eager; 1e-6 allows decomposition reordering
    c_state, c_metrics = torch.compile(step, fullgraph=True, backend="aot_eager")(state, batch)
    state, metrics = step(state, batch)
    torch.testing.assert_close(c_metrics["loss"], metrics["loss"], rtol=0, atol=1e-6)
    for a, b in zip(tree.leaves(c_state.params), tree.leaves(state.params), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    again, _ = step(ft.train.init_state(m.init(random.key(0)), opt), batch)  # deterministic on CPU
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(again.params), tree.leaves(state.params), strict=True))
    losses = [metrics["loss"].item()]
    for _ in range(24):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"].item())
    assert losses[-1] < 0.3 * losses[0], losses  # memorizes the batch
