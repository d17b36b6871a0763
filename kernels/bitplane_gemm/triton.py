"""Bit-plane (BCQ) GEMV/GEMM in Triton: the same result as :mod:`kernels.bitplane_gemm.reference`.

The packed planes are read as int32 words, each holding one plane's bits of a *chunk* of 32
consecutive input channels (:func:`as_words`: a zero-copy view of the stored uint8 planes when
``in_features`` is a multiple of 32, else one padded copy). Only planes ``0 .. bits-1`` are read.

**GEMV** (one or two tokens, decoding; groups a multiple of 32 channels). A program owns
``BLOCK_N`` output rows x ``BLOCK_C`` chunks per step of its K loop and a slice of the K axis
(``split_k`` programs per row block, so a 4096-row layer still fills the GPU; the last program of
a row block to finish sums the slices in a fixed order, counted with an atomic, so no extra kernel
runs and the result does not depend on which program finishes last). Each
bit is turned into a float without an integer-to-float conversion: a word is shifted so that
four of its bits sit on the lowest exponent bits 23..26 of an fp32 (one shift per four bits),
then ``bits & (1 << (23 + i)) | (0x3F800000 - (1 << (23 + i)))`` *is* the float ``1.0`` for a set
bit and ``a_i = 2**-(2**i)`` for a clear one: one AND/OR per weight and plane. Since
``2 b - 1 = F_i v + G_i`` with ``F_i = 2 / (1 - a_i)``, ``G_i = -(1 + a_i) / (1 - a_i)``, the
activation is pre-scaled by ``F_i`` once per chunk column and the ``G_i`` term is a per-chunk sum of
``x``, so the inner loop is one AND/OR and one FMA per weight and plane, accumulated in fp32 per
plane and multiplied by ``α_p`` once per (row, chunk). Equation (1) of the reference then gives
``y = Σ_chunks [Σ_p α_p (Σ_j x'_j v_pj + C) + z Σ_j x_j]``.

**GEMM** (more tokens, or groups that are not a multiple of 32). Each K step of ``BLOCK_C`` chunks is
decoded in registers as a (BLOCK_N, BLOCK_C, 32) tensor — every bit shifted onto the sign bit of
fp32 ``1.0`` (``~bits << (31 - s) & 0x80000000 | 0x3F800000`` is ``b_p`` itself), reshaped to
(BLOCK_N, 32 BLOCK_C) and multiplied with the activation tile by ``tl.dot`` (fp16 operands for fp16
activations, fp32 otherwise — bf16 ``tl.dot`` is wrong in the interpreter), accumulated in fp32 as
``y^T`` so the decoded weight is the row-major operand. When the step lies inside one group (32
``BLOCK_C`` divides ``group_size``, the default tiles arrange it) each plane is its own exact ±1
product, scaled by ``α_p`` per row afterwards, and ``z`` multiplies the step's ``Σ x``; otherwise
``z + Σ_p α_p b_p`` is built element by element first. K splits as in the GEMV.

What the SASS for sm_90 shows (``python -m kernels.bitplane_gemm.compile_check`` builds it without a
GPU): the GEMV at 3 bits with the default 128 x 8 tile issues ~3.75 instructions per weight and plane
(one LOP3 and one FFMA each, the rest shifts, activation loads and conversions), ~250 registers, no
spills — it is issue-bound, not HBM-bound, which is what the benchmark's ratio to fp16 will show.
The GEMM's decoded tile reaches ``tl.dot``'s operand layout through shared memory one element at a
time (~10 instructions per weight and plane, shared by its 16 tokens).
"""

from __future__ import annotations

import functools
import os
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from kernels.bitplane_gemm.reference import check_inputs, n_groups

# Whether the kernels below were defined under the interpreter (read at definition time by Triton).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

GEMV_MAX_TOKENS = 2  # above this, one decode of the weight shared by all tokens (tl.dot) wins


class GemvTiles(NamedTuple):
    """``block_n`` rows x ``block_c`` chunks of 32 channels per step; ``split_k`` programs share a row block."""

    block_n: int
    block_c: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


class GemmTiles(NamedTuple):
    """``block_m`` tokens x ``block_n`` rows (both >= 16, for ``tl.dot``), ``block_c`` chunks of 32 channels per K step."""

    block_m: int
    block_n: int
    block_c: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3  # software-pipelined K steps (shared memory grows with it)


