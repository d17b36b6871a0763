"""The packing epilogue the weight quantizers share (RTN, GPTQ, NuBitQ, AnyBCQ).

Each quantizer chooses its codes its own way; what it then stores has one shape: the model's state
dict with tied tensors once (:func:`~tasks.zoo.compressed.unique_state`), each quantized weight
``<name>.weight`` replaced by its packed tensors ``<name>.weight.<part>``, and a ``meta`` holding the
method, its resolved config, the per-weight layout, the tie map, the base model's fingerprint, the
quantized parameter count and the stored bits per quantized weight. :class:`PackedWeights` collects
the per-weight part, :func:`packed_model` assembles the :class:`~tasks.zoo.compressed.CompressedModel`,
and :func:`tasks.zoo.decoders.with_unquantized` completes a decoded state dict on loading.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kernels.group_quant import pack_codes
from tasks.common.config import to_dict
from tasks.common.registry import MethodSpec
from tasks.zoo.compressed import CompressedModel, base_fingerprint


def refuse_tied(targets: Iterable[tuple[str, nn.Module]], tied: Mapping[str, str]) -> None:
    """``ValueError`` naming the first target whose weight is tied to another tensor (``tied`` as
    :func:`~tasks.zoo.compressed.unique_state` returns it): quantizing it would change both."""
    for name, _ in targets:
        key = f"{name}.weight"
        if key in tied or key in tied.values():
            aliases = sorted(a for a, b in tied.items() if key in (a, b))
            raise ValueError(
                f"{key} is tied to {aliases}; quantizing it would change the tied tensor too — "
                f"add {name!r} to skip"
            )


@dataclass
class PackedWeights:
    """The stored form of every quantized weight, in the order added.

    ``tensors``: ``<key>.<part>`` -> tensor; ``layout``: ``key`` -> ``{"shape", "dtype", **method's
    fields}``; ``stored_bits``: what the method counts as stored for these weights; ``n_params``:
    elements of the quantized weights.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: dict[str, dict[str, Any]] = field(default_factory=dict)
    stored_bits: int = 0
    n_params: int = 0

    def add(self, key: str, weight: torch.Tensor, parts: Mapping[str, torch.Tensor], layout: Mapping[str, Any],
            *, stored_bits: int = 0) -> None:
        """Store ``parts`` (``part`` -> tensor) for the weight ``key``; ``weight`` (the module's own,
        in its original dtype) gives the layout's ``shape`` and ``dtype``."""
        for part, tensor in parts.items():
            self.tensors[f"{key}.{part}"] = tensor
        self.layout[key] = {"shape": list(weight.shape), "dtype": str(weight.dtype).removeprefix("torch."), **layout}
        self.stored_bits += stored_bits
        self.n_params += weight.numel()

    def add_group_codes(self, key: str, weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        zero: torch.Tensor, *, bits: int, group_size: int, symmetric: bool) -> None:
        """Per-group integer codes in RTN's format (GPTQ stores the same): ``qweight`` (``q`` (rows, cols)
        uint8 bit-packed per row, :func:`kernels.group_quant.pack_codes`), ``scales`` and, unless
        ``symmetric``, ``zeros`` (fp16, (rows, groups)); counted as codes plus 16 bits per scale and zero."""
        packed = pack_codes(q, bits)
        parts = {"qweight": packed, "scales": scale} if symmetric else {"qweight": packed, "scales": scale, "zeros": zero}
        self.add(key, weight, parts, {"bits": bits, "group_size": group_size, "symmetric": symmetric},
                 stored_bits=8 * (packed.numel() + 2 * scale.numel() + (0 if symmetric else 2 * zero.numel())))

    @property
    def bits_per_weight(self) -> float | None:
        """``stored_bits / n_params``; None when nothing was quantized."""
        return self.stored_bits / self.n_params if self.n_params else None


def packed_model(base: nn.Module, qmodel: nn.Module, state: Mapping[str, torch.Tensor], tied: dict[str, str],
                 cfg: MethodSpec, packed: PackedWeights, **extra: Any) -> CompressedModel:
    """The artifact: ``qmodel`` (the quantized copy of ``base``), the tensors to store (``state``, the
    unique state of ``qmodel``, less the quantized weights, plus their packed parts) and ``meta``
    (method, config, ``quantized`` layout, ``tied``, ``base`` fingerprint, ``n_quantized_params``,
    ``bits_per_weight``, then ``extra``, which may replace ``bits_per_weight``)."""
    tensors = {k: v for k, v in state.items() if k not in packed.layout}
    tensors.update(packed.tensors)
    meta = {
        "method": cfg.method,
        "config": to_dict(cfg),
        "quantized": packed.layout,
        "tied": tied,
        "base": base_fingerprint(base),
        "n_quantized_params": packed.n_params,
        "bits_per_weight": packed.bits_per_weight,
        **extra,
    }
    return CompressedModel(model=qmodel, tensors=tensors, meta=meta)
