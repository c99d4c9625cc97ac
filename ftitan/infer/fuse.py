"""Fused projections for inference: ``[wq; wk; wv] -> wqkv`` and ``[w1; w3] -> w13``, one matmul each.

At decode time a step is a handful of skinny matmuls per layer; stacking the
ones that read the same input (q/k/v, gate/up) makes fewer and wider ones, as
inference engines do. The model functions accept either layout
(``decoder.attention`` reads ``wqkv``, ``nn.swiglu`` reads ``w13``), so this
is a pure transform of the params tree, not a second model. Training keeps
the separate leaves unless the model config asks for them fused
(``fuse_projections=True``; ``ftitan.models.fused``, where these live).
"""

from __future__ import annotations

from ftitan.models.fused import FUSED, fuse_projections, fused_slices

__all__ = ["FUSED", "fuse_projections", "fused_slices"]
