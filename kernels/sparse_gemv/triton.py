"""TEAL's sparse GEMV in Triton: the same result as :mod:`kernels.sparse_gemv.reference`.

One program computes ``BLOCK_N`` outputs of one token. It walks the input channels in blocks of
``BLOCK_K``: a block whose channels are all below the threshold is skipped without touching the
weight, and in other blocks the weight load is masked to the active channels, so inactive columns
are never read. Accumulation is fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.sparse_gemv.reference import _check

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _sparse_gemv_kernel(
    x_ptr, w_ptr, y_ptr,
    N, K,
    stride_xt, stride_xk, stride_wn, stride_wk, stride_yt, stride_yn,
    threshold,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pn = tl.program_id(1)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
        active = (tl.abs(x) >= threshold) & (k < K)
        if tl.sum(active.to(tl.int32), axis=0) > 0:  # an all-inactive block reads no weights
            w = tl.load(
                w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                mask=n_ok[:, None] & active[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(w * tl.where(active, x, 0.0)[None, :], axis=1)
    tl.store(y_ptr + t * stride_yt + n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def _launch(x2: torch.Tensor, weight: torch.Tensor, threshold: float, block_n: int, block_k: int) -> torch.Tensor:
    tokens, k_dim = x2.shape
    n_dim = weight.shape[0]
    y = torch.empty((tokens, n_dim), dtype=x2.dtype, device=x2.device)
    grid = (tokens, triton.cdiv(n_dim, block_n))
    _sparse_gemv_kernel[grid](
        x2, weight, y,
        n_dim, k_dim,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        float(threshold),
        BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return y


def sparse_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    threshold: float,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """``y = weight @ (x where |x| >= threshold else 0)`` skipping inactive input channels.

    x: (in,) or (..., in); weight: (out, in), any strides (channel-major ``w_t.t()`` gives
    contiguous column reads). Returns (..., out) in ``x.dtype``. ``block_n``/``block_k``: tile
    sizes, powers of two (default 64; larger under the interpreter, which pays per program and
    per loop step); whole blocks of ``block_k`` inactive channels skip the weight load entirely.
    """
    _check(x, weight)
    block_n = block_n or (256 if INTERPRETED else 64)
    block_k = block_k or (128 if INTERPRETED else 64)
    if block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"block_n/block_k: expected powers of two, got {block_n}, {block_k}")
    lead = x.shape[:-1]
    y = _launch(x.reshape(-1, x.shape[-1]), weight, threshold, block_n, block_k)
    return y.reshape(*lead, weight.shape[0])
