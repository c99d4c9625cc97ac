"""Exact-match evaluation by greedy generation: scoring, determinism, and parity with a cache-free greedy loop."""

import pytest
import torch

import ftitan as ft
from ftitan.data import ChatTemplate, Tokenizer, load_chat_template, train_tokenizer
from ftitan.data.tasks import task_items
from ftitan.models import llama
from ftitan.train.exact_match import (
    completion_text,
    end_marker,
    exact_match_eval,
    greedy_completions,
    greedy_tokens,
    score_completions,
)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MAX_NEW = 12


@pytest.fixture(scope="module")
def template():
    return load_chat_template(None)


@pytest.fixture(scope="module")
def tokenizer(template):
    docs = [template.render(it["messages"]) for it in task_items(500, seed=0, split="train")]
    return train_tokenizer(docs, 290)


@pytest.fixture(scope="module")
def model_and_params(tokenizer):
    # an untrained model; init_std 0.5 spreads the logits so that no greedy pick is a near tie, which
    # float rounding (cached vs full-sequence attention, padded vs not) could flip
    cfg = llama.Config(vocab_size=tokenizer.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                       max_seq_len=128, init_std=0.5)  # fmt: skip
    model = llama.model(cfg)
    return model, model.init(ft.random.key(0))


@pytest.fixture(scope="module")
def items():
    # 3, 4 and 5 letters: prompts of three lengths, padded together in one batch
    by_len = {}
    for it in task_items(50, seed=0, split="eval"):
        by_len.setdefault(len(it["messages"][0]["content"]), it)
    return [by_len[k] for k in sorted(by_len)][:3]


def test_end_marker_of_templates(template):
    assert end_marker(template) == "<|end|>"
    assert end_marker(ChatTemplate(CHATML)) == "<|im_end|>"
    assert end_marker(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")) is None


def _item(answer):
    return {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": f"The answer is {answer}."}]}  # fmt: skip


def test_score_completions_counts_parsed_and_right():
    items = [_item("t a c"), _item("95"), _item("x y z"), _item("12")]
    completions = ["The answer is t a c.", "The answer is 96.", "x y z", "The answer is 12"]
    assert score_completions(completions, items) == {"parse_rate": 0.5, "exact_match": 0.25}
    assert score_completions(["The answer is t a c."], items[:1]) == {"parse_rate": 1.0, "exact_match": 1.0}
    with pytest.raises(ValueError, match="3 completions for 4 items"):
        score_completions(completions[:3], items)


def test_completion_text_stops_at_the_end_marker(tokenizer, template):
    ids = tokenizer.encode("The answer is t a c.<|end|>\n<|user|>\nmore")
    assert completion_text(ids, tokenizer, template) == "The answer is t a c."


def _reference_greedy(model, params, prompt, stop):
    """Greedy by brute force: the whole sequence through ``model.apply`` each step, no KV cache, no padding."""
    seq, new = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits, _ = model.apply(params, torch.tensor([seq]))
            t = int(logits[0, -1].argmax())
            if t in stop:
                break
            seq.append(t)
            new.append(t)
    return new


def test_greedy_tokens_match_a_cache_free_greedy_loop(model_and_params, tokenizer, template, items):
    model, params = model_and_params
    prompts = [tokenizer.encode(template.render(it["messages"][:-1], add_generation_prompt=True)) for it in items]
    assert len({len(p) for p in prompts}) == 3  # the batch is ragged: left padding is exercised
    got = greedy_tokens(model, params, tokenizer, template, items, max_new_tokens=MAX_NEW, batch_size=3)
    want = [_reference_greedy(model, params, p, {tokenizer.eos_id}) for p in prompts]
    assert got == want
    # a stop token the model does emit: each row ends before its first one, the others run on
    stop = got[0][3]
    stopping = Tokenizer(tokenizer.hf, eos_id=stop)
    got = greedy_tokens(model, params, stopping, template, items, max_new_tokens=MAX_NEW, batch_size=3)
    assert got == [_reference_greedy(model, params, p, {stop}) for p in prompts]
    assert got[0] == want[0][:want[0].index(stop)]


def test_eval_is_deterministic_and_batch_size_free(model_and_params, tokenizer, template):
    model, params = model_and_params
    evals = task_items(8, seed=0, split="eval")
    kw = dict(max_new_tokens=MAX_NEW)
    texts = greedy_completions(model, params, tokenizer, template, evals, batch_size=8, **kw)
    assert greedy_completions(model, params, tokenizer, template, evals, batch_size=3, **kw) == texts
    scores = exact_match_eval(model, params, tokenizer, template, evals, batch_size=8, **kw)
    assert scores == score_completions(texts, evals)
    assert set(scores) == {"parse_rate", "exact_match"}
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    assert exact_match_eval(model, params, tokenizer, template, evals, batch_size=8, **kw) == scores
