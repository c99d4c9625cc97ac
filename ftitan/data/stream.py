"""A deterministic global stream of packed rows, read by data-parallel ranks in slices, resumable anywhere.

Lanes. Row ``j`` of every global batch of ``B`` rows comes from lane ``j``.
The source's chunks (:mod:`ftitan.data.sources`: a JSONL byte range, a Parquet
row group, a ``.txt`` file) form one infinite order: epoch 0's chunks in the
order ``epoch_order(key, 0, num_chunks)``, then epoch 1's, and so on. Lane
``j`` reads the chunks at places ``j, j + B, j + 2B, ...`` of that order, their
documents in file order, skipping held-out ones (:mod:`ftitan.data.heldout`);
it packs them (``[BOS] ids EOS``) end to end and cuts rows of ``seq_len + 1``
tokens, carrying the rest of a document into its next row. A row may span
document boundaries (``segments=True`` adds per-token ``segment_ids`` and
``positions`` to say where); no token is padding, none is lost. Each chunk of
an epoch goes to exactly one lane, so each document is trained on once per
epoch; lanes cross into the next epoch at slightly different steps.

Data parallelism. Rank ``r`` of ``d`` owns lanes ``[r B/d, (r+1) B/d)``: its
batch is those rows of the global batch, and it opens, reads and tokenizes
only its own lanes' chunks. A lane's rows depend on nothing but the lane index
and the chunk order, hence the same global batches for any ``d`` dividing ``B``.
Each lane keeps one open chunk and about a row of tokens: memory does not grow
with the run.

Position. :class:`StreamState` holds, per lane, its current chunk, the record
in it, and the tokens of that document already served: three ``(B,)`` int64
tensors. It is global and canonical: after ``k`` steps it is the same whatever
``d`` ran them. A rank advances only its own lanes; :func:`merge_states` (or
:func:`gather_state`, one all-gather) assembles the global state from the
ranks', and any ``d'`` dividing ``B`` resumes from it bit-identically.

Example::

    src = shards("corpus/")
    state = init_stream_state(0, batch_size=8)
    stream = stream_batches(src, tok, state, seq_len=256, batch_size=8, dp_rank=1, dp_size=2)
    batch = next(stream)        # {"inputs": (4, 256), "targets": (4, 256)}: rows 4..7 of global batch 0
    saved = stream.state        # after that batch; merge the ranks' states to checkpoint
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from ftitan import random
from ftitan.data.heldout import HeldOut, _check_dp, held_out
from ftitan.data.lanes import Doc, Lane, encode_docs, rows_to_batch
from ftitan.data.loader import Batch, _order
from ftitan.data.sources import Source
from ftitan.data.tokenizer import Tokenizer

__all__ = ["Stream", "StreamState", "gather_state", "init_stream_state", "merge_states", "stream_batches"]

_LANE_FIELDS = ("chunk", "record", "offset")
_CHARS_PER_TOKEN = 6  # read-ahead estimate (low on purpose): more documents are read, batched into one encode
_EMPTY_VISITS = 20  # a lane gives up after 20 * num_chunks + 100 chunks in a row with no training document


class StreamState(NamedTuple):
    """Where a stream is: 0-d ``key`` and ``num_chunks``, and three ``(B,)`` int64 tensors, one entry per lane.

    Lane ``j``'s current document is its first training document at or after
    record ``record[j]`` of the chunk at place ``chunk[j]`` of the chunk order
    (``chunk[j] % B == j``); ``offset[j]`` of its tokens were served.
    """

    key: torch.Tensor  # shuffle key (ftitan.random): epoch e orders chunks by epoch_order(key, e, num_chunks)
    num_chunks: torch.Tensor  # chunks of the source the state was made on (0: not bound to a source yet)
    chunk: torch.Tensor  # (B,) place in the infinite chunk order; epoch = chunk // num_chunks
    record: torch.Tensor  # (B,) record index within that chunk
    offset: torch.Tensor  # (B,) tokens of the current document already served

    @property
    def batch_size(self) -> int:
        return self.chunk.shape[0]

    @property
    def epoch(self) -> torch.Tensor:
        """``(B,)`` each lane's epoch (0 before the state is bound to a source)."""
        return self.chunk // self.num_chunks if int(self.num_chunks) else torch.zeros_like(self.chunk)


