"""Lookup-table (codebook) dequantize-and-multiply for NuBitQ artifacts, and RTN on its uniform grid.

>>> y = lut_gemm(x, codes, codebook, bits=3, scope="row")                  # NuBitQ: <w>.codes, <w>.codebook
>>> y = lut_gemm(x, codes, codebook, bits=3, scope="tensor", row_scale=s)  # (+ <w>.row_scale)
>>> y = rtn_gemm(x, qweight, scales, zeros, bits=4, group_size=128)        # RTN: <w>.qweight, .scales, .zeros

x (tokens, in) -> (tokens, out). The tensors are the ones :mod:`tasks.compression.nubitq` and
:mod:`tasks.compression.rtn` save; RTN's grid ``c_k = k`` plus its per-group ``(q - zero) · scale``
is handled by the same kernel directly, no stored codebook is made for it. NuBitQ's outliers are not
included (see :mod:`kernels.lut_gemm.reference`). Dispatches like every kernel
(:mod:`kernels._dispatch`): compiled Triton on CUDA, the interpreter when asked, the fp32 torch
reference (which dequantizes) otherwise.
"""

from __future__ import annotations

import torch

from kernels._dispatch import implementation
from kernels.lut_gemm.reference import Scope, dequantize, rtn_dequantize

__all__ = ["lut_gemm", "rtn_gemm", "dequantize", "rtn_dequantize"]


def lut_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    codebook: torch.Tensor,
    *,
    bits: int,
    scope: Scope = "row",
    group_size: int = 128,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T`` with ``W = codebook[seg, code] (· row_scale)``: x (..., in), codes uint8
    (out, ceil(in · bits / 8)), codebook (segments, 2**bits) -> (..., out) in ``x.dtype``."""
    impl = implementation("lut_gemm", x.device)
    return impl.lut_gemm(x, codes, codebook, bits=bits, scope=scope, group_size=group_size, row_scale=row_scale)


def rtn_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``x @ W.T`` with ``W = (q - zero) · scale`` per group: x (..., in), qweight uint8
    (out, ceil(in · bits / 8)), scales/zeros (out, groups) (zeros None: symmetric) -> (..., out)."""
    impl = implementation("lut_gemm", x.device)
    return impl.rtn_gemm(x, qweight, scales, zeros, bits=bits, group_size=group_size)
