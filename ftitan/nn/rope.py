"""Rotary position embedding (Su et al. 2021, RoFormer) with Llama 3 and YaRN frequency scaling.

Layout is HF's "rotate half": a head vector's first half and second half
form the rotated pairs, and ``cos``/``sin`` repeat the frequencies twice
(``cat(freqs, freqs)``). HF Llama checkpoints already store ``wq``/``wk`` in
this layout, so they load without permutation. (Meta's original checkpoints
use interleaved pairs and need HF's conversion permutation.)

Llama 3.1 scaling (Meta 2024, "The Llama 3 Herd of Models"): wavelengths
longer than ``original_max_position_embeddings / low_freq_factor`` are
divided by ``factor``, shorter than ``.../ high_freq_factor`` kept, and the
band in between interpolated smoothly.

YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models"; DeepSeek-V3, Kimi K2): dimensions that turn more than
``beta_fast`` times over the original context keep their frequency, those
turning fewer than ``beta_slow`` times are divided by ``factor``, a linear
ramp in between; ``cos``/``sin`` are then multiplied by an attention factor
(:func:`rope_attention_factor`, 1.0 when ``mscale == mscale_all_dim`` as in
DeepSeek-V3, whose attention instead scales its softmax, see
``ftitan.nn.mla``).
"""

from __future__ import annotations

import math

import attrs
import torch

from ftitan.nn import invariant as _invariant

__all__ = [
    "Llama3RopeScaling",
    "RopeScaling",
    "YarnRopeScaling",
    "apply_rope",
    "rope_attention_factor",
    "rope_cos_sin",
    "rope_frequencies",
    "rope_inv_freq",
    "yarn_mscale",
]


@attrs.frozen(kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1 RoPE frequency scaling (HF ``rope_type="llama3"``)."""

    factor: float = 8.0  # long wavelengths are divided by this (8 for Llama 3.1, 32 for 3.2 1B/3B)
    low_freq_factor: float = 1.0  # wavelengths above original_max / low_freq_factor are fully scaled
    high_freq_factor: float = 4.0  # wavelengths below original_max / high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # context length of pretraining before extension

    def __attrs_post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"Llama3RopeScaling.factor={self.factor}: must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"Llama3RopeScaling: need 0 < low_freq_factor ({self.low_freq_factor}) "
                f"< high_freq_factor ({self.high_freq_factor})"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "Llama3RopeScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings}: must be > 0"
            )


@attrs.frozen(kw_only=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (Peng et al. 2023; HF ``rope_type="yarn"``), as DeepSeek-V3 and Kimi K2 use it.

    Field names and defaults are HF's ``rope_parameters`` keys, so configs
    convert by name. DeepSeek-V3: ``factor=40, original_max_position_embeddings=4096,
    mscale=1, mscale_all_dim=1``.
    """

    factor: float  # context extension ratio s; frequencies of slow dims are divided by it
    original_max_position_embeddings: int  # context length of pretraining before extension
    beta_fast: float = 32.0  # dims turning more than beta_fast times over the original context keep their frequency
    beta_slow: float = 1.0  # dims turning fewer than beta_slow times are fully interpolated (divided by factor)
    mscale: float | None = None  # numerator of the cos/sin attention factor (see rope_attention_factor)
    mscale_all_dim: float | None = None  # its denominator; DeepSeek's MLA softmax scale gets yarn_mscale(factor, it)**2
    attention_factor: float | None = None  # explicit cos/sin multiplier; None derives it from factor/mscale
    truncate: bool = True  # round the ramp's ends outwards to whole dims (HF's default)

    def __attrs_post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"YarnRopeScaling.factor={self.factor}: must be >= 1")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "YarnRopeScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings}: must be > 0"
            )
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(
                f"YarnRopeScaling: need 0 < beta_slow ({self.beta_slow}) <= beta_fast ({self.beta_fast})"
            )
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"YarnRopeScaling.{name}={value!r}: must be > 0, or None when absent")