def init_stream_state(seed: int | torch.Tensor, batch_size: int) -> StreamState:
    """The start of the stream for a global batch of ``batch_size`` rows (lanes), shuffle key from a seed or key."""
    if batch_size < 1:
        raise ValueError(f"init_stream_state: batch_size must be >= 1, got {batch_size}")
    k = random.key(seed) if isinstance(seed, int) else seed
    random.key_data(k)  # validates it is a key
    lanes = torch.arange(batch_size, dtype=torch.int64)
    return StreamState(k, torch.zeros((), dtype=torch.int64), lanes, torch.zeros_like(lanes), torch.zeros_like(lanes))


def _lanes(batch_size: int, dp_rank: int, dp_size: int) -> range:
    per = batch_size // dp_size
    return range(dp_rank * per, (dp_rank + 1) * per)


def merge_states(states: Sequence[StreamState]) -> StreamState:
    """The global state from the states of dp ranks ``0 .. d-1`` (``states[r]``): lane ``j`` from its owner."""
    if not states:
        raise ValueError("merge_states: no states given")
    b, d = states[0].batch_size, len(states)
    if b % d:
        raise ValueError(f"merge_states: {d} states cannot split {b} lanes evenly")
    bound = {int(s.num_chunks) for s in states} - {0}
    for r, s in enumerate(states):
        if s.batch_size != b or not torch.equal(s.key, states[0].key) or len(bound) > 1:
            raise ValueError(f"merge_states: state {r} has another key, lane count or source than state 0; "
                             f"pass the states of one stream's dp ranks, in rank order")  # fmt: skip
    per = b // d
    fields = [torch.cat([s[i][r * per : (r + 1) * per] for r, s in enumerate(states)]) for i in range(2, 5)]
    num_chunks = torch.tensor(bound.pop() if bound else 0, dtype=torch.int64)
    return StreamState(states[0].key, num_chunks, *fields)


def gather_state(state: StreamState, *, group: object = None) -> StreamState:
    """The global state, on every rank of ``group`` (collective): ``merge_states`` of an all-gather.

    ``group`` (a ``torch.distributed`` process group, default the world) must
    hold exactly the data-parallel ranks, group rank ``r`` being dp rank ``r``.
    """
    import torch.distributed as dist

    d = dist.get_world_size(group)  # type: ignore[arg-type]
    nccl = dist.get_backend(group) == "nccl"  # type: ignore[arg-type]
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mine = torch.stack([state.num_chunks.expand(state.batch_size), *state[2:]]).to(device)  # (4, B)
    parts = [torch.empty_like(mine) for _ in range(d)]
    dist.all_gather(parts, mine, group=group)  # type: ignore[arg-type]
    return merge_states([StreamState(state.key, p[0, 0].cpu(), *p[1:].cpu().unbind(0)) for p in parts])


def _chunk_at(key: torch.Tensor, place: int, num_chunks: int) -> int:
    epoch, i = divmod(place, num_chunks)
    return int(_order(key, epoch, num_chunks)[i])


def _lane_docs(source: Source, key: torch.Tensor, split: HeldOut, lane: Lane, batch_size: int) -> Iterator[Doc]:
    """The lane's training documents from its cursor on: chunks at places ``chunk, chunk + B, ...``."""
    n, place, record, empty = source.num_chunks, lane.chunk, lane.record, 0
    while True:
        chunk = _chunk_at(key, place, n)
        found = False
        for rec, text in enumerate(source.records(chunk, record), start=record):
            part = split.part(chunk, rec, text, train=True)
            if part is not None:
                found = True
                yield Doc(place, rec, text, part)
        empty = 0 if found else empty + 1
        if empty > _EMPTY_VISITS * n + 100:
            raise ValueError(f"shards {[str(f) for f in source.files[:3]]}: lane {lane.index} read {empty} chunks "
                             f"in a row without a training document; is the source empty or all held out?")  # fmt: skip
        place, record = place + batch_size, 0


