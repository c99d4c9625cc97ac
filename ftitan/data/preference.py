"""Preference data for DPO (Rafailov et al. 2023): JSONL pairs, rendered with the chat template.

Records, one JSON object a line (blank lines are skipped)::

    {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}          # a user turn, then one assistant turn each
    {"chosen": [{"role": "user", ...}, {"role": "assistant", ...}],  # conversations: the messages they
     "rejected": [{"role": "user", ...}, {"role": "assistant", ...}]} #   share from the start are the prompt
    {"prompt": [messages...], "chosen": [messages...], "rejected": [messages...]}  # explicit prompt

A string prompt is a user turn and a string completion an assistant turn. Each completion
must hold an assistant turn; a malformed record raises one ``ValueError`` naming
``file:line`` and the reason.

Each side is rendered as ``prompt + completion`` by the chat template
(:func:`ftitan.data.render_chat`, the machinery of :func:`ftitan.data.encode_chat`) and
trained on the text of the completion's assistant turns only: the prompt, including any
assistant turns inside it, carries no log-prob. A row of ``seq_len`` positions holds
``seq_len + 1`` tokens: ``inputs = ids[:-1]``, ``targets = ids[1:]`` where the mask is set,
``IGNORE_INDEX`` elsewhere, padded with id 0 / ``IGNORE_INDEX``. A longer side raises naming
``file:line``, or with ``truncate=True`` keeps its first ``seq_len + 1`` tokens
(``PreferencePair.truncated``; count them to report cuts)::

    template, tok = load_chat_template(hf_dir), pretrained_tokenizer(hf_dir)
    pairs = encode_preferences(read_preferences("prefs.jsonl"), template, tok, seq_len=512, truncate=True)
    for batch in preference_batches(pairs, batch_size=8):
        batch["chosen_inputs"], batch["rejected_targets"]   # (8, 512) int64 each: ftitan.train.dpo_loss_fn's batch
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ftitan.data.chat import ROLES, ChatTemplate, _char_mask_cumsum, jsonl_records, render_chat

__all__ = [
    "PreferencePair", "PreferenceRecord", "collate_preferences", "encode_preference", "encode_preferences",
    "parse_preference", "parse_preferences", "preference_batches", "read_preferences", "synthetic_preferences",
]  # fmt: skip

IGNORE_INDEX = -100  # = ftitan.train.IGNORE_INDEX (not imported: ftitan.train imports the models)
PAD_ID = 0


class PreferenceRecord(NamedTuple):
    """One pair: the shared ``prompt`` messages, each side's completion messages, and ``"file:line"``."""

    prompt: tuple[dict[str, str], ...]
    chosen: tuple[dict[str, str], ...]
    rejected: tuple[dict[str, str], ...]
    where: str


class PreferencePair(NamedTuple):
    """One encoded pair, rows of ``seq_len`` positions, all ``(seq_len,)`` int64."""

    chosen_inputs: torch.Tensor  # (T,)
    chosen_targets: torch.Tensor  # (T,) IGNORE_INDEX off the chosen completion
    rejected_inputs: torch.Tensor  # (T,)
    rejected_targets: torch.Tensor  # (T,)
    truncated: bool  # a side was cut to seq_len + 1 tokens (truncate=True)
    where: str


# ---------------------------------------------------------------------------------------------- records


