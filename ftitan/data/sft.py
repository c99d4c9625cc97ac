"""From chat conversations to packed SFT rows (``ftitan train --data.chat``), and preference pairs to
DPO rows (``--data.preference``).

``--data.chat FILE.jsonl`` (or ``task:NAME``, a synthetic task made locally by
:mod:`ftitan.data.tasks`) is read whole, rendered with the run's chat template
(the checkpoint's own, :func:`ftitan.data.load_chat_template`; the built-in one
for a run that trains its own tokenizer), tokenized with an assistant-only loss
mask (:func:`ftitan.data.encode_chat`) and packed into rows of ``seq_len``
tokens (:func:`ftitan.data.pack_documents`: block-diagonal attention, positions
restarting per conversation). The rows are served by the resumable shuffling
loader like pretraining rows.

Held-out conversations: every 20th of a file (at least one), or the task's own
held-out split. A conversation longer than ``seq_len + 1`` tokens is refused
naming its ``file:line``, or cut under ``--data.truncate`` and counted
(``data.truncated`` in the run's first metrics record).

Preference pairs (``{"prompt", "chosen", "rejected"}``, :mod:`ftitan.data.preference`; or
``task:arith`` / ``task:format``, :func:`ftitan.data.synthetic_preferences`) become one row per side:
``chosen_inputs`` / ``chosen_targets`` / ``rejected_inputs`` / ``rejected_targets``, the targets on
the completion only. Held out the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ftitan.data.chat import ChatTemplate, ChatTokens, Conversation, encode_chat, load_chat_template, read_conversations
from ftitan.data.loader import PackedDataset
from ftitan.data.packing import pack_documents
from ftitan.data.preference import (
    PreferenceRecord,
    collate_preferences,
    encode_preferences,
    parse_preferences,
    read_preferences,
    synthetic_preferences,
)

if TYPE_CHECKING:
    from ftitan.config.schema import TrainConfig

__all__ = ["EVAL_EVERY", "PREFERENCE_TASKS", "TASK_PREFIX", "TASK_TRAIN_ITEMS", "ChatData", "chat_conversations",
           "chat_template_of", "preference_records", "prepare_chat", "prepare_preferences"]  # fmt: skip

TASK_PREFIX = "task:"
TASK_TRAIN_ITEMS = 8_000  # training conversations a synthetic task makes (the loader cycles over them)
EVAL_EVERY = 20  # of a file's conversations, every EVAL_EVERY-th is held out
TEMPLATE_FILE = "chat_template.jinja"  # the run's template, kept in its directory (and exported by convert)
PREFERENCE_ITEMS = 2_000  # pairs a synthetic preference task makes
PREFERENCE_TASKS = ("arith", "format")  # --data.preference task:NAME (ftitan.data.synthetic_preferences kinds)


T = TypeVar("T")


class ChatData(NamedTuple):
    """A run's SFT rows, held-out rows, counts for the metrics, and its chat template."""

    train: PackedDataset
    eval: PackedDataset
    stats: dict[str, float]  # data.conversations (training), data.rows, data.fill, data.target_tokens, data.truncated
    template: ChatTemplate


def _task(spec: str) -> str:
    from ftitan.data import tasks

    name = spec.removeprefix(TASK_PREFIX)
    if name not in tasks.TASKS:
        raise ValueError(f"--data.chat {spec}: no synthetic task {name!r}; known: "
                         f"{', '.join(TASK_PREFIX + t for t in sorted(tasks.TASKS))}")  # fmt: skip
    return name


def chat_conversations(spec: str, *, split: str, seed: int = 0) -> list[Conversation]:
    """The ``split`` (``"train"`` / ``"eval"``) conversations of ``--data.chat spec``, in order."""
    if spec.startswith(TASK_PREFIX):
        from ftitan.data import tasks

        name = _task(spec)
        n = TASK_TRAIN_ITEMS if split == "train" else tasks.EVAL_ITEMS
        items = tasks.task_items(n, seed=seed, split=split, task=name)
        return [Conversation(tuple(it["messages"]), f"{spec}#{split}{i}") for i, it in enumerate(items)]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--data.chat {spec}: no such file; pass a .jsonl of conversations or task:NAME")
    return _held_out(list(read_conversations(path)), split, f"--data.chat {spec}")


def _held_out(every: list[T], split: str, what: str) -> list[T]:
    """A file's ``split``: every :data:`EVAL_EVERY`-th record is held out (the last one when there are fewer;
    a file of one record is both)."""
    if not every:
        raise ValueError(f"{what}: no records in the file")
    held = {i for i in range(len(every)) if i % EVAL_EVERY == EVAL_EVERY - 1}
    if not held and len(every) > 1:
        held = {len(every) - 1}
    if split == "eval":
        return [c for i, c in enumerate(every) if i in held] or every[-1:]
    return [c for i, c in enumerate(every) if i not in held]


