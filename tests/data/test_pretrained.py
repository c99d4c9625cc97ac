"""Pretrained HF tokenizers: ids checked against transformers' AutoTokenizer on a tokenizer.json built here."""

import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

import ftitan.data as fd
from ftitan.data.tokenizer import EOS

SPECIALS = ["<pad>", "<s>", "</s>"]
SAMPLES = ["Hello world", " leading space and\ttabs\n", "ünïcödé 日本語 🐍", "def f(x):\n    return x + 1\n", ""]


@pytest.fixture(scope="module")
def hf_tokenizer(small_docs):
    """A tiny byte-level BPE with <s> / </s> and a post-processor that adds <s> (encode must not)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(small_docs[:20], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def save(tok, folder, **files):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        (folder / f"{name}.json").write_text(json.dumps(content))
    return folder


def test_same_ids_as_transformers(hf_tokenizer, tmp_path, small_docs):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(tmp_path)  # fmt: skip
    ref = AutoTokenizer.from_pretrained(tmp_path)
    tok = fd.pretrained_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert tok.vocab_size == len(ref)
    for text in SAMPLES + small_docs[20:23]:
        assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]
    assert fd.pretrained_tokenizer(tmp_path / "tokenizer.json").eos_id == 2  # the file itself works too


def test_where_bos_and_eos_come_from(hf_tokenizer, tmp_path):
    def ids(**files):
        folder = save(hf_tokenizer, tmp_path / str(len(list(tmp_path.iterdir()))), **files)
        tok = fd.pretrained_tokenizer(folder)
        return tok.bos_id, tok.eos_id

    assert ids(tokenizer_config={"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}) == (1, 2)
    assert ids(special_tokens_map={"bos_token": "<s>", "eos_token": {"content": "</s>"}}) == (1, 2)
    assert ids(tokenizer_config={"bos_token": None, "eos_token": "</s>"}, config={"bos_token_id": 1}) == (None, 2)
    assert ids(tokenizer_config={"eos_token": "</s>"}, special_tokens_map={"bos_token": "<s>"}) == (1, 2)
    assert ids(generation_config={"bos_token_id": 1, "eos_token_id": [2, 0]}) == (1, 2)
    assert ids(config={"text_config": {"eos_token_id": 2}}) == (None, 2)
    assert ids(tokenizer_config={"eos_token": None}, config={"eos_token_id": 2}) == (None, 2)


def test_errors(hf_tokenizer, tmp_path, small_tokenizer):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json does not exist"):
        fd.pretrained_tokenizer(tmp_path)
    folder = save(hf_tokenizer, tmp_path / "none")
    with pytest.raises(ValueError, match=r"none/tokenizer\.json: the tokenizer has no EOS token.*add \"eos_token\""):
        fd.pretrained_tokenizer(folder)
    folder = save(hf_tokenizer, tmp_path / "unknown", tokenizer_config={"eos_token": "<|end|>"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|end\|>' is not in the vocabulary"):
        fd.pretrained_tokenizer(folder)
    # a tokenizer.json that ftitan trained: its <|eos|>, no BOS
    small_tokenizer.hf.save(str(tmp_path / "ours.json"))
    tok = fd.pretrained_tokenizer(tmp_path / "ours.json")
    assert (tok.bos_id, tok.eos_id) == (None, small_tokenizer.eos_id)
    with pytest.raises(ValueError, match="eos_id=999 is outside the vocabulary"):
        fd.Tokenizer(hf_tokenizer, eos_id=999)
    with pytest.raises(ValueError, match=f"no {EOS!r} special token"):
        fd.Tokenizer(hf_tokenizer)


def test_packing_adds_bos_and_eos_around_each_document(hf_tokenizer, tmp_path):
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    tok = fd.pretrained_tokenizer(save(hf_tokenizer, tmp_path / "t", tokenizer_config=config))
    docs = ["first document", "second one"]
    stream = fd.encode_documents(docs, tok)
    assert stream.tolist() == [1, *tok.encode(docs[0]), 2, 1, *tok.encode(docs[1]), 2]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d * 5}) + "\n" for d in docs))
    batch = next(fd.stream_batches(fd.shards(tmp_path / "d.jsonl"), tok, fd.init_stream_state(0, 1), seq_len=8,
                                   batch_size=1, eval_fraction=0.0, segments=True))  # fmt: skip
    assert batch["inputs"][0, 0] == 1 and batch["positions"][0, 0] == 0  # a lane starts at a document's BOS
    starts = batch["positions"][0] == 0
    assert torch.all(batch["inputs"][0][starts] == 1)
