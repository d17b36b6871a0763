"""Binary-coded (bit-plane) matrix product in plain fp32 torch: the definition the Triton kernel matches.

Binary-coded quantization (BCQ; Xu et al. 2018, "Alternating multi-bit quantization"; nested planes
as in AnyBCQ, Park et al. 2025) stores a weight (out, in) as sign planes ``b_p ∈ {-1, +1}`` with a
scale ``α_p`` per (row, group of ``group_size`` input channels) and plane, and an optional offset ``z``
per (row, group). Served at ``bits`` planes::

    W[r, j] = z[r, g(j)] + Σ_{p < bits} α[r, g(j), p] · b_p[r, j],      g(j) = j // group_size    (1)
    y       = x @ W.T                                                                          (2)

Storage, exactly as :mod:`tasks.compression.anybcq` saves it: ``planes`` uint8
(max_bits, out, ceil(in / 8)), bit ``j % 8`` of byte ``j // 8`` of plane ``p`` is 1 where
``b_p[r, j] = +1`` (little-endian along columns, padding bits 0); ``scales`` fp16 (out, groups, bits)
(the artifact's ``scales.<bits>``); ``offset`` fp16 (out, groups) (``offset.<bits>``) or None
without offsets. Only planes ``0 .. bits-1`` are read: one artifact serves every precision.
"""

from __future__ import annotations

import math

import torch


def n_groups(cols: int, group_size: int) -> int:
    """Groups per row: ``ceil(cols / group_size)`` (the last one may be shorter)."""
    return math.ceil(cols / group_size)


def check_inputs(
    x: torch.Tensor,
    planes: torch.Tensor,
    scales: torch.Tensor,
    offset: torch.Tensor | None,
    bits: int,
    group_size: int,
) -> tuple[int, int]:
    """Validate shapes and dtypes; returns ``(out_features, in_features)``."""
    if x.dim() < 1:
        raise ValueError("x: expected (..., in_features), got a 0-d tensor")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    if planes.dtype != torch.uint8 or planes.dim() != 3:
        raise ValueError(f"planes: expected uint8 (max_bits, out, ceil(in / 8)), got {planes.dtype} {tuple(planes.shape)}")
    cols = x.shape[-1]
    stored, rows, nbytes = planes.shape
    if nbytes != (cols + 7) // 8:
        raise ValueError(f"planes: {nbytes} bytes per row do not hold in_features = {cols} (expected {(cols + 7) // 8})")
    if not isinstance(bits, int) or not 1 <= bits <= min(stored, 8):
        raise ValueError(f"bits: the artifact stores {stored} planes, so bits must be in 1..{min(stored, 8)}, got {bits!r}")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    g = n_groups(cols, group_size)
    if tuple(scales.shape) != (rows, g, bits) or not scales.is_floating_point():
        raise ValueError(f"scales: expected float {(rows, g, bits)} (out, groups, bits) for group_size {group_size}, "
                         f"got {scales.dtype} {tuple(scales.shape)}")
    if offset is not None and (tuple(offset.shape) != (rows, g) or not offset.is_floating_point()):
        raise ValueError(f"offset: expected float {(rows, g)} (out, groups), got {offset.dtype} {tuple(offset.shape)}")
    return rows, cols


def unpack_signs(planes: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 planes (P, out, ceil(cols / 8)) -> fp32 signs ±1 (P, out, cols)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=planes.device)
    bits = ((planes[..., None] >> shifts) & 1).reshape(*planes.shape[:-1], -1)[..., :cols]
    return bits.float() * 2 - 1


def _per_column(per_group: torch.Tensor, cols: int, group_size: int) -> torch.Tensor:
    """(out, groups) -> (out, cols): each group's value repeated over its columns."""
    return per_group.float().repeat_interleave(group_size, dim=1)[:, :cols]


def dequantize(
    planes: torch.Tensor,
    scales: torch.Tensor,
    offset: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    cols: int,
) -> torch.Tensor:
    """Equation (1): the fp32 weight (out, cols) served at ``bits`` planes (only those are unpacked)."""
    signs = unpack_signs(planes[:bits], cols)
    w = _per_column(offset, cols, group_size) if offset is not None else torch.zeros(signs.shape[1:], device=planes.device)
    for p in range(bits):  # plane by plane: two (out, cols) temporaries, not (out, cols, bits)
        w += _per_column(scales[..., p], cols, group_size) * signs[p]
    return w


def bitplane_gemm(
    x: torch.Tensor,
    planes: torch.Tensor,
    scales: torch.Tensor,
    offset: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """``x @ W_bits.T`` with ``W_bits`` from equation (1), computed in fp32.

    x: (..., in) any float dtype; planes: uint8 (max_bits, out, ceil(in / 8)); scales: (out, groups,
    bits); offset: (out, groups) or None. Returns (..., out) in ``x.dtype``.
    """
    rows, cols = check_inputs(x, planes, scales, offset, bits, group_size)
    w = dequantize(planes, scales, offset, bits=bits, group_size=group_size, cols=cols)
    return (x.float() @ w.t()).to(x.dtype)
