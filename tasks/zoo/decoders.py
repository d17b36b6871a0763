"""How each compression method's stored tensors become a full state dict again (the decoders
:func:`tasks.zoo.compressed.load_compressed_model` calls), kept apart from the methods that choose
the codes, so a compressed file loads without the compression stage.

* ``rtn``, ``gptq`` — integer codes packed by :mod:`kernels.group_quant`, an fp16 scale and zero per
  group (GPTQ stores RTN's grouped format; :mod:`tasks.compression.gptq`);
* ``nubitq`` — a codebook per row / group / tensor indexed by packed codes, plus exact outliers in
  CSR (:mod:`tasks.compression.nubitq`);
* ``anybcq`` — binary-coded planes ``z + Σ_p α_p b_p`` per group, read up to the precision asked
  for (:mod:`tasks.compression.anybcq`).
The layouts are described in docs/compression.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kernels.group_quant import dequantize, packed_cols, unpack_codes
from kernels.group_quant.reference import n_groups

Scope = Literal["row", "group", "tensor"]
"""Where NuBitQ's codebooks live: one per row, per group of ``group_size`` columns, or one per tensor."""

DecodeFn = Callable[..., dict[str, torch.Tensor]]
"""``decode(tensors, meta, **options) -> state dict`` of one method's stored format; ``options`` such
as ``bits`` for a method whose one artifact serves several precisions; ``ValueError`` when malformed."""


