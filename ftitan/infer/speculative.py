"""Greedy speculative decoding with DeepSeek-V3's multi-token-prediction module as the draft model.

DeepSeek-V3 (DeepSeek-AI 2024, sec. 2.2 and 5.4.3) repurposes its MTP module
for speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"): each step the MTP module drafts
``draft`` tokens, the main model scores the newest token and all drafts in
one forward through its KV cache, and the longest prefix of drafts equal to
the main model's argmax is kept, plus the main model's own next token. The
tokens are exactly those of plain greedy decoding (``ftitan.infer.generate``);
only the number of main-model forwards changes.

>>> tokens, stats = speculative_generate(model, params, [[1, 2, 3], [4, 5]], max_new_tokens=32, draft=2)
>>> stats.tokens_per_step     # tokens emitted per main-model forward (1 .. draft + 1)

Caches. The main model's :class:`~ftitan.infer.KVCache` and one for the MTP
module's block share their slots: slot ``s`` of the MTP cache holds the
module's input at position ``s`` (the main hidden state there and the
embedding of token ``s + 1``). A verify forward writes the newest token and
the drafts at slots ``end .. end + draft``; rejected slots are rolled back
by moving ``end`` (the next write overwrites them, and no query sees a slot
beyond its own). The MTP module then runs over the same slots with the main
hidden states and the main model's argmax tokens, which are the true next
tokens up to the first rejection, and drafts from the last accepted slot.

Drafts past the first chain the first module on its own output at the next
position (as vLLM and SGLang run DeepSeek-V3's single MTP module for more
than one draft token); those chained slots are overwritten by the next
verify step. Sampling (non-greedy) verification is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ftitan.infer.cache import KVCache, init_cache
from ftitan.infer.generate import slots_for
from ftitan.infer.step import head_logits

__all__ = ["SpeculativeStats", "speculative_generate"]


class SpeculativeStats(NamedTuple):
    """What speculative decoding did, over the rows still generating at each step.

    - ``steps``: verify forwards of the main model (after the prefill).
    - ``drafted``: draft tokens proposed to unfinished rows; ``accepted``: those kept.
    - ``accepted_per_step``: per step, the mean number of drafts kept by the unfinished rows.
    """

    steps: int
    drafted: int
    accepted: int
    accepted_per_step: list[float]

    @property
    def acceptance_rate(self) -> float:
        """Fraction of draft tokens the main model kept."""
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per verify forward and row (1 + accepted drafts)."""
        return 1.0 + sum(self.accepted_per_step) / max(len(self.accepted_per_step), 1)


def _mtp(model: Any, params: Any):
    """The model's MTP module function (``deepseek_v3.mtp_module``), checking it has one."""
    from ftitan.models import deepseek_v3

    cfg = model.config
    if not isinstance(cfg, deepseek_v3.Config):
        raise ValueError(f"speculative_generate: {type(cfg).__module__} models have no MTP module; use a "
                         "DeepSeek-V3 model with n_mtp_layers >= 1")  # fmt: skip
    if cfg.n_mtp_layers < 1 or "mtp" not in params:
        raise ValueError("speculative_generate: the model has no MTP module (n_mtp_layers=0 or no 'mtp' params); "
                         "train one (recipe deepseek-v3-debug-mtp) or load it with ftitan.models.mtp.load_hf")  # fmt: skip
    return deepseek_v3.mtp_module(cfg)


def _head(model: Any, params: Any, h: torch.Tensor) -> torch.Tensor:  # (..., V)
    return head_logits(model, params, h)  # soft-capped where the model caps (the same argmax)


