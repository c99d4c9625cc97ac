"""Data: document sources, tokenizers, packing, and resumable loaders.

The default pipeline, offline everywhere (the embedded stdlib corpus, a BPE trained on it)::

    import ftitan.data as fd

    tok = fd.tokenizer_for(run_dir, fd.stdlib_corpus(split="train"), vocab_size=2048)
    stream = fd.encode_documents(fd.stdlib_corpus(split="train"), tok, cache=run_dir / "train_tokens.npy")
    ds = fd.PackedDataset(fd.pack(stream, seq_len=256))
    state = fd.init_loader_state(0)
    batch, state = fd.next_batch(ds, state, batch_size=8)   # {"inputs": (8, 256), "targets": (8, 256)}

Data at scale: Parquet / JSONL / text shards streamed in lanes, sliced by data-parallel rank,
resumable on any data-parallel degree, tokenized ahead by a background thread (docs/data.md)::

    src = fd.shards("corpus/")                                  # files, directories, globs
    tok = fd.pretrained_tokenizer("path/to/hf_model")           # tokenizer.json + its BOS / EOS
    state = fd.init_stream_state(0, batch_size=8)               # global: one entry per row (lane)
    with fd.prefetch(fd.stream_batches(src, tok, state, seq_len=256, batch_size=8,
                                       dp_rank=0, dp_size=2)) as batches:
        batch = next(batches)                                   # rows 0..3 of global batch 0
        mine = batches.state                                    # position after it; merge_states -> global
    evals = fd.held_out_batches(src, tok, seq_len=256, batch_size=8)
"""

from ftitan.data.chat import (
    BUILTIN_TEMPLATE,
    ChatTemplate,
    ChatTokens,
    Conversation,
    chat_examples,
    encode_chat,
    load_chat_template,
    read_conversations,
    render_chat,
)
from ftitan.data.corpus import jsonl, stdlib_corpus, stdlib_files, text_files
from ftitan.data.heldout import held_out_batches
from ftitan.data.loader import (
    Batch,
    LoaderState,
    PackedDataset,
    epoch_order,
    eval_batches,
    init_loader_state,
    next_batch,
)
from ftitan.data.packing import PackedRows, encode_documents, pack, pack_documents, token_stream
from ftitan.data.preference import (
    PreferencePair,
    PreferenceRecord,
    collate_preferences,
    encode_preference,
    encode_preferences,
    parse_preference,
    parse_preferences,
    preference_batches,
    read_preferences,
    synthetic_preferences,
)
from ftitan.data.prefetch import Prefetcher, loader_throughput, prefetch
from ftitan.data.pretrained import pretrained_tokenizer
from ftitan.data.sft import ChatData, chat_conversations, prepare_chat
from ftitan.data.sources import Source, shards
from ftitan.data.stream import (
    Stream,
    StreamState,
    gather_state,
    init_stream_state,
    merge_states,
    stream_batches,
)
from ftitan.data.tasks import exact_match, parse_answer, task_items, write_task_jsonl
from ftitan.data.tokenizer import EOS, Tokenizer, load_tokenizer, tokenizer_for, train_tokenizer

__all__ = [
    "BUILTIN_TEMPLATE",
    "ChatTemplate",
    "ChatTokens",
    "ChatData",
    "chat_conversations",
    "prepare_chat",
    "Conversation",
    "chat_examples",
    "encode_chat",
    "load_chat_template",
    "read_conversations",
    "render_chat",
    "EOS",
    "Batch",
    "LoaderState",
    "PackedDataset",
    "Prefetcher",
    "Source",
    "Stream",
    "StreamState",
    "Tokenizer",
    "encode_documents",
    "epoch_order",
    "eval_batches",
    "exact_match",
    "gather_state",
    "held_out_batches",
    "init_loader_state",
    "init_stream_state",
    "jsonl",
    "load_tokenizer",
    "loader_throughput",
    "merge_states",
    "next_batch",
    "pack",
    "pack_documents",
    "parse_answer",
    "PackedRows",
    "prefetch",
    "PreferencePair",
    "PreferenceRecord",
    "collate_preferences",
    "encode_preference",
    "encode_preferences",
    "parse_preference",
    "parse_preferences",
    "preference_batches",
    "read_preferences",
    "synthetic_preferences",
    "pretrained_tokenizer",
    "shards",
    "stdlib_corpus",
    "stdlib_files",
    "stream_batches",
    "text_files",
    "token_stream",
    "task_items",
    "tokenizer_for",
    "train_tokenizer",
    "write_task_jsonl",
]
