"""Data: document sources, a byte-level BPE tokenizer, packing, and a resumable loader.

The default pipeline, offline everywhere::

    import ftitan.data as fd

    tok = fd.tokenizer_for(run_dir, fd.stdlib_corpus(split="train"), vocab_size=2048)
    stream = fd.encode_documents(fd.stdlib_corpus(split="train"), tok, cache=run_dir / "train_tokens.npy")
    ds = fd.PackedDataset(fd.pack(stream, seq_len=256))
    state = fd.init_loader_state(0)
    batch, state = fd.next_batch(ds, state, batch_size=8)   # {"inputs": (8, 256), "targets": (8, 256)}
"""

from ftitan.data.corpus import jsonl, stdlib_corpus, stdlib_files, text_files
from ftitan.data.loader import (
    Batch,
    LoaderState,
    PackedDataset,
    epoch_order,
    eval_batches,
    init_loader_state,
    next_batch,
)
from ftitan.data.packing import encode_documents, pack, token_stream
from ftitan.data.tokenizer import EOS, Tokenizer, load_tokenizer, tokenizer_for, train_tokenizer

__all__ = [
    "EOS",
    "Batch",
    "LoaderState",
    "PackedDataset",
    "Tokenizer",
    "encode_documents",
    "epoch_order",
    "eval_batches",
    "init_loader_state",
    "jsonl",
    "load_tokenizer",
    "next_batch",
    "pack",
    "stdlib_corpus",
    "stdlib_files",
    "text_files",
    "token_stream",
    "tokenizer_for",
    "train_tokenizer",
]