def _message_list(value: Any, key: str, default_role: str) -> list[dict[str, str]]:
    """A string is one ``default_role`` turn; a list must be ``{"role", "content"}`` objects."""
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list):
        raise ValueError(f'"{key}" must be a string or a list of messages, got {type(value).__name__}')
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f'{key}[{i}] must be an object with "role" and "content", got {m!r:.80}')
        if m["role"] not in ROLES:
            raise ValueError(f"{key}[{i}]: unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f'{key}[{i}]: "content" must be a string, got {type(m["content"]).__name__}')
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _split_prompt(chosen: list[dict[str, str]], rejected: list[dict[str, str]]) -> int:
    """The number of leading messages the two conversations share: the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return n


def parse_preference(record: Any, where: str = "<record>") -> PreferenceRecord:
    """One parsed JSON record as a :class:`PreferenceRecord`; raises ``ValueError("where: reason")``."""
    try:
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        missing = [k for k in ("chosen", "rejected") if k not in record]
        if missing:
            raise ValueError(f"missing {', '.join(map(repr, missing))}: a record needs \"chosen\" and \"rejected\" "
                             f"(strings with a \"prompt\", or conversations)")  # fmt: skip
        chosen = _message_list(record["chosen"], "chosen", "assistant")
        rejected = _message_list(record["rejected"], "rejected", "assistant")
        if "prompt" in record:
            prompt = _message_list(record["prompt"], "prompt", "user")
        elif isinstance(record["chosen"], str) or isinstance(record["rejected"], str):
            raise ValueError('string "chosen"/"rejected" need a "prompt"; or give both as conversations')
        else:
            n = _split_prompt(chosen, rejected)
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise ValueError("the prompt is empty: chosen and rejected must share their first message(s)")
        for side, msgs in (("chosen", chosen), ("rejected", rejected)):
            if not any(m["role"] == "assistant" for m in msgs):
                raise ValueError(f"the {side} completion (after the shared prompt) has no assistant turn: "
                                 f"there is nothing to score")  # fmt: skip
        if chosen == rejected:
            raise ValueError("chosen and rejected are the same: the pair carries no preference")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return PreferenceRecord(tuple(prompt), tuple(chosen), tuple(rejected), where)


def parse_preferences(records: Iterable[Any], origin: str = "<records>") -> Iterator[PreferenceRecord]:
    """:func:`parse_preference` over in-memory records (e.g. :func:`synthetic_preferences`), ``where="origin:i"``."""
    for i, record in enumerate(records, start=1):
        yield parse_preference(record, f"{origin}:{i}")


def read_preferences(path: str | Path) -> Iterator[PreferenceRecord]:
    """The pairs of a JSONL file in order; a malformed line raises ``ValueError("file:line: ...")``."""
    for where, record in jsonl_records(path):
        yield parse_preference(record, where)


# ---------------------------------------------------------------------------------------------- encoding


def _encode_side(prompt: Sequence[dict[str, str]], completion: Sequence[dict[str, str]], template: ChatTemplate,
                 tokenizer: Any, *, seq_len: int, truncate: bool, where: str,
                 side: str) -> tuple[torch.Tensor, torch.Tensor, bool]:  # fmt: skip
    """``(inputs, targets, truncated)``, rows of ``seq_len``; targets only on the completion's assistant text."""
    hf = getattr(tokenizer, "hf", tokenizer)
    text, spans = render_chat([*prompt, *completion], template, where=where)
    n_prompt = sum(m["role"] == "assistant" for m in prompt)  # spans are one per assistant turn, in order
    c = _char_mask_cumsum(len(text), spans[n_prompt:])
    enc = hf.encode(text, add_special_tokens=False)
    mask = [e > s and c[e] - c[s] == e - s for s, e in enc.offsets]  # a token is scored iff all of it is completion
    ids = enc.ids
    truncated = len(ids) > seq_len + 1
    if truncated and not truncate:
        raise ValueError(
            f"{where}: the {side} side is {len(ids)} tokens, more than seq_len + 1 = {seq_len + 1}; raise seq_len, "
            f"shorten or drop the record, or pass truncate=True to keep its first {seq_len + 1}"
        )
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    if not any(mask[1:]):
        raise ValueError(f"{where}: the prompt fills seq_len={seq_len}: no token of the {side} completion is left "
                         f"to score; raise seq_len or drop the record")  # fmt: skip
    inputs = torch.full((seq_len,), PAD_ID, dtype=torch.int64)
    targets = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
    n = len(ids) - 1
    inputs[:n] = torch.tensor(ids[:-1], dtype=torch.int64)
    targets[:n] = torch.where(torch.tensor(mask[1:]), torch.tensor(ids[1:], dtype=torch.int64), IGNORE_INDEX)
    return inputs, targets, truncated


def encode_preference(record: PreferenceRecord, template: ChatTemplate, tokenizer: Any, *, seq_len: int,
                      truncate: bool = False) -> PreferencePair:  # fmt: skip
    """Render, tokenize (no special tokens added), mask and pad both sides of one pair.

    ``tokenizer``: an ftitan :class:`~ftitan.data.Tokenizer` or a ``tokenizers.Tokenizer``.
    A side of more than ``seq_len + 1`` tokens raises naming ``record.where`` unless
    ``truncate=True``; a side with no completion token left raises either way.
    """
    if seq_len < 1:
        raise ValueError(f"encode_preference: seq_len={seq_len} must be >= 1")
    kw: dict[str, Any] = dict(seq_len=seq_len, truncate=truncate, where=record.where)
    ci, ct, c_cut = _encode_side(record.prompt, record.chosen, template, tokenizer, side="chosen", **kw)
    ri, rt, r_cut = _encode_side(record.prompt, record.rejected, template, tokenizer, side="rejected", **kw)
    return PreferencePair(ci, ct, ri, rt, c_cut or r_cut, record.where)


def encode_preferences(records: Iterable[PreferenceRecord], template: ChatTemplate, tokenizer: Any, *,
                       seq_len: int, truncate: bool = False) -> Iterator[PreferencePair]:  # fmt: skip
    """:func:`encode_preference` over ``records``; count ``truncated`` to report cuts."""
    for record in records:
        yield encode_preference(record, template, tokenizer, seq_len=seq_len, truncate=truncate)


def collate_preferences(pairs: Sequence[PreferencePair]) -> dict[str, torch.Tensor]:
    """The pairs stacked: ``{"chosen_inputs", "chosen_targets", "rejected_inputs", "rejected_targets"}`` (B, T)."""
    if not pairs:
        raise ValueError("collate_preferences: no pairs to stack")
    keys = ("chosen_inputs", "chosen_targets", "rejected_inputs", "rejected_targets")
    return {k: torch.stack([getattr(p, k) for p in pairs]) for k in keys}


def preference_batches(pairs: Iterable[PreferencePair], *, batch_size: int,
                       drop_last: bool = False) -> Iterator[dict[str, torch.Tensor]]:  # fmt: skip
    """Batches of ``batch_size`` pairs (:func:`collate_preferences`), in order; the last may be smaller
    unless ``drop_last`` (a compiled step or ``accum_steps`` may need every batch full)."""
    if batch_size < 1:
        raise ValueError(f"preference_batches: batch_size={batch_size} must be >= 1")
    buf: list[PreferencePair] = []
    for pair in pairs:
        buf.append(pair)
        if len(buf) == batch_size:
            yield collate_preferences(buf)
            buf = []
    if buf and not drop_last:
        yield collate_preferences(buf)


# ---------------------------------------------------------------------------------------------- synthetic


def synthetic_preferences(n: int, *, seed: int = 0, kind: str = "arith") -> list[dict[str, str]]:
    """``n`` arithmetic pairs ``{"prompt", "chosen", "rejected"}``, the same for the same ``seed``
    (``random.Random(seed)``), for ``dpo-debug`` runs and tests.

    ``kind="arith"``: the right sum or difference is chosen, a near miss rejected (a policy must do the
    arithmetic: learnable after SFT on it). ``kind="format"``: the right answer either way, stated in
    the house style (``"The answer is 95."``) or not (``"95, i think"``): a preference a policy learns
    from scratch within a few dozen steps.
    """
    if n < 0:
        raise ValueError(f"synthetic_preferences: n={n} must be >= 0")
    if kind not in ("arith", "format"):
        raise ValueError(f"synthetic_preferences: kind={kind!r}; use 'arith' or 'format'")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
        right = a + b if op == "+" else a - b
        wrong = right + rng.choice((-10, -2, -1, 1, 2, 10))
        if kind == "arith":
            chosen, rejected = f"{a} {op} {b} = {right}", f"{a} {op} {b} = {wrong}"
        else:
            chosen, rejected = f"The answer is {right}.", f"{right}, i think"
        out.append({"prompt": f"What is {a} {op} {b}?", "chosen": chosen, "rejected": rejected})
    return out
