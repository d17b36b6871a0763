"""TEAL's activation-sparse matrix-vector product: ``y = W @ (x where |x| >= threshold else 0)``.

>>> y = sparse_gemv(x, weight, threshold=0.1)    # x (tokens, in), weight (out, in) -> (tokens, out)

Only the weight columns of active channels are read (see :mod:`kernels.sparse_gemv.reference`
for the method). Dispatches like every kernel (:mod:`kernels._dispatch`): compiled Triton on
CUDA, the interpreter when asked; on CPU the C++ kernel of :mod:`kernels.sparse_gemv.cpu` where it
builds (3-5x the reference's speed at 50% sparsity in ``benchmarks/sparse_speed.py``), else the torch
reference; ``SCALELAB_TRITON=reference`` forces the reference.
"""

from __future__ import annotations

import torch

from kernels import _dispatch
from kernels._dispatch import implementation
from kernels.sparse_gemv import cpu
from kernels.sparse_gemv.reference import active_channels

__all__ = ["sparse_gemv", "active_channels"]


def sparse_gemv(x: torch.Tensor, weight: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """``weight @ (x where |x| >= threshold else 0)``: x (..., in), weight (out, in) -> (..., out) in ``x.dtype``."""
    module = implementation("sparse_gemv", x.device)
    if module.__name__.endswith(".reference") and x.device.type == "cpu" and _dispatch._requested() != "reference":
        module = cpu  # falls back to the reference itself for what it does not cover
    return module.sparse_gemv(x, weight, threshold=threshold)
