"""Lookup-table (codebook) dequantize-and-multiply in plain fp32 torch: the definition the Triton kernel matches.

A weight (out, in) is stored as ``bits``-bit codes ``q`` and codebooks of ``2**bits`` levels::

    W[r, j] = codebook[seg(r, j), q[r, j]] · s(r)                                          (1)

with NuBitQ's scopes (:mod:`tasks.compression.nubitq`): ``row`` — one codebook per row,
``seg = r``, codebook (out, 2**bits); ``group`` — one per row and group of ``group_size`` input
channels, ``seg = r · groups + j // group_size``, codebook (out · groups, 2**bits); ``tensor`` — one
for the whole matrix, codebook (1, 2**bits), times a per-row ``row_scale`` ``s(r)`` (out,). Without
``tensor`` scope ``s = 1``. Then ``y = x @ W.T``.

RTN (:mod:`tasks.compression.rtn`) is the same product on the uniform grid: its codebook is the
integers ``c_k = k`` shared by every row (never stored), followed by the per-group affine map::

    W[r, j] = (q[r, j] - zero[r, g(j)]) · scale[r, g(j)]                                    (2)

so :func:`rtn_gemm` takes RTN's stored ``qweight``, ``scales`` and ``zeros`` as they are (symmetric
RTN stores no zeros: ``zeros=None`` means ``2**(bits-1)``); no conversion to a stored codebook.

Codes are packed as :func:`kernels.group_quant.pack_codes` does (shared by NuBitQ and RTN): per row a
little-endian bit stream, code ``j`` in bits ``j·bits .. j·bits + bits - 1``, (out, ceil(in · bits / 8))
bytes. NuBitQ's exact outliers (a CSR side matrix) are not part of this product: add
``x @ (outliers - W at those places).T`` separately.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from kernels.group_quant.reference import packed_cols, unpack_codes

Scope = Literal["row", "group", "tensor"]


def n_groups(cols: int, group_size: int) -> int:
    """Groups per row: ``ceil(cols / group_size)`` (the last one may be shorter)."""
    return math.ceil(cols / group_size)


def _check_x_codes(x: torch.Tensor, codes: torch.Tensor, bits: int, name: str) -> tuple[int, int]:
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x: expected a float (..., in_features) tensor, got {x.dtype} {tuple(x.shape)}")
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits: expected 1..8, got {bits!r}")
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"{name}: expected uint8 (out, ceil(in * bits / 8)), got {codes.dtype} {tuple(codes.shape)}")
    cols = x.shape[-1]
    if codes.shape[1] != packed_cols(cols, bits):
        raise ValueError(f"{name}: {codes.shape[1]} bytes per row do not hold in_features = {cols} codes of {bits} bits "
                         f"(expected {packed_cols(cols, bits)})")
    return codes.shape[0], cols


def check_lut_inputs(x, codes, codebook, bits, scope, group_size, row_scale) -> tuple[int, int]:
    """Validate a codebook product's inputs; returns ``(out_features, in_features)``."""
    rows, cols = _check_x_codes(x, codes, bits, "codes")
    if scope not in ("row", "group", "tensor"):
        raise ValueError(f"scope: expected 'row', 'group' or 'tensor', got {scope!r}")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    segs = {"row": rows, "group": rows * n_groups(cols, group_size), "tensor": 1}[scope]
    if tuple(codebook.shape) != (segs, 2**bits) or not codebook.is_floating_point():
        raise ValueError(f"codebook: expected float {(segs, 2**bits)} for scope {scope!r} (group_size {group_size}), "
                         f"got {codebook.dtype} {tuple(codebook.shape)}")
    if scope == "tensor":
        if row_scale is None or tuple(row_scale.shape) != (rows,):
            got = None if row_scale is None else tuple(row_scale.shape)
            raise ValueError(f"row_scale: scope 'tensor' needs a ({rows},) per-row scale, got {got}")
    elif row_scale is not None:
        raise ValueError(f"row_scale: only scope 'tensor' has one (scope is {scope!r})")
    return rows, cols


def check_rtn_inputs(x, qweight, scales, zeros, bits, group_size) -> tuple[int, int]:
    """Validate an RTN product's inputs; returns ``(out_features, in_features)``."""
    rows, cols = _check_x_codes(x, qweight, bits, "qweight")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    g = n_groups(cols, group_size)
    if tuple(scales.shape) != (rows, g) or not scales.is_floating_point():
        raise ValueError(f"scales: expected float {(rows, g)} (out, groups), got {scales.dtype} {tuple(scales.shape)}")
    if zeros is not None and (tuple(zeros.shape) != (rows, g) or not zeros.is_floating_point()):
        raise ValueError(f"zeros: expected float {(rows, g)} (out, groups), got {zeros.dtype} {tuple(zeros.shape)}")
    return rows, cols


def dequantize(
    codes: torch.Tensor,
    codebook: torch.Tensor,
    *,
    bits: int,
    scope: Scope,
    group_size: int,
    cols: int,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Equation (1): fp32 weight (out, cols) from packed codes and codebooks."""
    q = unpack_codes(codes, bits, cols).long()
    book = codebook.float()
    rows = q.shape[0]
    if scope == "row":
        return torch.gather(book, 1, q)
    if scope == "group":
        g = n_groups(cols, group_size)
        seg = torch.arange(rows, device=q.device)[:, None] * g + torch.arange(cols, device=q.device)[None, :] // group_size
        return book[seg, q]
    return book[0][q] * row_scale.float()[:, None]


def rtn_dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    cols: int,
) -> torch.Tensor:
    """Equation (2): fp32 weight (out, cols); ``zeros=None`` is symmetric RTN (zero point ``2**(bits-1)``)."""
    q = unpack_codes(qweight, bits, cols).float()
    z = zeros.float() if zeros is not None else torch.full(scales.shape, float(2 ** (bits - 1)), device=scales.device)
    per_col = lambda t: t.repeat_interleave(group_size, dim=1)[:, :cols]  # noqa: E731
    return (q - per_col(z)) * per_col(scales.float())


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
    """``x @ W.T`` with ``W`` from equation (1), in fp32.

    x: (..., in); codes uint8 (out, ceil(in · bits / 8)); codebook (segments, 2**bits) for ``scope``;
    row_scale (out,) with ``tensor`` scope. Returns (..., out) in ``x.dtype``.
    """
    rows, cols = check_lut_inputs(x, codes, codebook, bits, scope, group_size, row_scale)
    w = dequantize(codes, codebook, bits=bits, scope=scope, group_size=group_size, cols=cols, row_scale=row_scale)
    return (x.float() @ w.t()).to(x.dtype)


def rtn_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``x @ W.T`` with ``W`` from equation (2), in fp32.

    x: (..., in); qweight uint8 (out, ceil(in · bits / 8)); scales, zeros (out, groups) (zeros None:
    symmetric). Returns (..., out) in ``x.dtype``.
    """
    rows, cols = check_rtn_inputs(x, qweight, scales, zeros, bits, group_size)
    w = rtn_dequantize(qweight, scales, zeros, bits=bits, group_size=group_size, cols=cols)
    return (x.float() @ w.t()).to(x.dtype)
