"""Codebook (LUT) and uniform-grid (RTN) dequantize-and-multiply in Triton: the results of
:mod:`kernels.lut_gemm.reference`.

The packed codes of a row are read as int32 words (:func:`kernels.bitplane_gemm.triton.as_words`:
a zero-copy view when ``in_features`` is a multiple of 32). 32 consecutive codes of ``bits`` bits
fill exactly ``bits`` words — a *chunk* — so inside a chunk the word and shift of every code are
compile-time constants: code ``i`` starts at bit ``i · bits``; a 3-, 5-, 6- or 7-bit code that
straddles two words is joined from both. Each word is loaded once per chunk.

**GEMV** (one or two tokens; group scope and RTN need ``group_size`` a multiple of 32). A program
owns ``BLOCK_N`` rows x ``BLOCK_C`` chunks per K step and a slice of K (``split_k``, the same
arrival-counted reduction as the bit-plane kernel). Codebook scopes gather the level
``codebook[seg, code]`` (a few bytes per row, cache-resident) and accumulate ``x · level`` in fp32;
a tensor codebook's row scale multiplies the row sum once. RTN turns the code into a float with
the ``2**23`` exponent trick (``bitcast(code | 0x4B000000) - 2**23``, no int-to-float conversion),
accumulates ``Σ x q`` per chunk and applies ``scale · (Σ x q - zero · Σ x)`` once per chunk.

**GEMM** (more tokens, or unaligned groups). Per K step the (BLOCK_N, BLOCK_C, 32) weight tile is
decoded in registers (each code's word and bit offset from its position, gathered per element),
looked up, reshaped to (BLOCK_N, 32 BLOCK_C) and multiplied with the activation tile by one
``tl.dot`` (fp16 operands for fp16 activations, fp32 otherwise), accumulated in fp32 as ``y^T``.
RTN with the step inside one group multiplies the exact integer codes and applies
``scale · (Σ x q - zero · Σ x)`` per row; otherwise each element is ``(q - zero) · scale``.

Codebooks may be fp16 as stored or fp32: an fp32 copy made once at load time saves the GEMV an
fp16-to-fp32 conversion per weight. On sm_90 (``python -m kernels.bitplane_gemm.compile_check``)
the codebook GEMV issues ~10.5 instructions per weight at 3 bits (the 64-bit address of each
gather is most of it), RTN's ~9.3 at 4 bits.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import triton
import triton.language as tl

from kernels.bitplane_gemm.triton import (
    GemmTiles,
    GemvTiles,
    _check_pow2,
    _counters,
    _split_for,
    _write_out,
    as_words,
    step_chunks,
)
from kernels.lut_gemm.reference import Scope, check_lut_inputs, check_rtn_inputs, n_groups

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

GEMV_MAX_TOKENS = 2

# How a decoded code becomes a weight (the kernels' MODE).
ROW, GROUP, TENSOR, AFFINE = 0, 1, 2, 3
_MODES = {"row": ROW, "group": GROUP, "tensor": TENSOR}


@triton.jit
def _next_code(cur, wbase, m, i: tl.constexpr, BITS: tl.constexpr):
    """Code ``i`` (0..31) of each chunk, given ``cur``, the chunk word where it starts; returns the
    code and the word where code ``i + 1`` starts (loaded here when it is a new one)."""
    LO: tl.constexpr = (i * BITS) % 32
    Q: tl.constexpr = (i * BITS) // 32
    MASK: tl.constexpr = (1 << BITS) - 1
    if LO + BITS > 32:  # straddles words Q and Q + 1
        nxt = tl.load(wbase + (Q + 1), mask=m, other=0)
        code = ((cur >> LO) & ((1 << (32 - LO)) - 1)) | ((nxt << (32 - LO)) & MASK)
        return code, nxt
    else:
        code = (cur >> LO) & MASK  # the arithmetic shift's sign fill lies above MASK
        if LO + BITS == 32:
            if i < 31:
                return code, tl.load(wbase + (Q + 1), mask=m, other=0)
            else:
                return code, cur
        else:
            return code, cur


@triton.jit
def _code_float(code):
    """int32 code (0..255) -> fp32 without a conversion instruction: 2**23 + code, minus 2**23."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _lut_gemv_kernel(
    x_ptr, w_ptr, cb_ptr, rs_ptr, sc_ptr, zr_ptr, y_ptr, part_ptr, count_ptr,
    N, K, NC, G, group_size, chunks_per_split, split_stride, n_splits,
    stride_xt, stride_wn, stride_cb, stride_sn, stride_sg, stride_zn, stride_zg,
    BITS: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, NC)
    tot = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < c_end
        m = n_ok[:, None] & c_ok[None, :]
        g = (c * 32) // group_size  # one group per chunk (checked on the host for GROUP / AFFINE)
        wbase = w_ptr + rows * stride_wn + (c * BITS)[None, :]
        if MODE == 0:
            book = cb_ptr + rows * stride_cb
        elif MODE == 1:
            book = cb_ptr + (rows * G + g[None, :]) * stride_cb
        else:
            book = cb_ptr
        qx = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        sx = tl.zeros([BLOCK_C], dtype=tl.float32)
        cur = tl.load(wbase, mask=m, other=0)
        for i in tl.static_range(32):
            code, cur = _next_code(cur, wbase, m, i, BITS)
            col = c * 32 + i
            xs = tl.load(x_row + col, mask=c_ok & (col < K), other=0.0).to(tl.float32)
            if MODE == 3:
                qx += xs[None, :] * _code_float(code)
                sx += xs
            else:
                level = tl.load(book + code, mask=m, other=0.0).to(tl.float32)
                tot += xs[None, :] * level
        if MODE == 3:
            scale = tl.load(sc_ptr + rows * stride_sn + g[None, :] * stride_sg, mask=m, other=0.0).to(tl.float32)
            zero = tl.load(zr_ptr + rows * stride_zn + g[None, :] * stride_zg, mask=m, other=0.0).to(tl.float32)
            tot += scale * (qx - zero * sx[None, :])
    y = tl.sum(tot, axis=1)
    if MODE == 2:
        y = y * tl.load(rs_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    offs = t.to(tl.int64) * N + n
    slot = t * tl.num_programs(0) + pid_n
    _write_out(y, offs, n_ok, y_ptr, part_ptr, count_ptr, slot, pid_k, split_stride, n_splits, SPLIT)


@triton.jit
def _lut_gemm_kernel(
    x_ptr, w_ptr, cb_ptr, rs_ptr, sc_ptr, zr_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, NC, G, group_size, chunks_per_split, split_stride, n_splits,
    stride_xm, stride_wn, stride_cb, stride_sn, stride_sg, stride_zn, stride_zg,
    BITS: tl.constexpr, MODE: tl.constexpr, ALIGNED: tl.constexpr, STEP_IN_GROUP: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP16: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    rows3 = rows[:, :, None]
    tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = tok < M
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xm
    # Where code s of a chunk lies: word q, bit lo; a code with lo + BITS > 32 continues in word q + 1.
    s = tl.arange(0, 32)
    q = ((s * BITS) // 32)[None, None, :]
    lo = ((s * BITS) % 32)[None, None, :]
    straddles = lo + BITS > 32
    hi_shift = ((32 - lo) & 31).to(tl.uint32)  # never a shift by 32
    lo = lo.to(tl.uint32)  # logical shifts of the unsigned words
    kk = tl.arange(0, BLOCK_C * 32)
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, NC)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T: the decoded weight is tl.dot's row-major A
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < c_end
        col3 = c[None, :, None] * 32 + s[None, None, :]
        m3 = n_ok[:, None, None] & c_ok[None, :, None] & (col3 < K)
        wbase = w_ptr + rows3 * stride_wn + (c * BITS)[None, :, None] + q
        low = tl.load(wbase, mask=m3, other=0).to(tl.uint32, bitcast=True)
        high = tl.load(wbase + 1, mask=m3 & straddles, other=0).to(tl.uint32, bitcast=True)
        code = (((low >> lo) | (high << hi_shift)) & ((1 << BITS) - 1)).to(tl.int32, bitcast=True)
        cols = c0 * 32 + kk
        xs = tl.load(x_rows + cols[None, :], mask=tok_ok[:, None] & ((cols < K) & (cols < c_end * 32))[None, :],
                     other=0.0)
        if DOT_FP16:
            xs_t = tl.trans(xs.to(tl.float16))
        else:
            xs_t = tl.trans(xs.to(tl.float32))
        if STEP_IN_GROUP:  # the step lies in one group (or the codebooks have none): parameters per row
            g = (c0 * 32) // group_size
            if MODE == 3:  # exact integer codes in the product, then scale · (Σ x q - zero · Σ x) per row
                w2 = tl.reshape(_code_float(code), (BLOCK_N, BLOCK_C * 32))
                if DOT_FP16:
                    part = tl.dot(w2.to(tl.float16), xs_t)
                else:
                    part = tl.dot(w2, xs_t, input_precision=INPUT_PRECISION)
                scale = tl.load(sc_ptr + n * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)
                zero = tl.load(zr_ptr + n * stride_zn + g * stride_zg, mask=n_ok, other=0.0).to(tl.float32)
                sx = tl.sum(xs.to(tl.float32), axis=1)
                acc += scale[:, None] * (part - zero[:, None] * sx[None, :])
            else:
                if MODE == 0:
                    book = cb_ptr + rows3 * stride_cb
                elif MODE == 1:
                    book = cb_ptr + (rows3 * G + g) * stride_cb
                else:
                    book = cb_ptr
                w2 = tl.reshape(tl.load(book + code, mask=m3, other=0.0).to(tl.float32), (BLOCK_N, BLOCK_C * 32))
                if DOT_FP16:
                    acc += tl.dot(w2.to(tl.float16), xs_t)
                else:
                    acc += tl.dot(w2, xs_t, input_precision=INPUT_PRECISION)
        else:  # groups change inside the step: parameters per chunk (ALIGNED) or per column
            if ALIGNED:
                g = ((c * 32) // group_size)[None, :, None]
                mg = (n_ok[:, None] & c_ok[None, :])[:, :, None]
            else:
                g = col3 // group_size
                mg = m3
            if MODE == 3:
                scale = tl.load(sc_ptr + rows3 * stride_sn + g * stride_sg, mask=mg, other=0.0).to(tl.float32)
                zero = tl.load(zr_ptr + rows3 * stride_zn + g * stride_zg, mask=mg, other=0.0).to(tl.float32)
                wv = (_code_float(code) - zero) * scale
            else:  # MODE 1: ROW and TENSOR codebooks are always a step in one "group"
                wv = tl.load(cb_ptr + (rows3 * G + g) * stride_cb + code, mask=m3, other=0.0).to(tl.float32)
            w2 = tl.reshape(wv, (BLOCK_N, BLOCK_C * 32))
            if DOT_FP16:
                acc += tl.dot(w2.to(tl.float16), xs_t)
            else:
                acc += tl.dot(w2, xs_t, input_precision=INPUT_PRECISION)
    if MODE == 2:
        acc = acc * tl.load(rs_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    offs = tok.to(tl.int64)[None, :] * N + n[:, None]
    slot = pid_m * tl.num_programs(0) + pid_n
    _write_out(acc, offs, n_ok[:, None] & tok_ok[None, :], y_ptr, part_ptr, count_ptr, slot, pid_k,
               split_stride, n_splits, SPLIT)


# ---------------------------------------------------------------------------------------------
# Host side


def default_gemv_tiles(n_rows: int, n_chunks: int, tokens: int, device: torch.device) -> GemvTiles:
    if INTERPRETED:
        return GemvTiles(block_n=min(128, triton.next_power_of_2(n_rows)),
                         block_c=min(16, triton.next_power_of_2(n_chunks)), split_k=1)
    block_n, block_c = 64, 8
    split = _split_for(triton.cdiv(n_rows, block_n) * tokens, triton.cdiv(n_chunks, block_c), device)
    return GemvTiles(block_n=block_n, block_c=block_c, split_k=split, num_warps=4)


def default_gemm_tiles(tokens: int, n_rows: int, n_chunks: int, device: torch.device,
                       group_size: int | None = None) -> GemmTiles:
    """``group_size`` None: no groups (row / tensor codebooks)."""
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    # 64 rows x 2 chunks: the per-element word gathers of wider steps spill registers on sm_90.
    most = 16 if INTERPRETED else 2
    wide = min(most, triton.next_power_of_2(n_chunks))
    block_c = wide if group_size is None else (step_chunks(group_size, most) or wide)
    if INTERPRETED:
        return GemmTiles(block_m=block_m, block_n=min(64, max(16, triton.next_power_of_2(n_rows))),
                         block_c=block_c, split_k=1)
    block_n = 64
    split = _split_for(triton.cdiv(n_rows, block_n) * triton.cdiv(tokens, block_m),
                       triton.cdiv(n_chunks, block_c), device)
    # Two stages: the per-element word gathers of a third pipelined stage would need ~150 KB of shared memory.
    return GemmTiles(block_m=block_m, block_n=block_n, block_c=block_c, split_k=split, num_warps=4, num_stages=2)


def _split(nc: int, block_c: int, split_k: int) -> tuple[int, int]:
    steps = triton.cdiv(nc, block_c)
    split = max(1, min(split_k, steps))
    chunks_per_split = triton.cdiv(steps, split) * block_c
    return triton.cdiv(nc, chunks_per_split), chunks_per_split


def _run(x, codes, bits, mode, group_size, cb, row_scale, scales, zeros, path, tiles):
    """Shared host side of :func:`lut_gemm` / :func:`rtn_gemm`: words view, path choice, launch."""
    rows, cols = codes.shape[0], x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    tokens = x2.shape[0]
    if tokens == 0:
        return x.new_zeros((*lead, rows))
    nc = -(-cols // 32)
    words = as_words(codes, nc * bits)
    G = n_groups(cols, group_size)
    aligned = mode in (ROW, TENSOR) or group_size % 32 == 0
    if path == "auto":
        path = "gemv" if tokens <= GEMV_MAX_TOKENS and aligned else "gemm"
    # Unused pointers get a real tensor of any kind; the kernels never read them.
    cb = cb.contiguous() if cb is not None else words
    rs = row_scale.contiguous() if row_scale is not None else words
    sc = scales if scales is not None else words
    zr = zeros if zeros is not None else words
    sc_strides = (sc.stride(0), sc.stride(1)) if scales is not None else (0, 0)
    zr_strides = (zr.stride(0), zr.stride(1)) if zeros is not None else (0, 0)
    y = torch.empty((tokens, rows), dtype=x2.dtype, device=x2.device)
    if path == "gemv":
        if not aligned:
            raise ValueError(f"path='gemv' needs group_size a multiple of 32 here, got {group_size} (use 'gemm')")
        t = tiles if isinstance(tiles, GemvTiles) else default_gemv_tiles(rows, nc, tokens, x.device)
        _check_pow2(block_n=t.block_n, block_c=t.block_c)
        split, per = _split(nc, t.block_c, t.split_k)
        grid_n = triton.cdiv(rows, t.block_n)
        part = torch.empty((split, tokens, rows), dtype=torch.float32, device=x.device) if split > 1 else y
        counts = _counters(x.device, grid_n * tokens) if split > 1 else y
        _lut_gemv_kernel[(grid_n, split, tokens)](
            x2, words, cb, rs, sc, zr, y, part, counts,
            rows, cols, nc, G, group_size, per, tokens * rows, split,
            x2.stride(0), words.stride(0), cb.stride(0), *sc_strides, *zr_strides,
            BITS=bits, MODE=mode, SPLIT=split > 1, BLOCK_N=t.block_n, BLOCK_C=t.block_c, num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
    elif path == "gemm":
        t = tiles if isinstance(tiles, GemmTiles) else default_gemm_tiles(
            tokens, rows, nc, x.device, None if mode in (ROW, TENSOR) else group_size)
        _check_pow2(block_m=t.block_m, block_n=t.block_n, block_c=t.block_c)
        if min(t.block_m, t.block_n) < 16:
            raise ValueError(f"GEMM tiles: block_m and block_n must be >= 16 (tl.dot), got {t}")
        split, per = _split(nc, t.block_c, t.split_k)
        grid_n, grid_m = triton.cdiv(rows, t.block_n), triton.cdiv(tokens, t.block_m)
        part = torch.empty((split, tokens, rows), dtype=torch.float32, device=x.device) if split > 1 else y
        counts = _counters(x.device, grid_n * grid_m) if split > 1 else y
        _lut_gemm_kernel[(grid_n, grid_m, split)](
            x2, words, cb, rs, sc, zr, y, part, counts,
            tokens, rows, cols, nc, G, group_size, per, tokens * rows, split,
            x2.stride(0), words.stride(0), cb.stride(0), *sc_strides, *zr_strides,
            BITS=bits, MODE=mode, ALIGNED=aligned,
            STEP_IN_GROUP=mode in (ROW, TENSOR) or group_size % (32 * t.block_c) == 0, SPLIT=split > 1,
            DOT_FP16=x2.dtype == torch.float16,
            INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_C=t.block_c, num_warps=t.num_warps,
            num_stages=t.num_stages,
        )
    else:
        raise ValueError(f"path: expected 'auto', 'gemv' or 'gemm', got {path!r}")
    return y.reshape(*lead, rows)


def lut_gemm(
    x: torch.Tensor,
    codes: torch.Tensor,
    codebook: torch.Tensor,
    *,
    bits: int,
    scope: Scope = "row",
    group_size: int = 128,
    row_scale: torch.Tensor | None = None,
    path: Literal["auto", "gemv", "gemm"] = "auto",
    tiles: GemvTiles | GemmTiles | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for NuBitQ's stored codes and codebooks (see :mod:`kernels.lut_gemm.reference`).

    x: (..., in) fp32/fp16/bf16; codes uint8 (out, ceil(in · bits / 8)); codebook (segments,
    2**bits) for ``scope``; row_scale (out,) for ``tensor`` scope. Returns (..., out) in ``x.dtype``,
    accumulated in fp32. ``path``/``tiles`` as in :func:`kernels.bitplane_gemm.triton.bitplane_gemm`.

    >>> y = lut_gemm(x, t["w.codes"], t["w.codebook"], bits=3, scope="row")
    """
    check_lut_inputs(x, codes, codebook, bits, scope, group_size, row_scale)
    return _run(x, codes, bits, _MODES[scope], group_size, codebook, row_scale, None, None, path, tiles)


def rtn_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    path: Literal["auto", "gemv", "gemm"] = "auto",
    tiles: GemvTiles | GemmTiles | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for RTN's stored ``qweight``/``scales``/``zeros`` (equation (2) of the reference; the
    uniform grid is the codebook, used directly). ``zeros=None``: symmetric RTN (zero ``2**(bits-1)``)."""
    rows, cols = check_rtn_inputs(x, qweight, scales, zeros, bits, group_size)
    if zeros is None:
        zeros = torch.full_like(scales, float(2 ** (bits - 1)))
    return _run(x, qweight, bits, AFFINE, group_size, None, None, scales, zeros, path, tiles)


__all__ = ["lut_gemm", "rtn_gemm", "default_gemv_tiles", "default_gemm_tiles", "GemvTiles", "GemmTiles",
           "INTERPRETED"]
