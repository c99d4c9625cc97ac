"""Batched generation: greedy parity with HF ``generate``, padding sides, stopping, seeds, compile.

HF parity is exact on tokens: both sides run float32 with the same weights,
so greedy argmaxes agree unless two logits tie within ~1e-6 (random models
with these seeds have no such near-ties).
"""

import warnings

import attrs
import pytest
import torch
import transformers

import ftitan as ft
from ftitan import tree
from ftitan.infer import GREEDY, Sampling, generate
from ftitan.models import hf, llama, qwen3

LLAMA = llama.Config(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=256,
                     rope_theta=10_000.0)  # fmt: skip
QWEN3 = qwen3.Config(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                     max_seq_len=256)  # fmt: skip
HF_CLASSES = {"llama": (LLAMA, transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen3": (QWEN3, transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}  # fmt: skip
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 12, 100], [11, 2], [70, 71, 72, 73, 74]]


def params_of(model, seed=0):
    params = model.init(ft.random.key(seed))
    g = torch.Generator().manual_seed(seed)
    # norms off 1, and weights scaled up so the random model's greedy path is not a constant token
    return tree.map(lambda x: x + 0.1 * torch.randn(x.shape, generator=g) if x.dim() == 1 else 4 * x, params)


def hf_greedy(name, params, prompts, new):
    cfg, config_cls, model_cls = HF_CLASSES[name]
    hcfg = config_cls(**{k: v for k, v in hf.config_to_hf(cfg).items() if k != "architectures"})
    m = model_cls._from_config(hcfg, attn_implementation="eager").eval()
    m.load_state_dict(hf.to_hf(params, cfg), strict=False)  # tied checkpoints store no lm_head
    t = max(map(len, prompts))
    ids = torch.tensor([[0] * (t - len(p)) + p for p in prompts])  # HF batches left-padded prompts
    mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         eos_token_id=None)  # fmt: skip
    return out[:, t:].tolist()


@pytest.mark.parametrize("name", list(HF_CLASSES))
def test_greedy_tokens_equal_hf_generate(name):
    cfg = HF_CLASSES[name][0]
    model = ft.models.registry.model_for(cfg)
    params = params_of(model)
    want = hf_greedy(name, params, PROMPTS, 12)
    assert len({tuple(w) for w in want}) == 3 and all(len(set(w)) > 2 for w in want)  # not a degenerate model
    for side in ("left", "right"):
        assert generate(model, params, PROMPTS, max_new_tokens=12, padding=side) == want


def test_batched_equals_alone_and_compiled_equals_eager():
    model = llama.model(LLAMA)
    params = params_of(model, 1)
    batched = generate(model, params, PROMPTS, max_new_tokens=8)
    assert batched == [generate(model, params, [p], max_new_tokens=8)[0] for p in PROMPTS]
    assert generate(model, params, PROMPTS, max_new_tokens=8, compile="aot_eager") == batched


@pytest.mark.parametrize("compile", [False, "aot_eager"])  # compiled: greedy chunks of GREEDY_CHUNK tokens
def test_each_request_stops_at_its_eos_or_max_tokens(compile):
    model = llama.model(LLAMA)
    params = params_of(model, 2)
    free = generate(model, params, PROMPTS, max_new_tokens=10)
    eos = free[1][3]  # the 4th token of request 1
    stopped = generate(model, params, PROMPTS, max_new_tokens=10, eos_id=[eos, 127], compile=compile)
    for f, s in zip(free, stopped, strict=True):
        cut = next((i + 1 for i, t in enumerate(f) if t in (eos, 127)), len(f))
        assert s == f[:cut]
    assert stopped[1][-1] == eos and len(stopped[1]) <= 4


def test_sampling_is_seeded_per_request():
    model = llama.model(LLAMA)
    params = params_of(model, 3)
    warm = Sampling(temperature=1.0, top_k=40)
    a = generate(model, params, PROMPTS, max_new_tokens=10, sampling=warm, key=ft.random.key(0))
    assert a == generate(model, params, PROMPTS, max_new_tokens=10, sampling=warm, key=ft.random.key(0))
    assert a != generate(model, params, PROMPTS, max_new_tokens=10, sampling=warm, key=ft.random.key(1))
    # a request with its own seed draws the same tokens alone or next to others, greedy or not
    seeded = attrs.evolve(warm, seed=7)
    mixed = generate(model, params, PROMPTS, max_new_tokens=10, sampling=[GREEDY, seeded, warm], key=ft.random.key(5))
    assert mixed[1] == generate(model, params, [PROMPTS[1]], max_new_tokens=10, sampling=seeded)[0]
    assert mixed[0] == generate(model, params, [PROMPTS[0]], max_new_tokens=10)[0]


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        ([[1], []], {}, "prompt 1 is empty"),
        ([[1, 999]], {}, r"prompt 0 has token ids \[999\]"),
        ([[1]], dict(max_new_tokens=0), "max_new_tokens"),
        ([[1]], dict(padding="middle"), "padding"),
        ([[1]], dict(sampling=Sampling()), "needs a key"),
        ([[1], [2]], dict(sampling=[GREEDY]), "1 Sampling settings for 2 prompts"),
    ],
)
def test_bad_requests_are_refused(prompts, kwargs, message):
    model = llama.model(LLAMA)
    params = params_of(model)
    with pytest.raises(ValueError, match=message):
        generate(model, params, prompts, **{"max_new_tokens": 2, **kwargs})


def test_generating_past_max_seq_len_warns_naming_it():
    model = llama.model(attrs.evolve(LLAMA, max_seq_len=10))
    params = model.init(ft.random.key(0))
    with pytest.warns(UserWarning, match=r"9 tokens\) \+ max_new_tokens=2 = 11 positions, more than the model's "
                      r"max_seq_len=10") as record:  # fmt: skip
        generate(model, params, PROMPTS, max_new_tokens=2)
    assert record[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(model, params, PROMPTS, max_new_tokens=1)  # 9 + 1 = 10 positions fit
