"""Per-group asymmetric integer quantization in plain fp32 torch: the definition the Triton kernel matches.

For each row of ``w`` and each group of ``group_size`` consecutive columns (the last group may be
shorter), with ``qmax = 2**bits - 1``::

    lo = min(min(w_g), 0)            hi = max(max(w_g), 0)        # 0 stays exactly representable
    scale = fp16_up((hi - lo) / qmax)                               # 1 where hi == lo (all-zero group)
    zero  = clamp(floor(-lo / scale + 0.5), 0, qmax)
    q     = clamp(floor(w / scale + 0.5) + zero, 0, qmax)           # uint8 codes
    w_hat = (q - zero) * scale

``fp16_up`` rounds the scale to the fp16 value just above it (``fp16(s * (1 + 2**-10))``, at least
``2**-14``, the smallest normal fp16), because scales are stored in fp16: dequantizing from the file
then gives exactly the in-memory weights, and ``scale >= (hi - lo) / qmax`` keeps the rounding-error
bound ``|w - w_hat| <= scale / 2`` for every element. Rounding is half-up (``floor(x + 0.5)``), the
same in the Triton kernel.

Also here: :func:`pack_codes` / :func:`unpack_codes`, the on-disk bit packing (plain torch on any device).
"""

from __future__ import annotations

import math

import torch

FP16_MIN_NORMAL = 2.0**-14
_SCALE_UP = 1.0 + 2.0**-10  # fp16 round-to-nearest is within 2**-11 relative: this lands at or above


def _check(w: torch.Tensor, bits: int, group_size: int) -> None:
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D (rows, cols) tensor, got shape {tuple(w.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits: expected 2..8, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")


def n_groups(cols: int, group_size: int) -> int:
    """Groups per row: ``ceil(cols / group_size)`` (the last one may be shorter)."""
    return math.ceil(cols / group_size)


def _grouped(w: torch.Tensor, group_size: int, fill: float) -> torch.Tensor:
    """(rows, cols) -> (rows, groups, group_size), the ragged tail padded with ``fill``."""
    rows, cols = w.shape
    g = n_groups(cols, group_size)
    pad = g * group_size - cols
    if pad:
        w = torch.nn.functional.pad(w, (0, pad), value=fill)
    return w.reshape(rows, g, group_size)


def quantize(
    w: torch.Tensor, *, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` (rows, cols) per group along cols.

    Returns ``q`` uint8 (rows, cols), ``scale`` fp16 (rows, groups), ``zero`` fp16 (rows, groups),
    with ``groups = ceil(cols / group_size)``; ``zero`` holds integers in ``[0, 2**bits - 1]``.
    """
    _check(w, bits, group_size)
    qmax = float(2**bits - 1)
    rows, cols = w.shape
    x = w.float()
    lo = torch.clamp(_grouped(x, group_size, math.inf).amin(dim=-1), max=0.0)
    hi = torch.clamp(_grouped(x, group_size, -math.inf).amax(dim=-1), min=0.0)
    scale = (hi - lo) / qmax
    scale = torch.clamp((scale * _SCALE_UP).half().float(), min=FP16_MIN_NORMAL)
    scale = torch.where(hi > lo, scale, torch.ones_like(scale))
    zero = torch.clamp(torch.floor(-lo / scale + 0.5), 0.0, qmax)
    xs = _grouped(x, group_size, 0.0)
    q = torch.clamp(torch.floor(xs / scale[..., None] + 0.5) + zero[..., None], 0.0, qmax)
    q = q.reshape(rows, -1)[:, :cols].to(torch.uint8)
    return q, scale.half(), zero.half()


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - zero) * scale`` per group: q uint8 (rows, cols), scale/zero (rows, groups) -> (rows, cols) ``dtype``."""
    if q.dim() != 2:
        raise ValueError(f"q: expected a 2-D (rows, cols) tensor, got shape {tuple(q.shape)}")
    rows, cols = q.shape
    g = n_groups(cols, group_size)
    if scale.shape != (rows, g) or zero.shape != (rows, g):
        raise ValueError(
            f"scale/zero: expected shape {(rows, g)} for q {tuple(q.shape)} and group_size {group_size}, "
            f"got {tuple(scale.shape)} and {tuple(zero.shape)}"
        )
    qs = _grouped(q.float(), group_size, 0.0)
    w = (qs - zero.float()[..., None]) * scale.float()[..., None]
    return w.reshape(rows, -1)[:, :cols].to(dtype)


def packed_cols(cols: int, bits: int) -> int:
    """Bytes per row once ``cols`` codes of ``bits`` bits are packed."""
    return math.ceil(cols * bits / 8)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (rows, cols) of ``bits`` bits into bytes (rows, ceil(cols * bits / 8)).

    Little-endian bit stream per row: code ``j`` occupies bits ``j*bits .. j*bits+bits-1``. For 4 bits
    that is two codes per byte, the even column in the low nibble; for 2 bits four per byte; for 8
    bits the codes themselves. Rows are packed separately so a row's bytes can be read on their own.
    """
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"q: expected uint8 (rows, cols), got {q.dtype} {tuple(q.shape)}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits: expected 1..8, got {bits}")
    if bits == 8:
        return q.contiguous()
    rows, cols = q.shape
    if bits == 4:  # the common case, without the bit-plane expansion
        qe = torch.nn.functional.pad(q, (0, cols % 2))
        return (qe[:, 0::2] | (qe[:, 1::2] << 4)).contiguous()
    shifts = torch.arange(bits, device=q.device, dtype=torch.uint8)
    planes = ((q[..., None] >> shifts) & 1).reshape(rows, cols * bits)
    nbytes = packed_cols(cols, bits)
    planes = torch.nn.functional.pad(planes, (0, nbytes * 8 - cols * bits)).reshape(rows, nbytes, 8)
    weights = (1 << torch.arange(8, device=q.device, dtype=torch.int32)).to(torch.uint8)
    return (planes * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes (rows, ceil(cols * bits / 8)) -> uint8 codes (rows, cols)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed: expected uint8 (rows, bytes), got {packed.dtype} {tuple(packed.shape)}")
    rows = packed.shape[0]
    if packed.shape[1] != packed_cols(cols, bits):
        raise ValueError(
            f"packed: expected {packed_cols(cols, bits)} bytes per row for {cols} codes of {bits} bits, "
            f"got {packed.shape[1]}"
        )
    if bits == 8:
        return packed.clone()
    if bits == 4:
        out = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(rows, -1)
        return out[:, :cols].contiguous()
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    planes = ((packed[..., None] >> shifts) & 1).reshape(rows, -1)[:, : cols * bits]
    planes = planes.reshape(rows, cols, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32)).to(torch.uint8)
    return (planes * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