def _prompts(prompts: Sequence[Sequence[int]], vocab: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(B, T)`` tokens and ``(B,)`` lengths; checks every prompt."""
    if not prompts:
        raise ValueError("speculative_generate: no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0 or any(not 0 <= int(t) < vocab for t in p):
            raise ValueError(f"speculative_generate: prompt {i} is empty or has ids outside [0, {vocab})")
    t = max(len(p) for p in prompts)
    tokens = torch.tensor([list(p) + [0] * (t - len(p)) for p in prompts], dtype=torch.long, device=device)
    return tokens, torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)


def _with_end(cache: KVCache, end: torch.Tensor) -> KVCache:
    return KVCache(cache.layers, cache.start, end)


class _State(NamedTuple):
    """Between steps: both caches (``end``: one past the last accepted slot), the MTP module's outputs
    over the last slots it ran (block output ``hm`` and its normed form, (B, S', D)), the index ``at``
    (B,) into them of each row's last accepted slot, and each row's newest token ``last`` (B,), not yet
    in the main cache."""

    cache: KVCache
    mcache: KVCache
    hm: torch.Tensor
    normed: torch.Tensor
    at: torch.Tensor
    last: torch.Tensor


def _prefill(model: Any, module: Any, params: Any, tokens: torch.Tensor, lengths: torch.Tensor, slots: int) -> _State:
    """The prompts (right-padded) at slots ``0 .. T-1`` of both caches; the MTP module's input at the last
    prompt slot is the first generated token, the main model's greedy one."""
    b, t = tokens.shape
    rows = torch.arange(b, device=tokens.device)
    cache = init_cache(model, params, batch=b, slots=slots)
    zeros = torch.zeros_like(lengths)
    mcache = KVCache({"0": {k: torch.zeros_like(v) for k, v in cache.layers["0"].items()}}, zeros, zeros)
    pos = torch.arange(t, device=tokens.device).expand(b, t)
    h, cache = model.apply(params, tokens, positions=pos, cache=_with_end(cache, zeros), logits=False)
    first = _head(model, params, h[rows, lengths - 1]).argmax(-1)  # (B,)
    nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1).scatter(1, (lengths - 1)[:, None], first[:, None])
    hm, normed, mcache, _ = module(params, h, nxt, positions=pos, cache=mcache)
    return _State(_with_end(cache, lengths), _with_end(mcache, lengths), hm, normed, lengths - 1, first)


def _draft(model: Any, module: Any, params: Any, st: _State, draft: int) -> tuple[torch.Tensor, KVCache]:
    """``draft`` greedy tokens (B, draft) from the MTP module: the first from its output at the last
    accepted slot, the others chaining it on its own output at slots ``end``, ``end + 1``, ... (which
    the verify step overwrites)."""
    rows = torch.arange(st.last.shape[0], device=st.last.device)
    end, mcache = st.cache.end, st.mcache
    h, d = st.hm[rows, st.at][:, None], _head(model, params, st.normed[rows, st.at]).argmax(-1)
    drafts = [d]
    for j in range(draft - 1):
        pos = (end - st.cache.start + j)[:, None]
        h, normed, mcache, _ = module(params, h, d[:, None], positions=pos, cache=_with_end(mcache, end + j))
        d = _head(model, params, normed[:, 0]).argmax(-1)
        drafts.append(d)
    return torch.stack(drafts, dim=1), mcache


def _verify(model: Any, module: Any, params: Any, st: _State, d: torch.Tensor, mcache: KVCache, live: torch.Tensor
            ) -> tuple[_State, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The newest token and the drafts ``d`` (B, k) at slots ``end .. end + k`` in one main-model forward;
    returns the next state, the main model's greedy tokens there (B, k + 1) and the drafts kept (B,).
    Rows not ``live`` (finished) keep their ``end``, so their slots stay within the cache."""
    end, k = st.cache.end, d.shape[1]
    x = torch.cat([st.last[:, None], d], dim=1)
    pos = (end - st.cache.start)[:, None] + torch.arange(k + 1, device=x.device)
    h, cache = model.apply(params, x, positions=pos, cache=st.cache, logits=False)
    a = _head(model, params, h).argmax(-1)  # (B, k + 1)
    n = (d == a[:, :k]).long().cumprod(dim=1).sum(dim=1)  # (B,)
    # the MTP module over the same slots: main hidden states, the true next tokens up to slot end + n
    hm, normed, mcache, _ = module(params, h, a, positions=pos, cache=_with_end(mcache, end))
    new_end = torch.where(live, end + n + 1, end)
    rows = torch.arange(b := x.shape[0], device=x.device)
    last = torch.where(live, a[rows, n], st.last)
    at = torch.where(live, n, torch.zeros(b, dtype=n.dtype, device=n.device))
    return _State(_with_end(cache, new_end), _with_end(mcache, new_end), hm, normed, at, last), a, n


@torch.no_grad()
def speculative_generate(
    model: Any,
    params: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    draft: int = 1,
    eos_id: int | Sequence[int] | None = None,
) -> tuple[list[list[int]], SpeculativeStats]:
    """Greedy continuations of ``prompts`` (each up to ``max_new_tokens``, cut after its first
    ``eos_id``), equal to ``generate(model, params, prompts, max_new_tokens=...)``'s, drafting
    ``draft`` tokens per main-model forward with the MTP module; and the :class:`SpeculativeStats`."""
    if max_new_tokens < 1 or draft < 1:
        raise ValueError(f"speculative_generate: max_new_tokens={max_new_tokens} and draft={draft} must be >= 1")
    module = _mtp(model, params)
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    tokens, lengths = _prompts(prompts, model.config.vocab_size, params["embed"].device)
    # a live row ends at most max_new_tokens + draft past its prompt, and writes draft + 1 slots beyond
    st = _prefill(model, module, params, tokens, lengths, slots_for(tokens.shape[1] + max_new_tokens + 2 * draft + 1))
    out = [[int(x)] for x in st.last.tolist()]
    done = [len(o) >= max_new_tokens or o[-1] in stop for o in out]
    steps, drafted, accepted, per_step = 0, 0, 0, []
    while not all(done):
        live = [i for i in range(len(out)) if not done[i]]
        d, mcache = _draft(model, module, params, st, draft)
        st, a, n = _verify(model, module, params, st, d, mcache, torch.tensor([not x for x in done], device=d.device))
        kept = n.tolist()
        steps, drafted, accepted = steps + 1, drafted + draft * len(live), accepted + sum(kept[i] for i in live)
        per_step.append(sum(kept[i] for i in live) / len(live))
        for i in live:
            out[i] += a[i, : kept[i] + 1].tolist()
            done[i] = len(out[i]) >= max_new_tokens or any(tok in stop for tok in out[i])
    final = []
    for row in out:
        row = row[:max_new_tokens]
        final.append(row[: next((i + 1 for i, tok in enumerate(row) if tok in stop), len(row))])
    return final, SpeculativeStats(steps, drafted, accepted, per_step)