RopeScaling = Llama3RopeScaling | YarnRopeScaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """Multiplier of ``cos``/``sin`` (HF's ``attention_scaling``): 1 except under YaRN.

    YaRN: ``attention_factor`` if given, else ``yarn_mscale(factor, mscale) /
    yarn_mscale(factor, mscale_all_dim)`` when both are set (1.0 for
    DeepSeek-V3 and Kimi K2), else ``yarn_mscale(factor)``.
    """
    if not isinstance(scaling, YarnRopeScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return float(yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def _yarn_inv_freq(pos_freqs: torch.Tensor, head_dim: int, theta: float, s: YarnRopeScaling) -> torch.Tensor:
    # the same float32 steps as transformers' _compute_yarn_parameters, so the values match bit for bit
    def correction_dim(rotations: float) -> float:  # dim index that turns `rotations` times over the original context
        return (head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = (1 - ramp).to(pos_freqs.device)  # 1: keep the frequency, 0: divide it by factor
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:  # (head_dim // 2,) float32
    """Inverse frequencies ``theta ** (-2i / head_dim)``, optionally Llama-3 or YaRN scaled.

    Same float32 operations as transformers' ``_compute_llama3_parameters``
    and ``_compute_yarn_parameters``, so the values match bit for bit. (The
    YaRN attention factor is separate: :func:`rope_attention_factor`.)
    """
    if head_dim % 2:
        raise ValueError(f"rope_inv_freq: head_dim={head_dim} must be even")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    pos_freqs = theta**exponents
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(pos_freqs, head_dim, theta, scaling)
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq
    s = scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor,  # (T,) or (B, T) int
    inv_freq: torch.Tensor,  # (Dh // 2,) float32
    *,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: (T, Dh) or (B, T, Dh) float32
    """``cos``/``sin`` of ``position * inv_freq``, frequencies repeated twice (rotate-half layout).

    Both come from one stacked tensor: inductor stores it once per call and every layer's rotation
    reads it, forward and backward. Returned separately, ``cos``/``sin`` would be inlined and
    re-evaluated inside each layer's q and k kernels. ``invariant``: the batch-invariant mode's
    ``cos``/``sin`` (``ftitan.nn.invariant.cos_sin``: the same bits eager and compiled).
    """
    angles = positions[..., None].to(torch.float32) * inv_freq.to(torch.float32)
    emb = torch.cat((angles, angles), dim=-1)
    cos_sin = torch.stack(_invariant.cos_sin(emb) if invariant else (emb.cos(), emb.sin()))
    return cos_sin[0], cos_sin[1]


def rope_frequencies(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: (max_seq_len, head_dim) float32
    """Tables of ``cos``/``sin`` for positions ``0 .. max_seq_len - 1``.

    Row ``p`` equals ``rope_cos_sin(p, ...)`` exactly; models that see only
    a few positions per call compute just those with :func:`rope_cos_sin`.
    """
    positions = torch.arange(max_seq_len, device=device)
    return rope_cos_sin(positions, rope_inv_freq(head_dim, theta, scaling, device=device))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    x: torch.Tensor,  # (B, T, H, Dh)
    cos: torch.Tensor,  # (T, Dh) | (B, T, Dh), or a table (S, Dh) when positions is given
    sin: torch.Tensor,  # same shape as cos
    positions: torch.Tensor | None = None,  # (T,) | (B, T) int rows of the cos/sin table
    *,
    kernels: str = "torch",  # "triton": ftitan.kernels.rope (the Triton kernel on CUDA, this function elsewhere)
) -> torch.Tensor:  # (B, T, H, Dh)
    """Rotate ``x`` by the angles in ``cos``/``sin`` (HF rotate-half convention).

    With ``positions``, ``cos``/``sin`` are tables indexed by position;
    without, they are already aligned with ``x``'s T axis. As in HF, the
    angles are cast to ``x.dtype`` before the rotation.
    """
    if kernels != "torch":  # "triton", "helion": Triton's; imported here (ftitan.kernels imports ftitan.nn)
        from ftitan.kernels.rope import apply_rope as apply_rope_kernel

        return apply_rope_kernel(x, cos, sin, positions)
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    cos = cos.unsqueeze(-2).to(x.dtype)  # broadcast over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + _rotate_half(x) * sin