# ---------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _to_exponent(w, h: tl.constexpr):
    """Move bits ``4h .. 4h+3`` of each int32 word to bits 23..26 (an arithmetic right shift is fine:
    only bits 23..26 are kept, and they never come from the sign fill)."""
    if 4 * h <= 23:
        return w << (23 - 4 * h)
    else:
        return w >> (4 * h - 23)


@triton.jit
def _bit_value(e, i: tl.constexpr, one):
    """fp32 ``1.0`` where bit ``23 + i`` of ``e`` is set, else ``2**-(2**i)`` (0.5, 0.25, 2**-4, 2**-8).
    ``one`` is the bit pattern of 1.0 (0x3F800000) passed at run time: as a register operand ptxas
    fuses the AND and the OR into one LOP3 (with two immediates it emits two)."""
    BIT: tl.constexpr = 1 << (23 + i)
    return ((e & BIT) | (one - BIT)).to(tl.float32, bitcast=True)  # 1.0 has exponent bits 23..29 set


@triton.jit
def _class_scale(x, i: tl.constexpr):
    """``F_i x`` with ``F_i = 2 / (1 - 2**-(2**i))``."""
    if i == 0:
        return x * 4.0
    elif i == 1:
        return x * 2.6666666666666665
    elif i == 2:
        return x * 2.1333333333333333
    else:
        return x * 2.007843137254902


@triton.jit
def _class_offsets(s):
    """``G_{s % 4} = -(1 + a) / (1 - a)`` for bit positions ``s``."""
    cls = s % 4
    return tl.where(cls == 0, -3.0,
                    tl.where(cls == 1, -1.6666666666666667,
                             tl.where(cls == 2, -1.1333333333333333, -1.0078431372549019)))


