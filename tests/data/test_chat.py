"""Chat SFT data: records, templates, the assistant mask (parity with transformers), length limits."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ftitan.data as fd

# ChatML-like, with transformers' {% generation %} markers around what the assistant writes
# (its content, the end token and the newline after it: the text that turn adds).
GEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Renders the message count first: the render of k turns is not a prefix of the render of k + 1.
COUNTING_TEMPLATE = "{{ messages | length }} messages\n" + GEN_TEMPLATE

CHATS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course."},
    ],
    [
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "Another"},
        {"role": "assistant", "content": "Green, then red"},
        {"role": "user", "content": "thanks"},
    ],
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny byte-level BPE with ChatML special tokens, saved by transformers with GEN_TEMPLATE."""
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    corpus = [m["content"] for chat in CHATS for m in chat] * 3 + ["user assistant system"] * 3
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.chat_template = GEN_TEMPLATE
    out = tmp_path_factory.mktemp("hf")
    fast.save_pretrained(out)
    return out


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_matches_transformers_assistant_mask(hf_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    template = fd.load_chat_template(hf_dir)
    tok = fd.pretrained_tokenizer(hf_dir)
    assert "generation" in template.source and dict(template.special_tokens)["bos_token"] == "<s>"
    for chat in CHATS:
        want = ref.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        got = fd.encode_chat(chat, template, tok, seq_len=1024)
        assert got.ids.tolist() == list(want["input_ids"])
        assert got.mask.tolist() == list(want["assistant_masks"])
        assert 0 < sum(got.mask.tolist()) < len(got.mask)


def test_template_from_config_list_takes_default(hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": GEN_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = fd.load_chat_template(tmp_path)
    assert template.source == GEN_TEMPLATE
    assert template.render(CHATS[0][:1], add_generation_prompt=True).startswith("<s><|im_start|>user\nHello")


def test_not_prefix_stable_template_is_refused(tmp_path):
    template = fd.ChatTemplate(COUNTING_TEMPLATE, (("bos_token", "<s>"),), origin="counting")
    with pytest.raises(ValueError, match=r"x\.jsonl:7: counting is not prefix-stable at turn 1 \(assistant\)"):
        fd.render_chat(CHATS[0], template, where="x.jsonl:7")


def test_raise_exception_names_the_record():
    template = fd.ChatTemplate("{{ raise_exception('no system role here') }}")
    with pytest.raises(ValueError, match=r"a\.jsonl:3: rendering messages\[:1\].*no system role here"):
        fd.render_chat(CHATS[1], template, where="a.jsonl:3")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"messages": [', "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"text": "hi"}, 'needs "messages"'),
        ({"messages": []}, '"messages" is empty'),
        ({"messages": "hi"}, '"messages" must be a list'),
        ({"messages": [{"role": "user"}]}, r'messages\[0\] must be an object with "role" and "content"'),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]: unknown role 'bot'"),
        ({"messages": [{"role": "user", "content": 3}]}, r'messages\[0\]: "content" must be a string'),
        ({"messages": [{"role": "user", "content": "x"}]}, "has no assistant turn"),
        ({"prompt": "x"}, 'both "prompt" and "completion"'),
        ({"prompt": "x", "completion": None}, '"completion" must be a string'),
        ({"prompt": "x", "completion": "y", "messages": []}, "keep one form"),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path, line, reason):
    path = _write(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, "", line])
    it = fd.read_conversations(path)
    assert next(it).where == f"{path}:1"
    with pytest.raises(ValueError, match=rf"{path}:3: .*{reason}"):
        next(it)


def test_builtin_template_and_prompt_completion(tmp_path, small_tokenizer):
    assert fd.load_chat_template(tmp_path).source == fd.BUILTIN_TEMPLATE  # a directory without a template
    template = fd.load_chat_template(None)
    path = _write(tmp_path / "d.jsonl", [{"prompt": "Hi", "completion": "Hello!"}, {"messages": CHATS[1]}])
    first, second = fd.chat_examples(path, template, small_tokenizer, seq_len=512)
    hi = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    text, spans = fd.render_chat(hi, template)
    assert text == "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
    assert [text[s:e] for s, e in spans] == ["Hello!<|end|>\n"]
    assert small_tokenizer.decode(first.ids.tolist()) == text
    assert first.where == f"{path}:1" and not first.truncated
    # the trained tokens are the assistant text: a trained token never straddles a header
    trained = small_tokenizer.decode([i for i, m in zip(first.ids.tolist(), first.mask.tolist()) if m])
    assert trained == "Hello!<|end|>\n"
    trained2 = small_tokenizer.decode([i for i, m in zip(second.ids.tolist(), second.mask.tolist()) if m])
    assert trained2 == "Four.<|end|>\nSix, of course.<|end|>\n"


def test_too_long_is_refused_or_truncated(tmp_path, small_tokenizer):
    template = fd.load_chat_template(None)
    path = _write(tmp_path / "d.jsonl", [{"prompt": "short", "completion": "ok"}, {"messages": CHATS[1]}])
    with pytest.raises(ValueError, match=rf"{path}:2: the conversation is \d+ tokens, longer than seq_len=80"):
        list(fd.chat_examples(path, template, small_tokenizer, seq_len=80))
    full = list(fd.chat_examples(path, template, small_tokenizer, seq_len=1024))
    cut = list(fd.chat_examples(path, template, small_tokenizer, seq_len=80, truncate=True))
    assert [c.truncated for c in cut] == [False, True]
    assert len(cut[1].ids) == len(cut[1].mask) == 80
    assert cut[1].ids.tolist() == full[1].ids[:80].tolist()
    assert cut[1].mask.tolist() == full[1].mask[:80].tolist()
