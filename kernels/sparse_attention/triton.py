"""Sparse prefill attention in Triton: the same results as :mod:`kernels.sparse_attention.reference`.

Flash-attention style (Dao et al., "FlashAttention"): one program computes a tile of ``BLOCK_M``
queries of one (batch, query head) within one query chunk / block, walking that chunk's key list in
tiles of ``BLOCK_N`` keys with an online softmax — running row max ``m``, denominator ``l`` and
output accumulator in fp32, ``acc ← acc · 2^(m_old - m_new) + P V`` — so nothing of size
(queries × keys) is stored. Scores are computed in the log2 domain (``exp2`` with ``scaling · log2 e``).

* :func:`gathered_attention` (QuoKA): a key tile is ``BLOCK_N`` entries of the list, read as indices
  and gathered row by row from K and V; padding (-1) and keys after every query of the tile are
  masked, and a tile with no key at or before the tile's last query is skipped.
* :func:`block_sparse_attention` (ProxyAttn): the program walks the listed block indices one at a
  time; a padding entry or a block starting after the tile's last query is skipped, and a listed
  block is read as contiguous key tiles.

The head dimension is padded to a power of two >= 16 (``tl.dot``'s minimum) with masked loads, so
8, 80 or 96 work. ``tl.dot`` runs on fp32 operands for fp32 inputs (IEEE precision, not TF32) and
always in the interpreter, whose bf16 ``tl.dot`` is wrong (triton-lang/triton#11584); compiled fp16 /
bf16 inputs use the tensor cores in their own dtype, accumulating in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.sparse_attention.reference import _check

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(qk, allowed, m_i, l_i, acc, v, FP32_DOT: tl.constexpr):
    """Fold one tile of log2-domain scores ``qk`` (BLOCK_M, BLOCK_N) into the running (m, l, acc)."""
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing allowed so far keeps m = -inf; subtracting 0 instead keeps exp2 finite (0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_DOT:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _gathered_attention_kernel(
    q_ptr, k_ptr, v_ptr, keys_ptr, mask_ptr, o_ptr,
    HQ, NQ, N, D, M, CHUNK, GROUPS, LIST_DIV, TILES_PER_CHUNK,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_lb, stride_lh, stride_lc, stride_lm,
    stride_mb, stride_mt, stride_mn,
    stride_ob, stride_oh, stride_ot, stride_od,
    qk_scale,
    HAS_MASK: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    chunk = pid // TILES_PER_CHUNK
    row0 = chunk * CHUNK + (pid % TILES_PER_CHUNK) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_hi = tl.minimum((chunk + 1) * CHUNK, NQ)
    row_ok = rows < row_hi
    qpos = N - NQ + rows  # absolute positions of the tile's queries
    q_last = N - NQ + tl.minimum(row0 + BLOCK_M, row_hi) - 1
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D

    q = tl.load(
        q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qt + dd[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    kvh = (h // GROUPS).to(tl.int64)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    l_base = keys_ptr + b * stride_lb + (h // LIST_DIV).to(tl.int64) * stride_lh + chunk.to(tl.int64) * stride_lc

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j0 in range(0, M, BLOCK_N):
        jj = j0 + tl.arange(0, BLOCK_N)
        idx = tl.load(l_base + jj * stride_lm, mask=jj < M, other=-1).to(tl.int64)
        valid = idx >= 0
        first = tl.min(tl.where(valid, idx, N), 0)
        if first <= q_last:  # a tile of padding or of keys after every query here costs no K/V reads
            kv_ok = valid[:, None] & d_ok[None, :]
            kt = tl.load(k_base + idx[None, :] * stride_kn + dd[:, None] * stride_kd,
                         mask=valid[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
            v = tl.load(v_base + idx[:, None] * stride_vn + dd[None, :] * stride_vd, mask=kv_ok, other=0.0)
            if FP32_DOT:
                qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                qk = tl.dot(q, kt)
            qk = qk * qk_scale
            allowed = valid[None, :] & (idx[None, :] <= qpos[:, None])
            if HAS_MASK:
                add = tl.load(mask_ptr + b * stride_mb + rows[:, None].to(tl.int64) * stride_mt + idx[None, :] * stride_mn,
                              mask=allowed & row_ok[:, None], other=0.0)
                qk += add.to(tl.float32) * 1.4426950408889634
            m_i, l_i, acc = _online_softmax_step(qk, allowed, m_i, l_i, acc, v, FP32_DOT)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # no allowed key: acc is 0, so is the output
    tl.store(
        o_ptr + b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None].to(tl.int64) * stride_ot + dd[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def _block_sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, blocks_ptr, mask_ptr, o_ptr,
    HQ, NQ, N, D, M, BLOCK_SIZE, GROUPS, LIST_DIV, TILES_PER_BLOCK,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_lb, stride_lh, stride_lc, stride_lm,
    stride_mb, stride_mt, stride_mn,
    stride_ob, stride_oh, stride_ot, stride_od,
    qk_scale,
    HAS_MASK: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    b = (bh // HQ).to(tl.int64)
    h = bh % HQ
    qblock = pid // TILES_PER_BLOCK
    row0 = qblock * BLOCK_SIZE + (pid % TILES_PER_BLOCK) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_hi = tl.minimum((qblock + 1) * BLOCK_SIZE, NQ)
    row_ok = rows < row_hi
    qpos = N - NQ + rows
    q_last = N - NQ + tl.minimum(row0 + BLOCK_M, row_hi) - 1
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D

    q = tl.load(
        q_ptr + b * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qt + dd[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    kvh = (h // GROUPS).to(tl.int64)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    l_base = blocks_ptr + b * stride_lb + (h // LIST_DIV).to(tl.int64) * stride_lh + qblock.to(tl.int64) * stride_lc

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(0, M):
        blk = tl.load(l_base + j * stride_lm).to(tl.int64)
        start = blk * BLOCK_SIZE
        if (blk >= 0) & (start <= q_last):  # padding, or a block wholly after this tile's queries
            for u0 in range(0, BLOCK_SIZE, BLOCK_N):
                uu = u0 + tl.arange(0, BLOCK_N)
                pos = start + uu
                valid = (uu < BLOCK_SIZE) & (pos < N)
                kt = tl.load(k_base + pos[None, :] * stride_kn + dd[:, None] * stride_kd,
                             mask=valid[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
                v = tl.load(v_base + pos[:, None] * stride_vn + dd[None, :] * stride_vd,
                            mask=valid[:, None] & d_ok[None, :], other=0.0)
                if FP32_DOT:
                    qk = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
                else:
                    qk = tl.dot(q, kt)
                qk = qk * qk_scale
                allowed = valid[None, :] & (pos[None, :] <= qpos[:, None])
                if HAS_MASK:
                    add = tl.load(mask_ptr + b * stride_mb + rows[:, None].to(tl.int64) * stride_mt + pos[None, :] * stride_mn,
                                  mask=allowed & row_ok[:, None], other=0.0)
                    qk += add.to(tl.float32) * 1.4426950408889634
                m_i, l_i, acc = _online_softmax_step(qk, allowed, m_i, l_i, acc, v, FP32_DOT)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + b * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None].to(tl.int64) * stride_ot + dd[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def _pow2_at_least_16(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _tiles(group: int, d: int, block_m: int | None, block_n: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): query tile within a chunk / block, key tile, padded head dim."""
    block_d = _pow2_at_least_16(d)
    if block_m is None:
        # The interpreter pays per program and per loop step, not per element: larger tiles there.
        block_m = min(64 if INTERPRETED or block_d > 128 else 128, _pow2_at_least_16(group))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    for name, t in (("block_m", block_m), ("block_n", block_n)):
        if t < 16 or t & (t - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {t}")
    return block_m, block_n, block_d


def _launch(kernel, q, k, v, lists, mask, group: int, scaling: float, block_m: int | None,
            block_n: int | None) -> torch.Tensor:
    """Grid (b · hq, groups of queries · query tiles per group); ``group`` is chunk_size or block_size."""
    b, hq, nq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    o = torch.empty((b, hq, nq, d), dtype=q.dtype, device=q.device)
    if o.numel() == 0:
        return o
    bm, bn, bd = _tiles(group, d, block_m, block_n)
    tiles_per_group = triton.cdiv(min(group, nq), bm)
    n_groups = lists.shape[2]
    fp32_dot = INTERPRETED or q.dtype == torch.float32
    mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3)) if mask is not None else (0, 0, 0)
    grid = (b * hq, n_groups * tiles_per_group)
    kernel[grid](
        q, k, v, lists, mask if mask is not None else q, o,
        hq, nq, n, d, lists.shape[3], group, hq // hkv, hq // lists.shape[1], tiles_per_group,
        *q.stride(), *k.stride(), *v.stride(), *lists.stride(), *mask_strides, *o.stride(),
        float(scaling) * LOG2E,
        HAS_MASK=mask is not None, FP32_DOT=fp32_dot,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd,
        num_warps=8 if bm * bd >= 128 * 128 else 4,
        num_stages=2,
    )
    return o


