"""Preference JSONL for DPO: record forms, the completion-only targets, malformed records, length limits."""

import json

import pytest
import torch

import ftitan.data as fd

IGNORE = -100
TEMPLATE = fd.load_chat_template(None)  # "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def scored_text(tok, inputs, targets):
    """The text of the scored tokens, and a check that targets are the next inputs where scored."""
    keep = targets != IGNORE
    idx = keep.nonzero().squeeze(1)[:-1]  # the last scored target is the row's last token: no input follows
    assert torch.equal(inputs[idx + 1], targets[idx])
    return tok.decode(targets[keep].tolist())


def test_string_and_conversation_forms_score_the_completion_only(tmp_path, small_tokenizer):
    convo = lambda answer: [  # noqa: E731
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "Another"},
        {"role": "assistant", "content": answer},
    ]
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "What is 2 + 2?", "chosen": "Four.", "rejected": "Five."},
        "",
        {"chosen": convo("Green, then red"), "rejected": convo("Blue again")},
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
         "chosen": [{"role": "assistant", "content": "Hello"}], "rejected": "Go away"},
    ])  # fmt: skip
    records = list(fd.read_preferences(path))
    assert [r.where for r in records] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert records[1].prompt == tuple(convo("")[:3]) and records[1].chosen == (convo("Green, then red")[3],)
    pairs = list(fd.encode_preferences(records, TEMPLATE, small_tokenizer, seq_len=128))
    want = [("Four.", "Five."), ("Green, then red", "Blue again"), ("Hello", "Go away")]
    for pair, (chosen, rejected) in zip(pairs, want, strict=True):
        assert not pair.truncated
        assert scored_text(small_tokenizer, pair.chosen_inputs, pair.chosen_targets) == chosen + "<|end|>\n"
        assert scored_text(small_tokenizer, pair.rejected_inputs, pair.rejected_targets) == rejected + "<|end|>\n"
    # the row is the rendered text shifted by one, padded with id 0 / IGNORE
    ids = small_tokenizer.encode(TEMPLATE.render([{"role": "user", "content": "What is 2 + 2?"},
                                                  {"role": "assistant", "content": "Four."}]))  # fmt: skip
    row = pairs[0].chosen_inputs
    assert row[: len(ids) - 1].tolist() == ids[:-1] and row[len(ids) - 1 :].eq(0).all()
    assert pairs[0].chosen_targets[len(ids) - 1 :].eq(IGNORE).all()


def test_batches_stack_pairs(small_tokenizer):
    records = fd.parse_preferences(fd.synthetic_preferences(5, seed=3), origin="synthetic")
    pairs = fd.encode_preferences(records, TEMPLATE, small_tokenizer, seq_len=96)
    batches = list(fd.preference_batches(pairs, batch_size=2))
    assert [b["chosen_inputs"].shape for b in batches] == [(2, 96), (2, 96), (1, 96)]
    assert set(batches[0]) == {"chosen_inputs", "chosen_targets", "rejected_inputs", "rejected_targets"}
    assert all(v.dtype == torch.int64 for b in batches for v in b.values())
    full = fd.preference_batches(fd.encode_preferences(fd.parse_preferences(fd.synthetic_preferences(5, seed=3)),
                                                       TEMPLATE, small_tokenizer, seq_len=96),
                                 batch_size=2, drop_last=True)  # fmt: skip
    assert len(list(full)) == 2


def test_synthetic_preferences_are_deterministic_and_correct():
    a, b = fd.synthetic_preferences(50, seed=7), fd.synthetic_preferences(50, seed=7)
    assert a == b and a != fd.synthetic_preferences(50, seed=8)
    for r in a:
        lhs, right = r["chosen"].split(" = ")
        assert eval(lhs) == int(right) != int(r["rejected"].split(" = ")[1])  # noqa: S307 (our own digits)
        assert r["prompt"] == f"What is {lhs}?"


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ({"prompt": "q", "chosen": "a"}, "missing 'rejected'"),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, '"chosen" must be a string or a list'),
        ({"chosen": "a", "rejected": "b"}, 'need a "prompt"'),
        ({"prompt": "q", "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"}, "unknown role 'bot'"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "chosen completion .* no assistant"),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "the same"),
        ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}, "prompt is empty"),
    ],
)  # fmt: skip
def test_malformed_record_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, line])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{message}"):
        list(fd.read_preferences(path))


def test_too_long_raises_or_truncates(tmp_path, small_tokenizer):
    long = "word " * 40  # the byte-level test BPE: about a token a character
    path = _write(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"},
                                         {"prompt": "q", "chosen": long, "rejected": "b"}])  # fmt: skip
    with pytest.raises(ValueError, match=r"p\.jsonl:2: the chosen side is \d+ tokens, more than seq_len \+ 1 = 49"):
        list(fd.encode_preferences(fd.read_preferences(path), TEMPLATE, small_tokenizer, seq_len=48))
    pairs = list(fd.encode_preferences(fd.read_preferences(path), TEMPLATE, small_tokenizer, seq_len=48, truncate=True))
    assert [p.truncated for p in pairs] == [False, True]
    assert pairs[1].chosen_targets[-1] != IGNORE and pairs[1].chosen_inputs.shape == (48,)  # cut: the row is full
    # a prompt that alone fills the row leaves nothing to score, truncate or not
    path = _write(tmp_path / "q.jsonl", [{"prompt": long, "chosen": "a", "rejected": "b"}])
    with pytest.raises(ValueError, match=r"q\.jsonl:1: the prompt fills seq_len=48"):
        list(fd.encode_preferences(fd.read_preferences(path), TEMPLATE, small_tokenizer, seq_len=48, truncate=True))


def test_synthetic_batches_train_a_tiny_policy(small_tokenizer):
    import attrs

    import ftitan as ft
    from ftitan.models import llama

    cfg = attrs.evolve(llama.Config.debug(), vocab_size=small_tokenizer.vocab_size, dim=32, n_layers=1, n_heads=4,
                       n_kv_heads=2, ffn_dim=48, max_seq_len=96)  # fmt: skip
    model = llama.model(cfg)
    params = model.init(ft.random.key(0))
    records = fd.parse_preferences(fd.synthetic_preferences(4, seed=0), origin="synthetic")
    pairs = fd.encode_preferences(records, TEMPLATE, small_tokenizer, seq_len=96)
    (batch,) = fd.preference_batches(pairs, batch_size=4)
    batch = ft.train.with_reference(model, params, batch)
    opt = ft.optim.adamw(1e-2)
    step = ft.train.make_train_step(ft.train.dpo_loss_fn(model, beta=0.5), opt)
    state, first = step(ft.train.init_state(params, opt), batch)
    for _ in range(4):
        state, m = step(state, batch)
    assert float(m["loss"]) < float(first["loss"]) and int(m["n_pairs"]) == 4
