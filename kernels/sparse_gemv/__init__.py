"""TEAL's activation-sparse matrix-vector product: ``y = W @ (x where |x| >= threshold else 0)``.

>>> y = sparse_gemv(x, weight, threshold=0.1)    # x (tokens, in), weight (out, in) -> (tokens, out)

Only the weight columns of active channels are read (see :mod:`kernels.sparse_gemv.reference`
for the method). Dispatches like every kernel (:mod:`kernels._dispatch`): compiled Triton on
CUDA, the interpreter when asked, the torch reference (gathering active columns) otherwise.
"""

from __future__ import annotations

import torch

from kernels._dispatch import implementation
from kernels.sparse_gemv.reference import active_channels

__all__ = ["sparse_gemv", "active_channels"]


def sparse_gemv(x: torch.Tensor, weight: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """``weight @ (x where |x| >= threshold else 0)``: x (..., in), weight (out, in) -> (..., out) in ``x.dtype``."""
    return implementation("sparse_gemv", x.device).sparse_gemv(x, weight, threshold=threshold)