class Stream(Iterator[Batch]):
    """This rank's rows of successive global batches; ``state`` is the global position after the last one.

    Built by :func:`stream_batches`; infinite (epochs follow each other).
    """

    def __init__(self, source: Source, tokenizer: Tokenizer, state: StreamState, *, seq_len: int,
                 batch_size: int, dp_rank: int, dp_size: int, eval_fraction: float, segments: bool) -> None:
        _check_dp(batch_size, dp_rank, dp_size, seq_len)
        if state.batch_size != batch_size:
            raise ValueError(f"stream_batches: the state has {state.batch_size} lanes but batch_size={batch_size}; "
                             f"a stream resumes with the global batch size it was saved with")  # fmt: skip
        n, bound = source.num_chunks, int(state.num_chunks)
        if n == 0:
            raise ValueError(f"shards {[str(f) for f in source.files[:3]]}: the files hold no records")
        if bound not in (0, n):
            raise ValueError(f"stream_batches: the state was saved for a source of {bound} chunks, this one has {n}; "
                             f"resume with the same files and chunk_bytes")  # fmt: skip
        self.tokenizer, self.seq_len, self.segments = tokenizer, seq_len, segments
        self._start = state._replace(num_chunks=torch.tensor(n, dtype=torch.int64))
        split = held_out(source, tokenizer, seq_len=seq_len, eval_fraction=eval_fraction)
        chunk, record, offset = (t.tolist() for t in state[2:])
        self._lanes: list[Lane] = []
        for j in _lanes(batch_size, dp_rank, dp_size):
            if chunk[j] % batch_size != j or min(chunk[j], record[j], offset[j]) < 0:
                raise ValueError(f"stream state: lane {j} has chunk {chunk[j]}, record {record[j]}, offset "
                                 f"{offset[j]}; a lane's chunk is j mod batch_size, none is negative")  # fmt: skip
            lane = Lane(j, chunk[j], record[j], offset[j])
            lane.reader = _lane_docs(source, state.key, split, lane, batch_size)
            self._lanes.append(lane)

    @property
    def state(self) -> StreamState:
        """The global position after the last batch served (other ranks' lanes as this stream started)."""
        fields = [t.clone() for t in self._start[2:]]
        lo = self._lanes[0].index
        for i, name in enumerate(_LANE_FIELDS):
            fields[i][lo : lo + len(self._lanes)] = torch.tensor([getattr(lane, name) for lane in self._lanes])
        return StreamState(self._start.key, self._start.num_chunks, *fields)

    def _read_ahead(self) -> None:
        """Read about a row's worth of documents for every lane short of one; encode them all in one call."""
        dealt: list[Doc] = []
        for lane in self._lanes:
            have = lane.tokens_ahead()
            while have < self.seq_len + 1:
                doc = next(lane.reader)  # type: ignore[arg-type]
                lane.queue.append(doc)
                dealt.append(doc)
                have += len(doc.text or "") // _CHARS_PER_TOKEN + 1
        encode_docs(dealt, self.tokenizer)

    def _more(self, lane: Lane) -> bool:
        doc = next(lane.reader)  # type: ignore[arg-type]
        encode_docs([doc], self.tokenizer)
        lane.queue.append(doc)
        return True

    def __next__(self) -> Batch:
        self._read_ahead()
        rows = [lane.fill(self.seq_len + 1, self._more, segments=self.segments) for lane in self._lanes]
        return rows_to_batch(rows)  # type: ignore[arg-type]  (an infinite stream always fills a row)


def stream_batches(source: Source, tokenizer: Tokenizer, state: StreamState, *, seq_len: int, batch_size: int,
                   dp_rank: int = 0, dp_size: int = 1, eval_fraction: float = 0.02,
                   segments: bool = False) -> Stream:
    """Rank ``dp_rank``'s rows of the global training batches of ``source``, from ``state``.

    Each ``next()`` gives ``{"inputs": (b, T), "targets": (b, T)}`` int64 with ``b = batch_size / dp_size``,
    ``T = seq_len`` (targets: inputs shifted left by one), plus ``"segment_ids"`` / ``"positions"`` ``(b, T)``
    with ``segments``. ``eval_fraction`` chooses the held-out documents (see :mod:`ftitan.data.heldout`;
    0 when a separate eval source is used). ``.state`` is the position after the last batch served.
    """
    return Stream(source, tokenizer, state, seq_len=seq_len, batch_size=batch_size, dp_rank=dp_rank,
                  dp_size=dp_size, eval_fraction=eval_fraction, segments=segments)  # fmt: skip
