"""Inference: sampling and generation from the same pure model functions."""

from ftitan.infer.sampling import generate_tokens, sample_logits

__all__ = ["generate_tokens", "sample_logits"]
