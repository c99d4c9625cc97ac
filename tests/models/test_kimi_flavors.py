"""Kimi K2.6 / K2.7 text decoders as DeepSeek-V3 flavors: published numbers and parameter counts.

Source of the numbers: TorchTitan's ``kimi_k2_7`` model code
(``torchtitan/models/kimi_k2_7/__init__.py``, ``_kimi_k2_5``: "Architecture
shared by Kimi K2.5, K2.6, and K2.7-Code"), written out below as the
reference; the hub config.json files were not reachable (offline). Counts are
checked against transformers' ``Kimi_K25ForConditionalGeneration`` (whose
config names moonshotai/Kimi-K2.6) built on the meta device from the same
numbers: its language model plus head, the vision tower and projector left
out. Counts are integers: compared exactly.
"""

import attrs
import pytest
import torch
import transformers

from ftitan import random, tree
from ftitan.models import deepseek_v3 as ds
from ftitan.models import hf
from ftitan.nn.rope import YarnRopeScaling

# TorchTitan kimi_k2_7 `_kimi_k2_5` (text tower), field by field in ftitan's names
TORCHTITAN_K2X = dict(
    vocab_size=163_840, dim=7168, n_layers=61, n_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, ffn_dim=18_432, n_dense_layers=1, n_experts=384, top_k=8, moe_ffn_dim=2048,
    n_shared_experts=1, score_func="sigmoid", norm_topk=True, n_groups=1, topk_groups=1, routed_scale=2.827,
    norm_eps=1e-5, rope_theta=50_000.0, max_seq_len=262_144,
    rope_scaling=YarnRopeScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip
NEW = ("kimi_k2_6", "kimi_k2_7")


@pytest.fixture(autouse=True)
def one_thread():
    # with the 2 cores shared, OpenMP's spinning barriers made the trainer test ~50x slower on 2 threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("flavor", NEW)
def test_flavor_matches_torchtitan_numbers(flavor):
    cfg = ds.FLAVORS[flavor]()
    assert {k: getattr(cfg, k) for k in TORCHTITAN_K2X} == TORCHTITAN_K2X
    assert cfg == ds.Config.kimi_k2_5() and cfg.n_mtp_layers == 0
    assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


def _kimi_k25_text_count(cfg):
    text = {k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"}
    with torch.device("meta"):
        m = transformers.Kimi_K25ForConditionalGeneration(transformers.Kimi_K25Config(text_config=text))
    assert type(m.config.text_config).__name__ == "DeepseekV3Config" and m.config.text_config.rms_norm_eps == 1e-5
    parts = {"text": 0, "vision": 0}
    for name, x in m.state_dict().items():
        vision = name.startswith(("model.vision_tower.", "model.mm_projector."))
        parts["vision" if vision else "text"] += x.numel()
    assert parts["vision"] > 0  # the multimodal model was built; its vision side is not ours
    return parts["text"]


@pytest.mark.parametrize("flavor", NEW)
def test_param_count_equals_transformers_kimi_k25_text(flavor):
    cfg = ds.FLAVORS[flavor]()
    params = ds.model(cfg).init(random.key(0), dtype=torch.bfloat16, device="meta")
    total, active = ds.param_counts(cfg)
    assert tree.size(params) == total == _kimi_k25_text_count(cfg) == 1_026_408_232_448
    # published: "1T total, 32B activated" (activated without the embedding lookup, rounded to 1B)
    assert abs((active - cfg.vocab_size * cfg.dim) - 32e9) <= 0.016 * 32e9
    with torch.device("meta"):  # and DeepSeek-V3's own class, as for the other flavors
        v3 = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"}))  # fmt: skip
    assert sum(x.numel() for x in v3.state_dict().values()) == total


def test_mtp_module_counts_as_one_more_moe_block():
    # K2.x ship no MTP weights (num_nextn_predict_layers 0); with one, the count grows by a MoE block,
    # eh_proj (D x 2D) and three norms, and the shared embedding/head are not counted twice
    cfg = ds.Config.kimi_k2_7()
    with_mtp = attrs.evolve(cfg, n_mtp_layers=1)
    block = ds.param_counts(attrs.evolve(cfg, n_layers=62))[0] - ds.param_counts(cfg)[0]
    assert ds.param_counts(with_mtp)[0] - ds.param_counts(cfg)[0] == block + 2 * cfg.dim**2 + 3 * cfg.dim


def test_kimi_k2_7_debug_recipe_trains_through_the_trainer(tmp_path):
    # `ftitan train --recipe kimi-k2.7-debug`, shrunk (2 layers, V=384, 8 x 32 tokens, 30 eager steps)
    import json

    import ftitan as ft
    from ftitan.config import get_recipe, parse_train_args
    from ftitan.train.trainer import train

    k27 = ds.Config.kimi_k2_7()
    model = get_recipe("kimi-k2.7-debug").model
    assert (model.norm_eps, model.rope_theta, model.routed_scale, model.n_groups) == (1e-5, 50_000.0, 2.827, 1)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for _, d in zip(range(60), ft.data.stdlib_corpus())))
    cfg = parse_train_args([
        "--recipe", "kimi-k2.7-debug", "--data.corpus", str(corpus), "--data.vocab-size", "384",
        "--model.vocab-size", "384", "--model.n-layers", "2", "--data.seq-len", "32", "--data.batch-size", "8",
        "--steps", "30", "--optim.warmup", "3", "--eval-every", "30", "--eval-batches", "1", "--log-every", "1",
        "--ckpt-every", "30", "--compile", "False", "--run-dir", str(tmp_path / "run"),
    ])  # fmt: skip
    assert cfg.model.norm_eps == k27.norm_eps
    train(cfg, progress=False)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
