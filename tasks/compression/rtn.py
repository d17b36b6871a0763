"""Round-to-nearest (RTN) per-group asymmetric weight quantization: the baseline every quantizer beats.

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
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from kernels.group_quant import dequantize, pack_codes, packed_cols, quantize, unpack_codes
from tasks.common.config import require, to_dict
from tasks.common.patterns import matches_any
from tasks.common.registry import MethodSpec
from kernels.group_quant.reference import FP16_MIN_NORMAL, n_groups
from tasks.compression.registry import (
    CompressedModel,
    base_fingerprint,
    register_dequantizer,
    register_method,
    unique_state,
)


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
        require(self.group_size >= 1, "group_size", f"must be >= 1, got {self.group_size}")


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
    layout: dict[str, dict[str, Any]] = {}
    quantized: dict[str, torch.Tensor] = {}
    stored_bits = 0
    n_quantized = 0
    for name, mod in targets:
        key = f"{name}.weight"
        if key in tied or key in tied.values():
            aliases = sorted(a for a, b in tied.items() if key in (a, b))
            raise ValueError(
                f"{key} is tied to {aliases}; quantizing it would change the tied tensor too — "
                f"add {name!r} to skip"
            )
        w = mod.weight.detach()
        quant = symmetric_quantize if cfg.symmetric else quantize
        q, scale, zero = quant(w, bits=cfg.bits, group_size=cfg.group_size)
        with torch.no_grad():
            mod.weight.copy_(dequantize(q, scale, zero, group_size=cfg.group_size, dtype=w.dtype))
        packed = pack_codes(q, cfg.bits)
        quantized[f"{key}.qweight"] = packed
        quantized[f"{key}.scales"] = scale
        if not cfg.symmetric:
            quantized[f"{key}.zeros"] = zero
        layout[key] = {"shape": list(w.shape), "dtype": str(w.dtype).removeprefix("torch."),
                       "bits": cfg.bits, "group_size": cfg.group_size, "symmetric": cfg.symmetric}
        stored_bits += 8 * (packed.numel() + 2 * scale.numel() + (0 if cfg.symmetric else 2 * zero.numel()))
        n_quantized += w.numel()
    tensors = {k: v for k, v in state.items() if k not in layout}
    tensors.update(quantized)
    meta = {
        "method": cfg.method,
        "config": to_dict(cfg),
        "quantized": layout,
        "tied": tied,
        "base": base_fingerprint(model),
        "n_quantized_params": n_quantized,
        "bits_per_weight": stored_bits / n_quantized if n_quantized else None,
    }
    return CompressedModel(model=qmodel, tensors=tensors, meta=meta)


@register_dequantizer("rtn")
def dequantized_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rebuild a full state dict from stored RTN tensors (as :func:`load_compressed` returns them).

    Quantized weights are unpacked and dequantized to their original dtype; tied names point at the
    same tensor again. ``model.load_state_dict(dequantized_state(...))`` reproduces the compressed model.
    """
    state: dict[str, torch.Tensor] = {}
    quantized = meta.get("quantized", {})
    for key, spec in quantized.items():
        rows, cols = spec["shape"]
        bits, group_size = spec["bits"], spec["group_size"]
        if not (isinstance(bits, int) and 2 <= bits <= 8):
            raise ValueError(f"{key}: unknown bit width {bits!r} (RTN stores 2..8)")
        packed = tensors[f"{key}.qweight"]
        if tuple(packed.shape) != (rows, packed_cols(cols, bits)):
            raise ValueError(f"{key}.qweight: shape {tuple(packed.shape)} does not match {spec}")
        q = unpack_codes(packed, bits, cols)
        dtype = getattr(torch, spec["dtype"])
        scales = tensors[f"{key}.scales"]
        if spec.get("symmetric"):
            zeros = torch.full_like(scales, float(2 ** (bits - 1)))
        else:
            zeros = tensors[f"{key}.zeros"]
        state[key] = dequantize(q, scales, zeros, group_size=group_size, dtype=dtype)
    suffixes = (".qweight", ".scales", ".zeros")
    for k, v in tensors.items():
        if not (k.endswith(suffixes) and k.rsplit(".", 1)[0] in quantized):
            state[k] = v
    for alias, target in meta.get("tied", {}).items():
        state[alias] = state[target]
    return state