def gathered_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    *,
    chunk_size: int,
    scaling: float,
    mask: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each query chunk over its own list of key positions (QuoKA's gathered KV subset).

    q (b, hq, nq, d): the last nq of the n positions of k, v (b, hkv, n, d); hq a multiple of hkv
    (GQA). keys (b, hs, ceil(nq / chunk_size), m) integer positions, hs == hkv or hq, -1 padded,
    unsorted allowed, no duplicates; causal; mask: optional additive (b, 1, nq, n). Returns
    (b, hq, nq, d) in q.dtype; a query with no allowed key gives zeros (see the reference for the
    full definition). Any strides. ``block_m`` / ``block_n``: query and key tile sizes, powers of two
    >= 16 (defaults: the chunk size rounded up, at most 128 (64 interpreted); 64 keys).
    """
    _check(q, k, v, keys, chunk_size, mask, lists_name="keys", size_name="chunk_size")
    return _launch(_gathered_attention_kernel, q, k, v, keys, mask, chunk_size, scaling, block_m, block_n)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_size: int,
    scaling: float,
    mask: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of each query block over the keys of its listed key blocks (ProxyAttn's block-sparse attention).

    q (b, hq, nq, d), k, v (b, hkv, n, d) as in :func:`gathered_attention`. blocks
    (b, hs, ceil(nq / block_size), m) integer key-block indices (block j = positions
    [j*block_size, (j+1)*block_size) ∩ [0, n)), hs == hkv or hq, -1 padded, any order, no duplicates;
    causal; mask: optional additive (b, 1, nq, n). Returns (b, hq, nq, d) in q.dtype.
    ``block_m`` / ``block_n``: query tile and key sub-tile of a listed block, powers of two >= 16
    (defaults: the block size rounded up, at most 128 (64 interpreted); 64).
    """
    _check(q, k, v, blocks, block_size, mask, lists_name="blocks", size_name="block_size")
    if block_n is None:  # a key tile need not exceed the block it walks
        block_n = min(64, _pow2_at_least_16(block_size))
    return _launch(_block_sparse_attention_kernel, q, k, v, blocks, mask, block_size, scaling, block_m, block_n)
