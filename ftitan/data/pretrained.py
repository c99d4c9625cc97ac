"""A pretrained HF tokenizer (``tokenizer.json``) as an ftitan :class:`~ftitan.data.Tokenizer`.

The vocabulary and merges come from ``tokenizer.json`` (the "fast" format the
``tokenizers`` library reads; no ``transformers`` needed). Which tokens are
BOS and EOS is not in that file: it is read from the files HF saves next to
it, first match wins::

    tokenizer_config.json     "bos_token" / "eos_token": a string, or {"content": "..."}
    special_tokens_map.json   the same keys
    generation_config.json    "bos_token_id" / "eos_token_id": an int, or a list (the first is used)
    config.json               the same keys (also under "text_config")

A ``"bos_token": null`` in the first two files means "no BOS" (Qwen's
tokenizers, for instance): it is not looked up further. A tokenizer without an
EOS anywhere (a ``tokenizer.json`` that ftitan trained has ``<|eos|>``, which
counts) is refused: packing needs one to end documents.

Example::

    tok = pretrained_tokenizer("path/to/Llama-3.2-1B")   # a directory with tokenizer.json
    tok.encode("hello")                                   # never adds BOS / EOS
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from ftitan.data.tokenizer import EOS, TOKENIZER_FILE, Tokenizer

__all__ = ["pretrained_tokenizer"]

_TOKEN_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # "bos_token": "<s>"
_ID_FILES = ("generation_config.json", "config.json")  # "bos_token_id": 1
_MISSING = object()


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e}); fix the file or remove it") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_id(hf: _HFTokenizer, file: Path, kind: str, value: Any) -> int:
    """The id of a ``"<kind>_token"`` entry (a string or ``{"content": ...}``)."""
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str):
        raise ValueError(f"{file}: {kind}_token must be a string or {{\"content\": ...}}, got {value!r}")
    i = hf.token_to_id(content)
    if i is None:
        raise ValueError(f"{file}: {kind}_token {content!r} is not in the vocabulary of {TOKENIZER_FILE}; "
                         f"fix {kind}_token to a token the tokenizer has")  # fmt: skip
    return i


def _id_entry(cfg: dict[str, Any], kind: str) -> Any:
    value = cfg.get(f"{kind}_token_id")
    if value is None and isinstance(cfg.get("text_config"), dict):  # multimodal configs nest the text model's
        value = cfg["text_config"].get(f"{kind}_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return value


def _special_id(hf: _HFTokenizer, folder: Path, kind: str) -> int | None:
    """The ``kind`` ("bos" / "eos") token's id from the first file that names it, else None.

    An explicit ``"bos_token": null`` settles BOS as absent; a null EOS is looked up further.
    """
    for name in _TOKEN_FILES:
        file = folder / name
        if not file.is_file():
            continue
        value = _read_json(file).get(f"{kind}_token", _MISSING)
        if value is None and kind == "bos":
            return None
        if value is not _MISSING and value is not None:
            return _token_id(hf, file, kind, value)
    for name in _ID_FILES:
        file = folder / name
        if not file.is_file():
            continue
        value = _id_entry(_read_json(file), kind)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{file}: {kind}_token_id must be an int or a list of ints, got {value!r}")
        return value
    return None


def pretrained_tokenizer(path: str | Path) -> Tokenizer:
    """Load an HF ``tokenizer.json`` (``path``: its directory or the file) with BOS / EOS from the files beside it.

    Raises ``FileNotFoundError`` without a ``tokenizer.json`` and ``ValueError``
    when no EOS is named (see the module docstring for where it is looked up).
    """
    path = Path(path)
    file = path if path.suffix == ".json" else path / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"pretrained_tokenizer: {file} does not exist; pass a directory holding an HF "
                                f"{TOKENIZER_FILE} (the fast-tokenizer format) or the file itself")  # fmt: skip
    try:
        hf = _HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises its own Exception type
        raise ValueError(f"{file}: not a tokenizers tokenizer.json ({e})") from e
    folder = file.parent
    bos_id = _special_id(hf, folder, "bos")
    eos_id = _special_id(hf, folder, "eos")
    if eos_id is None:
        eos_id = hf.token_to_id(EOS)  # a tokenizer.json ftitan trained
    if eos_id is None:
        raise ValueError(
            f"{file}: the tokenizer has no EOS token: none of {', '.join(_TOKEN_FILES + _ID_FILES)} in {folder} "
            f"names one, and the vocabulary has no {EOS!r}; packing needs an EOS to end documents: add "
            f'"eos_token": "<your end-of-text token>" to {folder / _TOKEN_FILES[0]}'
        )
    return Tokenizer(hf, eos_id=eos_id, bos_id=bos_id)
