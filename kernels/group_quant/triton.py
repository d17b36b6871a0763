"""Per-group asymmetric quantization in Triton: the same arithmetic as :mod:`kernels.group_quant.reference`.

Each program handles ``BLOCK_G`` groups at once as a (BLOCK_G, BLOCK_K) tile, groups numbered
row-major over (rows, groups), so short groups (e.g. 32 columns) still fill a tile and the ragged
last group of a row is a masked tail.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.group_quant.reference import _check, n_groups

# Whether the kernels below were defined under the interpreter (read at definition time by Triton).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _quantize_kernel(
    w_ptr, q_ptr, scale_ptr, zero_ptr,
    rows, cols, groups, group_size,
    stride_wr, stride_wc, stride_qr, stride_qc,
    qmax,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    g = pid * BLOCK_G + tl.arange(0, BLOCK_G)  # flat group ids, row-major over (rows, groups)
    g_ok = g < rows * groups
    r = (g // groups).to(tl.int64)
    gi = g % groups
    k = tl.arange(0, BLOCK_K)
    col = gi[:, None] * group_size + k[None, :]
    m = g_ok[:, None] & (k[None, :] < group_size) & (col < cols)
    x = tl.load(w_ptr + r[:, None] * stride_wr + col * stride_wc, mask=m, other=0.0).to(tl.float32)
    lo = tl.minimum(tl.min(tl.where(m, x, float("inf")), axis=1), 0.0)
    hi = tl.maximum(tl.max(tl.where(m, x, float("-inf")), axis=1), 0.0)
    scale = (hi - lo) / qmax
    # Round up to the fp16 grid (scales are stored in fp16): 1 + 2**-10 and 2**-14 as in the reference.
    scale = tl.maximum((scale * 1.0009765625).to(tl.float16).to(tl.float32), 6.103515625e-05)
    scale = tl.where(hi > lo, scale, 1.0)
    zero = tl.minimum(tl.maximum(tl.floor(-lo / scale + 0.5), 0.0), qmax)
    q = tl.floor(x / scale[:, None] + 0.5) + zero[:, None]
    q = tl.minimum(tl.maximum(q, 0.0), qmax)
    tl.store(q_ptr + r[:, None] * stride_qr + col * stride_qc, q.to(tl.uint8), mask=m)
    tl.store(scale_ptr + g, scale.to(tl.float16), mask=g_ok)
    tl.store(zero_ptr + g, zero.to(tl.float16), mask=g_ok)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, zero_ptr, out_ptr,
    rows, cols, groups, group_size,
    stride_qr, stride_qc, stride_or, stride_oc,
    BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    g = pid * BLOCK_G + tl.arange(0, BLOCK_G)
    g_ok = g < rows * groups
    r = (g // groups).to(tl.int64)
    gi = g % groups
    k = tl.arange(0, BLOCK_K)
    col = gi[:, None] * group_size + k[None, :]
    m = g_ok[:, None] & (k[None, :] < group_size) & (col < cols)
    q = tl.load(q_ptr + r[:, None] * stride_qr + col * stride_qc, mask=m, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + g, mask=g_ok, other=1.0).to(tl.float32)
    zero = tl.load(zero_ptr + g, mask=g_ok, other=0.0).to(tl.float32)
    w = (q - zero[:, None]) * scale[:, None]
    tl.store(out_ptr + r[:, None] * stride_or + col * stride_oc, w.to(out_ptr.dtype.element_ty), mask=m)


def _blocks(group_size: int) -> tuple[int, int]:
    block_k = triton.next_power_of_2(group_size)
    # ~4096 elements per tile on a GPU; the interpreter pays per program, so it gets bigger tiles.
    elems, most = (65536, 1024) if INTERPRETED else (4096, 64)
    block_g = max(1, min(most, elems // block_k))
    return block_g, block_k


def _launch_quantize(w: torch.Tensor, bits: int, group_size: int):
    rows, cols = w.shape
    groups = n_groups(cols, group_size)
    q = torch.empty((rows, cols), dtype=torch.uint8, device=w.device)
    scale = torch.empty((rows, groups), dtype=torch.float16, device=w.device)
    zero = torch.empty((rows, groups), dtype=torch.float16, device=w.device)
    block_g, block_k = _blocks(group_size)
    grid = (triton.cdiv(rows * groups, block_g),)
    _quantize_kernel[grid](
        w, q, scale, zero,
        rows, cols, groups, group_size,
        w.stride(0), w.stride(1), q.stride(0), q.stride(1),
        float(2**bits - 1),
        BLOCK_G=block_g, BLOCK_K=block_k,
    )
    return q, scale, zero


def _launch_dequantize(q, scale, zero, group_size: int, dtype: torch.dtype):
    rows, cols = q.shape
    groups = n_groups(cols, group_size)
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    block_g, block_k = _blocks(group_size)
    grid = (triton.cdiv(rows * groups, block_g),)
    _dequantize_kernel[grid](
        q, scale.contiguous(), zero.contiguous(), out,
        rows, cols, groups, group_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        BLOCK_G=block_g, BLOCK_K=block_k,
    )
    return out


def quantize(
    w: torch.Tensor, *, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group asymmetric quantization (see :func:`kernels.group_quant.reference.quantize`).

    w: (rows, cols) fp32/fp16/bf16, any strides. Returns q uint8 (rows, cols), scale fp16
    (rows, groups), zero fp16 (rows, groups), ``groups = ceil(cols / group_size)``.
    """
    _check(w, bits, group_size)
    return _launch_quantize(w, bits, group_size)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - zero) * scale`` per group. q uint8 (rows, cols); scale, zero (rows, groups) -> (rows, cols) ``dtype``."""
    rows, cols = q.shape
    g = n_groups(cols, group_size)
    if scale.shape != (rows, g) or zero.shape != (rows, g):
        raise ValueError(
            f"scale/zero: expected shape {(rows, g)} for q {tuple(q.shape)} and group_size {group_size}, "
            f"got {tuple(scale.shape)} and {tuple(zero.shape)}"
        )
    return _launch_dequantize(q, scale, zero, group_size, dtype)
