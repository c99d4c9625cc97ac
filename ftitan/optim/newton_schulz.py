"""Newton-Schulz orthogonalization, the core of Muon.

Muon: Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
networks" (https://kellerjordan.github.io/posts/muon/). The quintic
iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and the
coefficients ``(3.4445, -4.7750, 2.0315)`` pushes every singular value of
a Frobenius-normalized matrix towards ~1 (into roughly [0.7, 1.2]), an
approximation of ``U V^T`` for ``G = U S V^T`` that needs no SVD.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_COEFFICIENTS", "newton_schulz"]

DEFAULT_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximate orthogonalization of each (m, n) matrix of ``G`` (..., m, n).

    Leading dims are a batch: all matrices go through one batched iteration.
    Runs in ``dtype`` (bf16 by default, as torch.optim.Muon and Jordan's
    reference do); returns a contiguous tensor of that dtype and ``G``'s
    shape. Tall matrices (m > n) are transposed so the Gram matrix is the
    smaller (min(m, n))^2 one. Each matrix is divided by its Frobenius norm
    (clamped below by ``eps``), which bounds its spectral norm by 1.

    The operations are those of torch.optim.Muon's ``_zeropower_via_newtonschulz``
    (cast, transpose, normalize, then ``addmm``-style fused updates), batched.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: expected (..., m, n) matrices, got shape {tuple(G.shape)}")
    if not 0 <= steps < 100:
        raise ValueError(f"steps={steps}: expected 0 <= steps < 100")
    if len(coefficients) != 3:
        raise ValueError(f"coefficients={coefficients!r}: expected (a, b, c)")
    a, b, c = coefficients
    shape = G.shape
    m, n = shape[-2], shape[-1]
    X = G.to(dtype).reshape(-1, m, n)
    tall = m > n
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.contiguous().reshape(shape)
