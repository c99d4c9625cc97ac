"""The default pipeline end to end, on a slice of the stdlib corpus."""

import torch

import ftitan.data as fd


def test_stdlib_to_batches(small_docs, tmp_path, small_vocab):
    docs = small_docs[:20]
    tok = fd.tokenizer_for(tmp_path, docs, small_vocab)
    stream = fd.encode_documents(docs, tok, cache=tmp_path / "train_tokens.npy")
    ds = fd.PackedDataset(fd.pack(stream, seq_len=64))
    assert ds.seq_len == 64 and ds.num_rows == len(stream) // 65
    batch, state = fd.next_batch(ds, fd.init_loader_state(0), batch_size=4)
    assert batch["inputs"].shape == (4, 64)
    assert int(batch["inputs"].max()) < tok.vocab_size
    # every row decodes to a contiguous piece of the EOS-joined corpus
    text = "".join(d + fd.EOS for d in docs)
    for row in batch["inputs"]:
        assert tok.decode(row.tolist()) in text
    # a second run in the same directory reuses both caches and sees the same batch
    again = fd.PackedDataset(fd.pack(fd.encode_documents([], fd.tokenizer_for(tmp_path, [], small_vocab),
                                                         cache=tmp_path / "train_tokens.npy"), seq_len=64))
    assert torch.equal(fd.next_batch(again, fd.init_loader_state(0), batch_size=4)[0]["inputs"], batch["inputs"])