@triton.jit
def _write_out(acc, offs, mask, y_ptr, part_ptr, count_ptr, slot, pid_k, split_stride, n_splits, SPLIT: tl.constexpr):
    """Store this program's fp32 result ``acc`` at ``y_ptr + offs``, or, with the K axis split over
    ``n_splits`` programs, its slice: the last of them to arrive at ``slot`` sums the slices in a
    fixed order (deterministic), writes ``y`` and resets the counter for the next launch."""
    if not SPLIT:
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * split_stride + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's slice is stored before the counter moves
        arrived = tl.atomic_add(count_ptr + slot, 1, sem="acq_rel", scope="gpu")
        if arrived == n_splits - 1:
            ptrs = part_ptr + offs
            total = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for _ in range(1, n_splits):
                ptrs += split_stride  # pointer steps: no int32 product to overflow
                total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + slot, 0)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _bcq_gemv_kernel(
    x_ptr, w_ptr, a_ptr, z_ptr, y_ptr, part_ptr, count_ptr,
    N, K, NC, group_size, chunks_per_split, split_stride, n_splits, one,
    stride_xt, stride_wp, stride_wn, stride_an, stride_ag, stride_ap, stride_zn, stride_zg,
    BITS: tl.constexpr, HAS_Z: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    t = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    s32 = tl.arange(0, 32)
    g_s = _class_offsets(s32)
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, NC)
    tot = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < c_end
        m = n_ok[:, None] & c_ok[None, :]
        # Per chunk: Σ x and Σ G_s x (the constant part of 2b - 1), from one vectorised load.
        cols = c[:, None] * 32 + s32[None, :]
        xt = tl.load(x_row + cols, mask=c_ok[:, None] & (cols < K), other=0.0).to(tl.float32)
        sx = tl.sum(xt, axis=1)
        cx = tl.sum(xt * g_s[None, :], axis=1)

        wp = w_ptr + rows * stride_wn + c[None, :]
        w0 = tl.load(wp, mask=m, other=0)
        p0 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 1:
            w1 = tl.load(wp + stride_wp, mask=m, other=0)
            p1 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 2:
            w2 = tl.load(wp + 2 * stride_wp, mask=m, other=0)
            p2 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 3:
            w3 = tl.load(wp + 3 * stride_wp, mask=m, other=0)
            p3 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 4:
            w4 = tl.load(wp + 4 * stride_wp, mask=m, other=0)
            p4 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 5:
            w5 = tl.load(wp + 5 * stride_wp, mask=m, other=0)
            p5 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 6:
            w6 = tl.load(wp + 6 * stride_wp, mask=m, other=0)
            p6 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
        if BITS > 7:
            w7 = tl.load(wp + 7 * stride_wp, mask=m, other=0)
            p7 = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)

        for h in tl.static_range(8):
            e0 = _to_exponent(w0, h)
            if BITS > 1:
                e1 = _to_exponent(w1, h)
            if BITS > 2:
                e2 = _to_exponent(w2, h)
            if BITS > 3:
                e3 = _to_exponent(w3, h)
            if BITS > 4:
                e4 = _to_exponent(w4, h)
            if BITS > 5:
                e5 = _to_exponent(w5, h)
            if BITS > 6:
                e6 = _to_exponent(w6, h)
            if BITS > 7:
                e7 = _to_exponent(w7, h)
            for i in tl.static_range(4):
                col = c * 32 + (4 * h + i)
                if EVEN_K:  # the chunk mask alone: computed once, not per bit position
                    xs = tl.load(x_row + col, mask=c_ok, other=0.0).to(tl.float32)
                else:
                    xs = tl.load(x_row + col, mask=c_ok & (col < K), other=0.0).to(tl.float32)
                xq = _class_scale(xs, i)[None, :]
                p0 += xq * _bit_value(e0, i, one)
                if BITS > 1:
                    p1 += xq * _bit_value(e1, i, one)
                if BITS > 2:
                    p2 += xq * _bit_value(e2, i, one)
                if BITS > 3:
                    p3 += xq * _bit_value(e3, i, one)
                if BITS > 4:
                    p4 += xq * _bit_value(e4, i, one)
                if BITS > 5:
                    p5 += xq * _bit_value(e5, i, one)
                if BITS > 6:
                    p6 += xq * _bit_value(e6, i, one)
                if BITS > 7:
                    p7 += xq * _bit_value(e7, i, one)

        g = (c * 32) // group_size  # a chunk lies in one group (group_size % 32 == 0)
        ap = a_ptr + rows * stride_an + g[None, :] * stride_ag
        a = tl.load(ap, mask=m, other=0.0).to(tl.float32)
        tot += a * p0
        a_sum = a
        if BITS > 1:
            a = tl.load(ap + stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p1
            a_sum += a
        if BITS > 2:
            a = tl.load(ap + 2 * stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p2
            a_sum += a
        if BITS > 3:
            a = tl.load(ap + 3 * stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p3
            a_sum += a
        if BITS > 4:
            a = tl.load(ap + 4 * stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p4
            a_sum += a
        if BITS > 5:
            a = tl.load(ap + 5 * stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p5
            a_sum += a
        if BITS > 6:
            a = tl.load(ap + 6 * stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p6
            a_sum += a
        if BITS > 7:
            a = tl.load(ap + 7 * stride_ap, mask=m, other=0.0).to(tl.float32)
            tot += a * p7
            a_sum += a
        tot += a_sum * cx[None, :]
        if HAS_Z:
            z = tl.load(z_ptr + rows * stride_zn + g[None, :] * stride_zg, mask=m, other=0.0).to(tl.float32)
            tot += z * sx[None, :]

    y = tl.sum(tot, axis=1)
    offs = t.to(tl.int64) * N + n
    slot = t * tl.num_programs(0) + pid_n
    _write_out(y, offs, n_ok, y_ptr, part_ptr, count_ptr, slot, pid_k, split_stride, n_splits, SPLIT)


@triton.jit
def _bcq_gemm_kernel(
    x_ptr, w_ptr, a_ptr, z_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, NC, group_size, chunks_per_split, split_stride, n_splits, one,
    stride_xm, stride_wp, stride_wn, stride_an, stride_ag, stride_ap, stride_zn, stride_zg,
    BITS: tl.constexpr, HAS_Z: tl.constexpr, ALIGNED: tl.constexpr, STEP_IN_GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP16: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = n.to(tl.int64)[:, None]
    tok = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_ok = tok < M
    x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xm
    s = tl.arange(0, 32)
    to_sign_bit = (31 - s)[None, None, :]
    kk = tl.arange(0, BLOCK_C * 32)
    c_begin = pid_k * chunks_per_split
    c_end = tl.minimum(c_begin + chunks_per_split, NC)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T: the decoded weight is tl.dot's row-major A
    for c0 in range(c_begin, c_end, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_ok = c < c_end
        m = n_ok[:, None] & c_ok[None, :]
        cols = c0 * 32 + kk
        xs = tl.load(x_rows + cols[None, :], mask=tok_ok[:, None] & ((cols < K) & (cols < c_end * 32))[None, :],
                     other=0.0)
        if DOT_FP16:
            xs_t = tl.trans(xs.to(tl.float16))
        else:
            xs_t = tl.trans(xs.to(tl.float32))
        wp = w_ptr + rows * stride_wn + c[None, :]
        if STEP_IN_GROUP:
            # The step lies in one group: one exact ±1 product per plane, scaled per row afterwards.
            g = (c0 * 32) // group_size
            for p in tl.static_range(BITS):
                words = tl.load(wp + p * stride_wp, mask=m, other=0)
                # Bit s of ~words moved onto the sign bit of 1.0: +1.0 where b_p = +1, -1.0 where b_p = -1.
                sign = (((~words)[:, :, None] << to_sign_bit) & -2147483648) | one
                w2 = tl.reshape(sign.to(tl.float32, bitcast=True), (BLOCK_N, BLOCK_C * 32))  # column 32 c + s
                if DOT_FP16:
                    part = tl.dot(w2.to(tl.float16), xs_t)
                else:
                    part = tl.dot(w2, xs_t, input_precision=INPUT_PRECISION)
                a = tl.load(a_ptr + n * stride_an + g * stride_ag + p * stride_ap, mask=n_ok, other=0.0)
                acc += a.to(tl.float32)[:, None] * part
            if HAS_Z:
                z = tl.load(z_ptr + n * stride_zn + g * stride_zg, mask=n_ok, other=0.0).to(tl.float32)
                acc += z[:, None] * tl.sum(xs.to(tl.float32), axis=1)[None, :]
        else:
            # Scales change inside the step: decode z + Σ α_p b_p element by element.
            col3 = c[None, :, None] * 32 + s[None, None, :]  # (1, BLOCK_C, 32): column of every bit
            m3 = m[:, :, None] & (col3 < K)
            if ALIGNED:  # one group per chunk
                g = ((c * 32) // group_size)[None, :]
            else:
                g3 = col3 // group_size
            if HAS_Z:
                if ALIGNED:
                    wv = tl.load(z_ptr + rows * stride_zn + g * stride_zg, mask=m, other=0.0).to(tl.float32)[:, :, None]
                else:
                    wv = tl.load(z_ptr + rows[:, :, None] * stride_zn + g3 * stride_zg, mask=m3,
                                 other=0.0).to(tl.float32)
            else:
                wv = tl.zeros([BLOCK_N, BLOCK_C, 1], dtype=tl.float32)
            for p in tl.static_range(BITS):
                words = tl.load(wp + p * stride_wp, mask=m, other=0)
                sign = ((((~words)[:, :, None] << to_sign_bit) & -2147483648) | one).to(tl.float32, bitcast=True)
                if ALIGNED:
                    a = tl.load(a_ptr + rows * stride_an + g * stride_ag + p * stride_ap, mask=m, other=0.0)
                    a = a.to(tl.float32)[:, :, None]
                else:
                    a = tl.load(a_ptr + rows[:, :, None] * stride_an + g3 * stride_ag + p * stride_ap, mask=m3,
                                other=0.0)
                    a = a.to(tl.float32)
                wv = wv + a * sign
            w2 = tl.reshape(wv, (BLOCK_N, BLOCK_C * 32))
            if DOT_FP16:
                acc += tl.dot(w2.to(tl.float16), xs_t)
            else:
                acc += tl.dot(w2, xs_t, input_precision=INPUT_PRECISION)

    offs = tok.to(tl.int64)[None, :] * N + n[:, None]
    slot = pid_m * tl.num_programs(0) + pid_n
    _write_out(acc, offs, n_ok[:, None] & tok_ok[None, :], y_ptr, part_ptr, count_ptr, slot, pid_k,
               split_stride, n_splits, SPLIT)


# ---------------------------------------------------------------------------------------------
# Host side


def as_words(packed: torch.Tensor, words_per_row: int) -> torch.Tensor:
    """uint8 (..., nbytes) -> int32 (..., words_per_row), little-endian: bit ``j % 32`` of word ``j // 32``
    is bit ``j % 8`` of byte ``j // 8``. A zero-copy view when each row already has
    ``4 * words_per_row`` bytes (``in_features`` a multiple of 32 for planes), else a zero-padded copy
    (do it once at load time for such shapes)."""
    want = 4 * words_per_row
    if packed.shape[-1] == want and packed.is_contiguous() and packed.storage_offset() % 4 == 0:
        return packed.view(torch.int32)
    out = torch.zeros((*packed.shape[:-1], want), dtype=torch.uint8, device=packed.device)
    out[..., : packed.shape[-1]] = packed
    return out.view(torch.int32)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Split-K arrival counters for this device and stream: zero between launches (each launch resets
    the ones it used), so they are allocated once."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_for(programs: int, tiles: int, device: torch.device) -> int:
    """Split K until about four programs per SM, never below one K step per program."""
    if device.type != "cuda":
        return 1
    target = 4 * _sm_count(device.index or 0)
    return max(1, min(tiles, -(-target // max(programs, 1))))


def default_gemv_tiles(n_rows: int, n_chunks: int, tokens: int, device: torch.device) -> GemvTiles:
    if INTERPRETED:  # the interpreter pays per program and per op, not per element: few, big tiles
        return GemvTiles(block_n=min(128, triton.next_power_of_2(n_rows)),
                         block_c=min(16, triton.next_power_of_2(n_chunks)), split_k=1)
    # 128 x 8 words: each thread holds 2 rows x 4 chunks (16-byte loads, full 32-byte sectors per row), so
    # each activation value loaded for a bit position serves 2 rows x bits planes; ~3.75 instructions per
    # weight and plane on sm_90 (SASS), no spills. Larger tiles spill.
    block_n, block_c = 128, 8
    split = _split_for(triton.cdiv(n_rows, block_n) * tokens, triton.cdiv(n_chunks, block_c), device)
    return GemvTiles(block_n=block_n, block_c=block_c, split_k=split, num_warps=4)


def step_chunks(group_size: int, most: int) -> int | None:
    """The most chunks (a power of two, at most ``most``) per K step that keep each step inside one
    group, or None when a group is not a whole number of chunks."""
    if group_size % 32:
        return None
    bc = 1
    while bc * 2 <= most and group_size % (32 * bc * 2) == 0:
        bc *= 2
    return bc


def default_gemm_tiles(tokens: int, n_rows: int, n_chunks: int, device: torch.device,
                       group_size: int = 128) -> GemmTiles:
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    # K steps inside one group (one exact ±1 product per plane, scaled per row) when the groups allow.
    block_c = step_chunks(group_size, 4) or min(16 if INTERPRETED else 4, triton.next_power_of_2(n_chunks))
    if INTERPRETED:
        return GemmTiles(block_m=block_m, block_n=min(64, max(16, triton.next_power_of_2(n_rows))),
                         block_c=block_c, split_k=1)
    block_n = 64
    split = _split_for(triton.cdiv(n_rows, block_n) * triton.cdiv(tokens, block_m),
                       triton.cdiv(n_chunks, block_c), device)
    return GemmTiles(block_m=block_m, block_n=block_n, block_c=block_c, split_k=split, num_warps=4)


def _check_pow2(**sizes: int) -> None:
    for name, v in sizes.items():
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two, got {v}")


def _launch_gemv(x2, words, scales, offset, bits, group_size, tiles: GemvTiles):
    T, K = x2.shape
    _, N, NC = words.shape
    _check_pow2(block_n=tiles.block_n, block_c=tiles.block_c)
    y = torch.empty((T, N), dtype=x2.dtype, device=x2.device)
    grid_n = triton.cdiv(N, tiles.block_n)
    steps = triton.cdiv(NC, tiles.block_c)
    split = max(1, min(tiles.split_k, steps))
    chunks_per_split = triton.cdiv(steps, split) * tiles.block_c
    split = triton.cdiv(NC, chunks_per_split)  # no empty slices
    part = torch.empty((split, T, N), dtype=torch.float32, device=x2.device) if split > 1 else y
    counts = _counters(x2.device, grid_n * T) if split > 1 else y
    z = offset if offset is not None else scales
    _bcq_gemv_kernel[(grid_n, split, T)](
        x2, words, scales, z, y, part, counts,
        N, K, NC, group_size, chunks_per_split, T * N, split, 0x3F800000,
        x2.stride(0), words.stride(0), words.stride(1),
        scales.stride(0), scales.stride(1), scales.stride(2), z.stride(0), z.stride(1),
        BITS=bits, HAS_Z=offset is not None, SPLIT=split > 1, EVEN_K=K % 32 == 0,
        BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return y


def _launch_gemm(x2, words, scales, offset, bits, group_size, tiles: GemmTiles):
    M, K = x2.shape
    _, N, NC = words.shape
    _check_pow2(block_m=tiles.block_m, block_n=tiles.block_n, block_c=tiles.block_c)
    if min(tiles.block_m, tiles.block_n) < 16:
        raise ValueError(f"GEMM tiles: block_m and block_n must be >= 16 (tl.dot), got {tiles}")
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    grid_n, grid_m = triton.cdiv(N, tiles.block_n), triton.cdiv(M, tiles.block_m)
    steps = triton.cdiv(NC, tiles.block_c)
    split = max(1, min(tiles.split_k, steps))
    chunks_per_split = triton.cdiv(steps, split) * tiles.block_c
    split = triton.cdiv(NC, chunks_per_split)
    part = torch.empty((split, M, N), dtype=torch.float32, device=x2.device) if split > 1 else y
    counts = _counters(x2.device, grid_n * grid_m) if split > 1 else y
    z = offset if offset is not None else scales
    _bcq_gemm_kernel[(grid_n, grid_m, split)](
        x2, words, scales, z, y, part, counts,
        M, N, K, NC, group_size, chunks_per_split, M * N, split, 0x3F800000,
        x2.stride(0), words.stride(0), words.stride(1),
        scales.stride(0), scales.stride(1), scales.stride(2), z.stride(0), z.stride(1),
        BITS=bits, HAS_Z=offset is not None, ALIGNED=group_size % 32 == 0,
        STEP_IN_GROUP=group_size % (32 * tiles.block_c) == 0, SPLIT=split > 1,
        DOT_FP16=x2.dtype == torch.float16,
        INPUT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return y


def bitplane_gemm(
    x: torch.Tensor,
    planes: torch.Tensor,
    scales: torch.Tensor,
    offset: torch.Tensor | None = None,
    *,
    bits: int,
    group_size: int,
    path: Literal["auto", "gemv", "gemm"] = "auto",
    tiles: GemvTiles | GemmTiles | None = None,
) -> torch.Tensor:
    """``x @ W_bits.T`` for AnyBCQ's stored planes (see :mod:`kernels.bitplane_gemm.reference`).

    x: (..., in) fp32/fp16/bf16; planes: uint8 (max_bits, out, ceil(in / 8)) as stored (only
    ``planes[:bits]`` is read); scales: (out, groups, bits); offset: (out, groups) or None. Returns
    (..., out) in ``x.dtype``, accumulated in fp32. ``path``: ``gemv`` (at most a few tokens;
    ``group_size`` a multiple of 32), ``gemm`` (any), ``auto`` picks; ``tiles``: tile sizes for that
    path (default: :func:`default_gemv_tiles` / :func:`default_gemm_tiles`).

    >>> y = bitplane_gemm(x, t["w.planes"], t["w.scales.3"], t["w.offset.3"], bits=3, group_size=128)
    """
    rows, cols = check_inputs(x, planes, scales, offset, bits, group_size)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    tokens = x2.shape[0]
    if tokens == 0:
        return x.new_zeros((*lead, rows))
    nc = -(-cols // 32)
    words = as_words(planes[:bits], nc)
    scales, offset = scales.contiguous(), offset.contiguous() if offset is not None else None
    if path == "auto":
        path = "gemv" if tokens <= GEMV_MAX_TOKENS and group_size % 32 == 0 else "gemm"
    if path == "gemv":
        if group_size % 32:
            raise ValueError(f"path='gemv' needs group_size a multiple of 32, got {group_size} (use 'gemm')")
        t = tiles if isinstance(tiles, GemvTiles) else default_gemv_tiles(rows, nc, tokens, x.device)
        y = _launch_gemv(x2, words, scales, offset, bits, group_size, t)
    elif path == "gemm":
        t = tiles if isinstance(tiles, GemmTiles) else default_gemm_tiles(tokens, rows, nc, x.device, group_size)
        y = _launch_gemm(x2, words, scales, offset, bits, group_size, t)
    else:
        raise ValueError(f"path: expected 'auto', 'gemv' or 'gemm', got {path!r}")
    return y.reshape(*lead, rows)


__all__ = ["bitplane_gemm", "as_words", "GemvTiles", "GemmTiles", "default_gemv_tiles", "default_gemm_tiles",
           "n_groups", "INTERPRETED"]
