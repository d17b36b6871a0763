"""Round-to-nearest (RTN) per-group asymmetric weight quantization: the baseline every quantizer beats.

No paper of its own: the data-free baseline of GPTQ's paper (Frantar et al. 2023, arXiv:2210.17323).

For each selected ``nn.Linear`` weight ``W`` (out, in), each row is cut into groups of
``group_size`` input channels and quantized with its own scale and zero point (min/max of the group
widened to include 0; see :mod:`kernels.group_quant.reference` for the exact arithmetic)::

    W_hat[r, j] = (q[r, j] - zero[r, g(j)]) * scale[r, g(j)],   q in {0, ..., 2**bits - 1}

so ``|W - W_hat| <= scale / 2`` element-wise. No calibration data is used. On disk a quantized weight
is three tensors: ``<name>.qweight`` (codes bit-packed per row: two per byte at 4 bits),
``<name>.scales`` and ``<name>.zeros`` (fp16, (out, groups)); every other parameter is stored as is.

``symmetric: true`` fixes the zero point at ``2**(bits-1)`` (levels ``-2**(bits-1) .. 2**(bits-1)-1``
times ``scale = absmax / (2**(bits-1) - 1)``, largest value clipped to the top level on the
negative side only) and stores no zeros, saving 16 bits per group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from kernels.group_quant import dequantize, quantize
from tasks.common.config import at_least, require
from tasks.common.patterns import matches_any
from tasks.common.registry import MethodSpec
from kernels.group_quant.reference import FP16_MIN_NORMAL, n_groups
from tasks.compression.packing import PackedWeights, packed_model, refuse_tied
from tasks.compression.registry import register_method
from tasks.zoo.compressed import CompressedModel, unique_state


@dataclass(frozen=True, kw_only=True)
class RTNConfig(MethodSpec):
    """``bits``: 2..8. ``group_size``: input channels sharing a scale (the last group of a row may be
    shorter). ``skip``: glob patterns (``fnmatch``) on qualified module names of ``nn.Linear`` layers
    left in full precision; by default the output head (embeddings are not ``nn.Linear``)."""

    method: Literal["rtn"] = "rtn"
    bits: int = 4
    group_size: int = 128
    symmetric: bool = False
    skip: tuple[str, ...] = ("lm_head", "*.lm_head")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(2 <= self.bits <= 8, "bits", f"must be in 2..8, got {self.bits}")
        at_least(self.group_size, 1, "group_size")


def symmetric_quantize(w: torch.Tensor, *, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group symmetric RTN: ``(q uint8, scale fp16, zero fp16)`` with every zero ``2**(bits-1)``.

    ``scale = fp16_up(absmax / (2**(bits-1) - 1))``, so ``q - zero`` spans ``-2**(bits-1) .. 2**(bits-1)-1``
    and the same :func:`kernels.group_quant.dequantize` reads it.
    """
    rows, cols = w.shape
    g = n_groups(cols, group_size)
    x = torch.nn.functional.pad(w.float(), (0, g * group_size - cols)).reshape(rows, g, group_size)
    half = 2 ** (bits - 1)
    amax = x.abs().amax(dim=-1)
    scale = torch.clamp((amax / max(half - 1, 1) * (1 + 2.0**-10)).half().float(), min=FP16_MIN_NORMAL)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.floor(x / scale[..., None] + 0.5) + half, 0, 2 * half - 1)
    q = q.reshape(rows, -1)[:, :cols].to(torch.uint8)
    return q, scale.half(), torch.full_like(scale, float(half)).half()


def quantized_linears(model: nn.Module, skip: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """``(qualified name, module)`` of every ``nn.Linear`` whose name matches no ``skip`` pattern."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not matches_any(name, skip)
    ]


@register_method("rtn", RTNConfig)
def compress_rtn(model: nn.Module, cfg: RTNConfig, *, calib_tokens: np.ndarray | None = None) -> CompressedModel:
    """Quantize a copy of ``model`` with RTN (``calib_tokens`` is accepted and unused).

    Returns the copy with dequantized weights in place (original dtype), the tensors to store and
    ``meta`` with the layout of each quantized weight, ``n_quantized_params`` and
    ``bits_per_weight`` (codes plus fp16 scales and zeros, per quantized weight).
    """
    del calib_tokens  # RTN is data-free
    qmodel = copy.deepcopy(model)
    state, tied = unique_state(qmodel)
    targets = quantized_linears(qmodel, cfg.skip)
    refuse_tied(targets, tied)
    packed = PackedWeights()
    quant = symmetric_quantize if cfg.symmetric else quantize
    for name, mod in targets:
        w = mod.weight.detach()
        q, scale, zero = quant(w, bits=cfg.bits, group_size=cfg.group_size)
        with torch.no_grad():
            mod.weight.copy_(dequantize(q, scale, zero, group_size=cfg.group_size, dtype=w.dtype))
        packed.add_group_codes(f"{name}.weight", w, q, scale, zero, bits=cfg.bits, group_size=cfg.group_size,
                               symmetric=cfg.symmetric)
    return packed_model(model, qmodel, state, tied, cfg, packed)
