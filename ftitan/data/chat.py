"""Chat SFT data: JSONL conversations, the checkpoint's chat template, and a loss mask on assistant tokens.

Records, one JSON object a line (blank lines are skipped)::

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    {"prompt": "Hi", "completion": "Hello!"}          # = a user turn, then an assistant turn

Roles are ``system``, ``user``, ``assistant`` and ``tool``; every conversation has an
assistant turn. A malformed record raises one ``ValueError`` naming ``file:line`` and
the reason: none is silently dropped.

The text is rendered by the checkpoint's own Jinja chat template (``chat_template.jinja``
or ``tokenizer_config.json``'s ``chat_template``), offline with ``jinja2`` in a sandbox
as ``transformers`` does; without one, :data:`BUILTIN_TEMPLATE`.

The mask comes from rendering turn by turn: the text an assistant turn adds, after the
generation prompt (``add_generation_prompt=True``) of the turns before it, is trained on;
everything else (system, user, tool turns, the assistant header) is not. This needs a
prefix-stable template (the render of the first k turns is a prefix of the render of
k + 1); one that is not is refused, naming the turn. A token is trained on iff all of its
characters (``tokenizers`` offsets) lie in assistant text.

Example::

    template = load_chat_template("path/to/hf_model")
    tok = pretrained_tokenizer("path/to/hf_model")
    for ex in chat_examples("sft.jsonl", template, tok, seq_len=2048, truncate=True):
        ex.ids, ex.mask        # (T,) int64 each; mask 1 on assistant tokens
        ex.truncated           # True when the conversation was cut to seq_len tokens
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = [
    "BUILTIN_TEMPLATE", "ROLES", "ChatTemplate", "ChatTokens", "Conversation",
    "chat_examples", "encode_chat", "load_chat_template", "read_conversations", "render_chat",
]  # fmt: skip

ROLES = ("system", "user", "assistant", "tool")
# Used when a checkpoint has no template: "<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n".
BUILTIN_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")  # passed to the template, as transformers does


class Conversation(NamedTuple):
    """One record: its messages (``{"role", "content"}`` dicts) and where it came from (``"file:line"``)."""

    messages: tuple[dict[str, str], ...]
    where: str


class ChatTokens(NamedTuple):
    """One tokenized conversation: ``ids`` and ``mask`` (1 = trained on), both ``(T,)`` int64."""

    ids: torch.Tensor  # (T,)
    mask: torch.Tensor  # (T,)
    truncated: bool  # cut to seq_len tokens (truncate=True)
    where: str


# ---------------------------------------------------------------------------------------------- records


def _messages(record: Any) -> list[dict[str, str]]:
    """The messages of one parsed record; raises ``ValueError(reason)`` (the caller adds file:line)."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record and ("prompt" in record or "completion" in record):
        raise ValueError('has both "messages" and "prompt"/"completion"; keep one form')
    if "messages" not in record:
        if "prompt" not in record or "completion" not in record:
            raise ValueError('needs "messages" (a list of {"role", "content"}) or both "prompt" and "completion"')
        for key in ("prompt", "completion"):
            if not isinstance(record[key], str):
                raise ValueError(f'"{key}" must be a string, got {type(record[key]).__name__}')
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ValueError(f'"messages" must be a list, got {type(messages).__name__}')
    if not messages:
        raise ValueError('"messages" is empty')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f'messages[{i}] must be an object with "role" and "content", got {m!r:.80}')
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {m['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f'messages[{i}]: "content" must be a string, got {type(m["content"]).__name__}')
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("has no assistant turn: there is nothing to train on")
    return out


def jsonl_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """``("file:line", parsed record)`` of each non-blank line of a JSONL file, in order; a line that is not
    JSON raises ``ValueError("file:line: not valid JSON (...)")``."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from e
            yield where, record


def read_conversations(path: str | Path) -> Iterator[Conversation]:
    """Yield the conversations of a JSONL file in order; a malformed line raises ``ValueError("file:line: ...")``."""
    for where, record in jsonl_records(path):
        try:
            messages = _messages(record)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        yield Conversation(tuple(messages), where)


# ---------------------------------------------------------------------------------------------- templates


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant markers) renders its body unchanged.

    The mask here comes from turn-by-turn rendering, so the markers are not needed; they are accepted so
    templates written for ``return_assistant_tokens_mask`` render as they do in transformers.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # jinja's own tojson escapes HTML characters; transformers overrides it the same way
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # The environment transformers uses (chat_template_utils.py). No strftime_now: templates that use it
    # for "today's date" fall back to a fixed one, so a rerun renders the same text.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


class ChatTemplate(NamedTuple):
    """A Jinja chat template with the special tokens it may use, and where it came from (for errors)."""

    source: str
    special_tokens: tuple[tuple[str, str], ...] = ()  # (("bos_token", "<s>"), ...)
    origin: str = "built-in template"

    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``; a Jinja error (``raise_exception``) raises ``ValueError``."""
        try:
            return _compile(self.source).render(messages=[dict(m) for m in messages],
                                                add_generation_prompt=add_generation_prompt,
                                                **dict(self.special_tokens))  # fmt: skip
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"{self.origin}: {type(e).__name__}: {e}") from e


def _token_text(value: Any) -> str | None:
    content = value.get("content") if isinstance(value, dict) else value
    return content if isinstance(content, str) else None


def _config_template(file: Path, cfg: dict[str, Any]) -> str | None:
    template = cfg.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ValueError(f"{file}: chat_template is a list without a \"default\" entry (names: {sorted(named)})")
    raise ValueError(f"{file}: chat_template must be a string or a list of {{\"name\", \"template\"}}, "
                     f"got {type(template).__name__}")  # fmt: skip


def load_chat_template(path: str | Path | None) -> ChatTemplate:
    """The chat template of an HF directory, else :data:`BUILTIN_TEMPLATE`.

    Looked up in ``chat_template.jinja`` (what transformers >= 4.50 saves), then
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates:
    ``"default"`` is taken). The special tokens (``bos_token``, ``eos_token``, ...) come from
    ``tokenizer_config.json``. ``path=None`` gives the built-in template.
    """
    if path is None:
        return ChatTemplate(BUILTIN_TEMPLATE)
    folder = Path(path)
    folder = folder.parent if folder.is_file() else folder
    cfg: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            cfg = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{config_file}: expected a JSON object, got {type(cfg).__name__}")
    specials = tuple((k, t) for k in _SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(encoding="utf-8"), specials, str(jinja_file))
    source = _config_template(config_file, cfg)
    if source is None:
        return ChatTemplate(BUILTIN_TEMPLATE, specials, f"built-in template (none in {folder})")
    return ChatTemplate(source, specials, f"{config_file} chat_template")


# ---------------------------------------------------------------------------------------------- rendering


def _check_prefix(before: str, after: str, *, turn: int, role: str, what: tuple[str, str], where: str,
                  origin: str) -> None:  # fmt: skip
    if after.startswith(before):
        return
    at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
    raise ValueError(
        f"{where}: {origin} is not prefix-stable at turn {turn} ({role}): the render of {what[0]} is not a prefix "
        f"of the render of {what[1]}; they differ at character {at}: {before[at:at + 40]!r} vs "
        f"{after[at:at + 40]!r}. The assistant mask is the text each assistant turn adds, so the template must "
        f"only append: use one that renders earlier turns the same way whatever follows (no message counts at "
        f"the top, no rewriting of earlier turns)"
    )


def render_chat(messages: Sequence[dict[str, str]], template: ChatTemplate, *,
                where: str = "<conversation>") -> tuple[str, list[tuple[int, int]]]:  # fmt: skip
    """The conversation's text and its assistant spans ``[(start, end), ...]`` (character offsets).

    Renders turn by turn; an assistant turn's span runs from the end of the render of the turns
    before it with the generation prompt to the end of the render that includes it. Raises
    ``ValueError`` naming ``where`` and the turn when a render is not a prefix of the next.
    """

    def render(n: int, gen: bool) -> str:
        try:
            return template.render(messages[:n], add_generation_prompt=gen)
        except ValueError as e:
            raise ValueError(f"{where}: rendering messages[:{n}]: {e}") from e

    text, spans = "", []
    for i, m in enumerate(messages):
        kw: dict[str, Any] = dict(turn=i, role=m["role"], where=where, origin=template.origin)
        if m["role"] == "assistant":
            prompt = render(i, True)
            _check_prefix(text, prompt, what=(f"messages[:{i}]", f"messages[:{i}] + generation prompt"), **kw)
            text = prompt
            full = render(i + 1, False)
            _check_prefix(text, full, what=(f"messages[:{i}] + generation prompt", f"messages[:{i + 1}]"), **kw)
            spans.append((len(text), len(full)))
        else:
            full = render(i + 1, False)
            _check_prefix(text, full, what=(f"messages[:{i}]", f"messages[:{i + 1}]"), **kw)
        text = full
    return text, spans


def _char_mask_cumsum(n: int, spans: list[tuple[int, int]]) -> list[int]:
    """``c[i]`` = how many of the first ``i`` characters are in a span."""
    inside = bytearray(n)
    for s, e in spans:
        inside[s:e] = b"\x01" * (e - s)
    c = [0] * (n + 1)
    for i, v in enumerate(inside):
        c[i + 1] = c[i] + v
    return c


def encode_chat(messages: Sequence[dict[str, str]], template: ChatTemplate, tokenizer: Any, *, seq_len: int,
                truncate: bool = False, where: str = "<conversation>") -> ChatTokens:  # fmt: skip
    """Render, tokenize (no special tokens added) and mask one conversation.

    ``tokenizer``: an ftitan :class:`~ftitan.data.Tokenizer` or a ``tokenizers.Tokenizer``.
    A conversation of more than ``seq_len`` tokens raises ``ValueError`` naming ``where``,
    or with ``truncate=True`` keeps its first ``seq_len`` tokens (``truncated=True``).
    """
    hf: _HFTokenizer = getattr(tokenizer, "hf", tokenizer)
    text, spans = render_chat(messages, template, where=where)
    enc = hf.encode(text, add_special_tokens=False)
    c = _char_mask_cumsum(len(text), spans)
    mask = [int(e > s and c[e] - c[s] == e - s) for s, e in enc.offsets]
    ids = enc.ids
    truncated = len(ids) > seq_len
    if truncated and not truncate:
        raise ValueError(
            f"{where}: the conversation is {len(ids)} tokens, longer than seq_len={seq_len}; "
            f"raise seq_len, shorten or drop it, or pass truncate=True (ftitan train: --data.truncate True) to keep its "
            f"first {seq_len}"
        )
    ids, mask = ids[:seq_len], mask[:seq_len]
    return ChatTokens(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64), truncated, where)


def chat_examples(path: str | Path, template: ChatTemplate, tokenizer: Any, *, seq_len: int,
                  truncate: bool = False) -> Iterator[ChatTokens]:  # fmt: skip
    """:func:`encode_chat` over :func:`read_conversations`; count ``truncated`` to report cuts."""
    for conv in read_conversations(path):
        yield encode_chat(conv.messages, template, tokenizer, seq_len=seq_len, truncate=truncate, where=conv.where)
