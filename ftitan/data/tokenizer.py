"""Tokenizers: a byte-level BPE trained here (GPT-2 style, Radford et al. 2019), or a pretrained HF one.

Byte-level means every string round-trips: the 256 byte symbols are always in
the vocabulary, so nothing is ever ``<unk>``. The trained BPE's one special
token is ``<|eos|>``, which :mod:`ftitan.data.packing` puts after every document.

:func:`tokenizer_for` caches ``tokenizer.json`` in a run directory: the first
call trains, every later call (including a resumed run) loads the same file.
:func:`pretrained_tokenizer` reads an HF ``tokenizer.json`` with its BOS / EOS
from the files next to it (:mod:`ftitan.data.pretrained`).

Whatever the tokenizer, ``encode`` never adds special tokens; packing adds
BOS (when the tokenizer has one) before and EOS after each document.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOS", "TOKENIZER_FILE", "TOKENIZER_SIZE_FILE", "Tokenizer", "load_tokenizer", "tokenizer_for", "train_tokenizer",
]  # fmt: skip

EOS = "<|eos|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_SIZE_FILE = "tokenizer_size.json"  # {"asked": V, "reached": n}: written when a BPE trained short of V


class Tokenizer:
    """A thin wrapper over a ``tokenizers.Tokenizer``: ``encode``, ``decode``, ``vocab_size``, ``eos_id``, ``bos_id``.

    ``eos_id`` defaults to the id of ``<|eos|>`` (the BPE :func:`train_tokenizer` makes);
    ``bos_id`` is ``None`` for a tokenizer without a beginning-of-sequence token.
    """

    def __init__(self, hf: _HFTokenizer, *, eos_id: int | None = None, bos_id: int | None = None) -> None:
        if eos_id is None:
            eos_id = hf.token_to_id(EOS)
        if eos_id is None:
            raise ValueError(f"tokenizer has no {EOS!r} special token; train it with train_tokenizer "
                             f"or pass eos_id=")  # fmt: skip
        self.hf = hf
        self.eos_id: int = eos_id
        self.bos_id: int | None = bos_id
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        for name, i in (("eos_id", eos_id), ("bos_id", bos_id)):
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"Tokenizer: {name}={i} is outside the vocabulary [0, {self.vocab_size})")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS / EOS is added (packing adds them around each document)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, run in parallel by the Rust library."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; special tokens (``<|eos|>``, BOS) are kept so document boundaries stay visible."""
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        bos = "" if self.bos_id is None else f", bos_id={self.bos_id}"
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}{bos})"


def _new_bpe() -> _HFTokenizer:
    tok = _HFTokenizer(models.BPE())
    # add_prefix_space=False: a document's first word is not silently changed
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(docs: Iterable[str], vocab_size: int, path: str | Path | None = None) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (256 bytes + merges + ``<|eos|>``) on ``docs``.

    Saves ``tokenizer.json`` to ``path`` when given (a directory, or a file path ending in ``.json``).
    """
    if vocab_size < 257:
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size} is below 257 "
                         f"(256 byte symbols + {EOS}); use at least 257")
    tok = _new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    if path is not None:
        file = _tokenizer_file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(file))
    out = Tokenizer(tok)
    if out.vocab_size < vocab_size:
        warnings.warn(f"BPE: the corpus gave {out.vocab_size} of the {vocab_size} tokens asked (no pair of tokens "
                      f"left to merge); a model of vocab_size {vocab_size} keeps its rows, ids from "
                      f"{out.vocab_size} on are never used. For a fuller vocabulary use more text; for a smaller "
                      f"model, a smaller vocab_size", stacklevel=2)  # fmt: skip
    return out


def _tokenizer_file(path: str | Path) -> Path:
    path = Path(path)
    return path if path.suffix == ".json" else path / TOKENIZER_FILE


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer saved by :func:`train_tokenizer` (a directory or a ``.json`` file)."""
    file = _tokenizer_file(path)
    if not file.is_file():
        raise FileNotFoundError(f"load_tokenizer: {file} does not exist; train one with train_tokenizer")
    try:
        hf = _HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises its own Exception type (a truncated file, not JSON)
        raise ValueError(f"{file}: not a readable tokenizer ({e}); if a run trained it, delete it and run again: "
                         f"the same corpus and vocab_size train the same BPE") from e  # fmt: skip
    return Tokenizer(hf)


def tokenizer_for(run_dir: str | Path, docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """``run_dir/tokenizer.json`` if present, else train one on ``docs`` and save it there.

    ``docs`` is only iterated when training. A cached tokenizer whose vocabulary
    size differs from ``vocab_size`` is an error, not a silent retrain, unless it
    was trained for ``vocab_size`` and its corpus gave fewer tokens: then
    ``tokenizer_size.json`` next to it records both sizes.
    """
    file, sizes = Path(run_dir) / TOKENIZER_FILE, Path(run_dir) / TOKENIZER_SIZE_FILE
    if file.is_file():
        tok = load_tokenizer(file)
        if tok.vocab_size != vocab_size and _recorded(sizes) != {"asked": vocab_size, "reached": tok.vocab_size}:
            raise ValueError(f"{file}: cached tokenizer has vocab_size={tok.vocab_size}, but "
                             f"vocab_size={vocab_size} was asked for; delete the file to retrain "
                             f"or use a new run directory")
        if tok.vocab_size != vocab_size:  # say it again: the corpus may have grown since
            warnings.warn(f"{file}: a BPE of {tok.vocab_size} of the {vocab_size} tokens asked (its corpus gave no "
                          f"more merges); to train it again on more text, delete it and {sizes.name}",
                          stacklevel=2)  # fmt: skip
        return tok
    tok = train_tokenizer(docs, vocab_size, file)
    if tok.vocab_size < vocab_size:  # fewer tokens than asked: say so, so the next run (a resume) accepts it
        sizes.write_text(json.dumps({"asked": vocab_size, "reached": tok.vocab_size}) + "\n")
    return tok


def _recorded(sizes: Path) -> dict[str, int] | None:
    try:
        return json.loads(sizes.read_text())
    except (OSError, ValueError):
        return None
