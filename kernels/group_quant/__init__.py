"""Per-group asymmetric integer quantization (round-to-nearest with a zero point), 2..8 bits.

>>> q, scale, zero = quantize(w, bits=4, group_size=32)      # w (rows, cols)
>>> w_hat = dequantize(q, scale, zero, group_size=32)        # (rows, cols) fp32, |w - w_hat| <= scale / 2

``quantize`` / ``dequantize`` dispatch on the tensor (see :mod:`kernels._dispatch`): compiled
Triton on CUDA, Triton's interpreter when asked, the fp32 torch reference otherwise. The
arithmetic is defined in :mod:`kernels.group_quant.reference`. ``pack_codes`` / ``unpack_codes``
(the on-disk bit packing) are plain torch and run on any device.
"""

from __future__ import annotations

import torch

from kernels._dispatch import implementation
from kernels.group_quant.reference import n_groups, pack_codes, packed_cols, unpack_codes

__all__ = ["quantize", "dequantize", "pack_codes", "unpack_codes", "packed_cols", "n_groups"]


def _impl(device: torch.device):
    return implementation("group_quant", device)


def quantize(
    w: torch.Tensor, *, bits: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` (rows, cols) per group of ``group_size`` columns to ``bits`` bits.

    Returns ``q`` uint8 (rows, cols), ``scale`` fp16 (rows, groups), ``zero`` fp16 (rows, groups)
    (integer-valued), ``groups = ceil(cols / group_size)``.
    """
    return _impl(w.device).quantize(w, bits=bits, group_size=group_size)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(q - zero) * scale`` per group: q uint8 (rows, cols), scale/zero (rows, groups) -> (rows, cols)."""
    return _impl(q.device).dequantize(q, scale, zero, group_size=group_size, dtype=dtype)
