"""Inference from the same pure model functions: a KV cache tree, prefill / decode_step, sampling, generate.

See docs/inference.md. ``ftitan.vllm`` runs the same functions inside vLLM.
"""

from ftitan.infer.cache import KVCache, init_cache
from ftitan.infer.fuse import fuse_projections, fused_slices
from ftitan.infer.generate import generate, slots_for, steps_for
from ftitan.infer.sampling import GREEDY, Sampling, sample
from ftitan.infer.speculative import SpeculativeStats, speculative_generate
from ftitan.infer.step import make_decode_step, make_greedy_decode, make_prefill

__all__ = [
    "GREEDY",
    "KVCache",
    "Sampling",
    "SpeculativeStats",
    "fuse_projections",
    "fused_slices",
    "generate",
    "init_cache",
    "make_decode_step",
    "make_greedy_decode",
    "make_prefill",
    "sample",
    "slots_for",
    "speculative_generate",
    "steps_for",
]
