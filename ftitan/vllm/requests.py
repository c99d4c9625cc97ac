"""Token-id requests in, token ids and their logprobs out: the shape of an RL rollout.

>>> llm = ft.vllm.engine((model, params), dtype="float32")                            # doctest: +SKIP
>>> out = ft.vllm.complete(llm, [[1, 2, 3], [4, 5]],
...                        vllm.SamplingParams(max_tokens=16, temperature=1.0, seed=0, logprobs=0))  # doctest: +SKIP
>>> out[0].tokens, out[0].logprobs                                                    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import vllm

__all__ = ["Completion", "complete"]


class Completion(NamedTuple):
    """One request's new tokens and, with ``SamplingParams(logprobs=0)`` (or more), each one's logprob
    (under the engine's ``logprobs_mode``: raw model logprobs by default); ``None`` without."""

    tokens: list[int]
    logprobs: list[float] | None


def complete(
    llm: vllm.LLM,
    prompts: Sequence[Sequence[int]],  # token ids, ragged
    sampling: vllm.SamplingParams | Sequence[vllm.SamplingParams],  # one for all, or one per prompt
) -> list[Completion]:
    """``llm.generate`` over token-id prompts, in order, without progress bars; the first sample of each."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("ftitan.vllm.complete: need at least one prompt, each of at least one token")
    outs = llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], sampling, use_tqdm=False)
    return [_completion(o.outputs[0]) for o in outs]


def _completion(out: Any) -> Completion:
    tokens = list(out.token_ids)
    if out.logprobs is None:
        return Completion(tokens, None)
    return Completion(tokens, [step[t].logprob for t, step in zip(tokens, out.logprobs, strict=True)])
