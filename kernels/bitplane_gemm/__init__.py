"""Bit-plane (binary-coded) matrix product for AnyBCQ artifacts: ``y = x @ W_bits.T`` from packed sign planes.

>>> y = bitplane_gemm(x, planes, scales, offset, bits=3, group_size=128)
>>> # x (tokens, in); planes uint8 (max_bits, out, ceil(in / 8)); scales (out, groups, 3); offset (out, groups)

The tensors are the ones :mod:`tasks.compression.anybcq` saves (``<w>.planes``, ``<w>.scales.<bits>``,
``<w>.offset.<bits>``); only the first ``bits`` planes are read, so one artifact serves every
precision it holds. Dispatches like every kernel (:mod:`kernels._dispatch`): compiled Triton on
CUDA, the interpreter when asked, the fp32 torch reference (which dequantizes) otherwise.
"""

from __future__ import annotations

import torch

from kernels._dispatch import implementation
from kernels.bitplane_gemm.reference import dequantize, unpack_signs

__all__ = ["bitplane_gemm", "dequantize", "unpack_signs"]


def bitplane_gemm(
    x: torch.Tensor,
    planes: torch.Tensor,
    scales: torch.Tensor,
    offset: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``x @ (z + Σ_{p<bits} α_p b_p).T``: x (..., in), planes uint8 (max_bits, out, ceil(in / 8)),
    scales (out, groups, bits), offset (out, groups) or None -> (..., out) in ``x.dtype``."""
    impl = implementation("bitplane_gemm", x.device)
    return impl.bitplane_gemm(x, planes, scales, offset, bits=bits, group_size=group_size)