def with_unquantized(state: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
                     meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`tasks.compression.packing.packed_model`'s tensors, once a decoder has put
    every quantized weight into ``state``: adds every stored tensor that is no quantized weight's part,
    then points each tied alias of ``meta["tied"]`` at its tensor again. Returns ``state``."""
    quantized = meta.get("quantized", {})
    for k, v in tensors.items():
        base = k.split(".weight.", 1)[0] + ".weight" if ".weight." in k else None
        if base is None or base not in quantized:
            state[k] = v
    for alias, target in meta.get("tied", {}).items():
        state[alias] = state[target]
    return state


def grouped_int_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Rebuild a full state dict from stored RTN or GPTQ tensors (one format: integer codes with an
    fp16 scale and zero per group), as :func:`tasks.zoo.compressed.load_compressed` returns them.

    Quantized weights are unpacked and dequantized to their original dtype; tied names point at the
    same tensor again. ``model.load_state_dict(grouped_int_state(...))`` reproduces the compressed model.
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
    return with_unquantized(state, tensors, meta)



@dataclass
class LayerCode:
    """One quantized weight at ``bits``: ``codes`` uint8 (rows, cols), ``codebook`` fp32 on the fp16 grid
    ((rows | rows*groups | 1), 2**bits), ``row_scale`` (rows,) or None."""

    bits: int
    codes: torch.Tensor
    codebook: torch.Tensor
    row_scale: torch.Tensor | None


def decode_layer(code: LayerCode, cols: int, scope: Scope, group_size: int) -> torch.Tensor:
    """``codebook[segment, code]`` (times the row scale) -> (rows, cols) fp32."""
    rows = code.codes.shape[0]
    q = code.codes.long()
    if scope == "row":
        return torch.gather(code.codebook, 1, q)
    if scope == "group":
        g = n_groups(cols, group_size)
        seg = torch.arange(rows)[:, None] * g + torch.arange(cols)[None, :] // group_size
        return code.codebook[seg, q]
    return code.codebook[0][q] * code.row_scale[:, None]


def from_csr(values: torch.Tensor, cols_idx: torch.Tensor, rowptr: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_csr`: ``(row indices, column indices)`` and values, checked against ``shape``."""
    rows, cols = shape
    if rowptr.shape != (rows + 1,) or int(rowptr[-1]) != values.numel() or values.numel() != cols_idx.numel():
        raise ValueError(f"outlier CSR: row pointers {tuple(rowptr.shape)}, {values.numel()} values and "
                         f"{cols_idx.numel()} columns do not describe a {rows}x{cols} matrix")
    r = torch.repeat_interleave(torch.arange(rows), (rowptr[1:] - rowptr[:-1]).long())
    c = cols_idx.long()
    if c.numel() and (int(c.min()) < 0 or int(c.max()) >= cols):
        raise ValueError(f"outlier CSR: a column index is outside 0..{cols - 1}")
    return r, c


def nubitq_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full state dict from stored NuBitQ tensors: codebook lookups, row scales, then the exact outliers."""
    state: dict[str, torch.Tensor] = {}
    quantized = meta.get("quantized", {})
    for key, spec in quantized.items():
        rows, cols = spec["shape"]
        bits, scope, gs = spec["bits"], spec["codebook"], spec["group_size"]
        if not (isinstance(bits, int) and 1 <= bits <= 8):
            raise ValueError(f"{key}: unknown bit width {bits!r} (NuBitQ stores 1..8)")
        packed = tensors[f"{key}.codes"]
        if tuple(packed.shape) != (rows, packed_cols(cols, bits)):
            raise ValueError(f"{key}.codes: shape {tuple(packed.shape)} does not match {spec}")
        segs = {"row": rows, "group": rows * n_groups(cols, gs), "tensor": 1}[scope]
        book = tensors[f"{key}.codebook"].float()
        if tuple(book.shape) != (segs, 2**bits):
            raise ValueError(f"{key}.codebook: shape {tuple(book.shape)}, expected {(segs, 2**bits)} for {spec}")
        code = LayerCode(bits=bits, codes=unpack_codes(packed, bits, cols), codebook=book,
                         row_scale=tensors[f"{key}.row_scale"].float() if scope == "tensor" else None)
        w = decode_layer(code, cols, scope, gs)
        if spec.get("outliers"):
            vals = tensors[f"{key}.outlier_values"]
            r, c = from_csr(vals, tensors[f"{key}.outlier_cols"], tensors[f"{key}.outlier_rowptr"], (rows, cols))
            w[r, c] = vals.float()
        state[key] = w.to(getattr(torch, spec["dtype"]))
    return with_unquantized(state, tensors, meta)


def unpack_planes(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_planes`: uint8 (P, rows, ceil(cols / 8)) -> float ±1 (P, rows, cols)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((packed[..., None] >> shifts) & 1).reshape(*packed.shape[:-1], -1)[..., :cols]
    return bits.float() * 2 - 1


def reconstruct_planes(planes: torch.Tensor, alpha: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """(k, rows, groups, gs) planes, (rows, groups, k) scales, (rows, groups) offset -> (rows, groups, gs)."""
    return z[..., None] + torch.einsum("prgs,rgp->rgs", planes, alpha)


def bcq_dequantize(planes: torch.Tensor, alpha: torch.Tensor, z: torch.Tensor, *, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``z + Σ_p α_p b_p`` per group: planes ±1 (k, rows, cols), alpha (rows, groups, k), z (rows, groups)."""
    k, rows, cols = planes.shape
    g = n_groups(cols, group_size)
    if alpha.shape != (rows, g, k) or z.shape != (rows, g):
        raise ValueError(f"scales: expected {(rows, g, k)} and offset {(rows, g)} for {k} planes of {(rows, cols)} "
                         f"in groups of {group_size}, got {tuple(alpha.shape)} and {tuple(z.shape)}")
    p = torch.nn.functional.pad(planes, (0, g * group_size - cols)).reshape(k, rows, g, group_size)
    return reconstruct_planes(p, alpha.float(), z.float()).reshape(rows, -1)[:, :cols].to(dtype)


def anybcq_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, bits: int | None = None) -> dict[str, torch.Tensor]:
    """Full state dict at precision ``bits`` (default: the artifact's ``bits``), reading planes ``1..bits`` only.

    Raises ``ValueError`` for a precision the artifact does not hold or a tensor of the wrong shape.
    """
    bits = meta.get("bits") if bits is None else bits
    available = sorted(int(k) for k in meta.get("precisions", {}))
    if bits not in available:
        raise ValueError(f"AnyBCQ artifact serves bits {available}, not {bits!r}")
    state: dict[str, torch.Tensor] = {}
    quantized = meta.get("quantized", {})
    for key, spec in quantized.items():
        rows, cols = spec["shape"]
        packed = tensors[f"{key}.planes"]
        if tuple(packed.shape) != (spec["max_bits"], rows, (cols + 7) // 8):
            raise ValueError(f"{key}.planes: shape {tuple(packed.shape)} does not match {spec}")
        planes = unpack_planes(packed[:bits], cols)
        alpha = tensors[f"{key}.scales.{bits}"]
        g = n_groups(cols, spec["group_size"])
        z = tensors[f"{key}.offset.{bits}"] if spec.get("offset") else torch.zeros(rows, g)
        state[key] = bcq_dequantize(planes, alpha, z, group_size=spec["group_size"], dtype=getattr(torch, spec["dtype"]))
    return with_unquantized(state, tensors, meta)



DECODERS: dict[str, DecodeFn] = {"rtn": grouped_int_state, "gptq": grouped_int_state,
                                 "nubitq": nubitq_state, "anybcq": anybcq_state}


def get_decoder(method: str) -> DecodeFn:
    """The decoder of ``method``'s stored format; ``KeyError`` listing the known ones."""
    try:
        return DECODERS[method]
    except KeyError:
        raise KeyError(f"no decoder for compression method {method!r}; known: {', '.join(sorted(DECODERS))}") from None