def preference_records(spec: str, *, split: str, seed: int = 0) -> list[PreferenceRecord]:
    """The ``split`` pairs of ``--data.preference spec`` (a .jsonl, or ``task:arith`` / ``task:format``), in order."""
    if spec.startswith(TASK_PREFIX):
        name = spec.removeprefix(TASK_PREFIX)
        if name not in PREFERENCE_TASKS:
            raise ValueError(f"--data.preference {spec}: no synthetic preference task {name!r}; known: "
                             f"{', '.join(TASK_PREFIX + t for t in PREFERENCE_TASKS)}")  # fmt: skip
        every = list(parse_preferences(synthetic_preferences(PREFERENCE_ITEMS, seed=seed, kind=name), origin=spec))
    else:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"--data.preference {spec}: no such file; pass a .jsonl of pairs or task:NAME")
        every = list(read_preferences(path))
    return _held_out(every, split, f"--data.preference {spec}")


def chat_template_of(cfg: TrainConfig, run_dir: str | Path | None = None) -> ChatTemplate:
    """The run's chat template: that of ``--data.tokenizer``'s directory, else the built-in one."""
    if cfg.data.tokenizer:
        return load_chat_template(cfg.data.tokenizer)
    if run_dir is not None and (Path(run_dir) / TEMPLATE_FILE).is_file():
        return load_chat_template(run_dir)
    return load_chat_template(None)


def _encode(convs: list[Conversation], template: ChatTemplate, tok: Any, cfg: TrainConfig) -> Iterator[ChatTokens]:
    limit = cfg.data.seq_len + 1  # a conversation of n tokens fills n - 1 slots of a row
    for c in convs:
        ex = encode_chat(c.messages, template, tok, seq_len=limit, truncate=True, where=c.where)
        if ex.truncated and not cfg.data.truncate:
            raise ValueError(f"{c.where}: the conversation is longer than --data.seq-len + 1 = {limit} tokens; raise "
                             f"--data.seq-len, shorten or drop it, or pass --data.truncate True to keep its first "
                             f"{limit} (counted in the metrics as data.truncated)")  # fmt: skip
        yield ex


def rendered_texts(cfg: TrainConfig, template: ChatTemplate) -> Iterator[str]:
    """The training conversations (or both sides of each pair) as text: what a run's own BPE tokenizer is
    trained on."""
    if cfg.data.preference:
        for r in preference_records(cfg.data.preference, split="train", seed=cfg.seed):
            yield template.render([*r.prompt, *r.chosen])
            yield template.render([*r.prompt, *r.rejected])
        return
    for c in chat_conversations(cfg.data.chat, split="train", seed=cfg.seed):
        yield template.render(c.messages)


def prepare_chat(cfg: TrainConfig, tokenizer: Any, template: ChatTemplate) -> ChatData:
    """Encode and pack the run's conversations (see the module docstring)."""
    sets, stats, cut = [], {}, 0
    for split in ("train", "eval"):
        convs = chat_conversations(cfg.data.chat, split=split, seed=cfg.seed)
        examples = list(_encode(convs, template, tokenizer, cfg))
        packed = pack_documents([(e.ids, e.mask) for e in examples], seq_len=cfg.data.seq_len)
        sets.append(PackedDataset(packed.batch))
        cut += sum(e.truncated for e in examples)
        if split == "train":
            targets = packed.batch["targets"]
            stats = {"data.conversations": float(len(examples)), "data.rows": float(targets.shape[0]),
                     "data.fill": packed.fill, "data.target_tokens": float((targets != -100).sum())}  # fmt: skip
            if stats["data.target_tokens"] == 0:
                raise ValueError(f"--data.chat {cfg.data.chat}: no assistant token to train on (every assistant "
                                 "turn was cut by --data.truncate?); raise --data.seq-len")  # fmt: skip
    stats["data.truncated"] = float(cut)  # of the training and held-out conversations
    return ChatData(sets[0], sets[1], stats, template)


def prepare_preferences(cfg: TrainConfig, tokenizer: Any, template: ChatTemplate) -> ChatData:
    """Encode the run's preference pairs into rows of ``seq_len`` (see the module docstring)."""
    sets, stats, cut = [], {}, 0
    for split in ("train", "eval"):
        records = preference_records(cfg.data.preference, split=split, seed=cfg.seed)
        try:
            pairs = list(encode_preferences(records, template, tokenizer, seq_len=cfg.data.seq_len,
                                            truncate=cfg.data.truncate))  # fmt: skip
        except ValueError as e:  # name the flags, not the library's arguments
            raise ValueError(str(e).replace("truncate=True", "--data.truncate True")) from None
        sets.append(PackedDataset(collate_preferences(pairs)))
        cut += sum(p.truncated for p in pairs)
        if split == "train":
            stats = {"data.pairs": float(len(pairs))}
    stats["data.truncated"] = float(cut)
    return ChatData(sets[0], sets[1], stats, template)
