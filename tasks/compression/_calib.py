"""Calibration plumbing shared by the methods that look at activations (GPTQ, NuBitQ, AnyBCQ).

``calibration_windows`` cuts the training-token stream into model inputs; ``input_statistics`` runs
them through a model and accumulates, per chosen ``nn.Linear``, the second moment of its inputs
(``H = X^T X / n``, the GPTQ Hessian up to a factor 2) or only its diagonal; ``decoder_blocks``
finds the repeated transformer blocks so methods can work block by block, each block seeing the
inputs produced by the already-quantized blocks before it (GPTQ's sequential order: Frantar et al.
2023, arXiv:2210.17323). No deviation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tasks.lm.windows import token_windows
from tasks.compression.rtn import quantized_linears

__all__ = ["quantized_linears", "calibration_windows", "model_seq_len", "decoder_blocks", "input_statistics", "by_block"]


def calibration_windows(calib_tokens: np.ndarray | torch.Tensor | None, seq_len: int, max_windows: int | None = None,
                        *, method: str) -> torch.Tensor:
    """Non-overlapping windows ``(n, seq_len)`` int64 from a 1-D token stream (or an (n, T) array).

    Raises ``ValueError`` naming ``method`` when there are no calibration tokens or too few for one window.
    """
    if calib_tokens is None:
        raise ValueError(f"{method} needs calibration tokens: set compression.calib_tokens > 0 in params/compression.yaml")
    windows = token_windows(calib_tokens, seq_len)
    if windows.shape[0] == 0 and np.ndim(calib_tokens) == 1:
        raise ValueError(f"{method}: {len(calib_tokens)} calibration tokens are fewer than one window of {seq_len}")
    return windows[:max_windows] if max_windows else windows


def model_seq_len(model: nn.Module, wanted: int) -> int:
    """``wanted`` capped at the model's position limit (``config.max_position_embeddings``)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(wanted, limit) if limit else wanted


def decoder_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The longest ``nn.ModuleList`` of the model (a transformers decoder's ``layers``), or None."""
    best = None
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and (best is None or len(mod) > len(best)):
            best = mod
    return best


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the modules of interest have run."""


@dataclass
class InputStats:
    """Per linear: ``hessian`` (in, in) fp32 mean of ``x x^T`` (or None), ``sq_mean`` (in,) mean of ``x**2``,
    ``n`` rows seen."""

    hessian: torch.Tensor | None
    sq_mean: torch.Tensor
    n: int


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def input_statistics(
    model: nn.Module,
    windows: torch.Tensor,
    modules: dict[str, nn.Linear],
    *,
    full: bool = True,
    batch_size: int = 8,
    stop_after: nn.Module | None = None,
) -> dict[str, InputStats]:
    """Run ``windows`` (n, T) through ``model`` and accumulate each module's input second moments.

    ``full``: keep the whole ``E[x x^T]`` (in x in), else only the diagonal ``E[x**2]``.
    ``stop_after``: end each forward pass once this module has run (the later blocks are not needed).
    """
    acc: dict[str, list] = {name: [None, torch.zeros(m.in_features, dtype=torch.float64), 0] for name, m in modules.items()}

    def hook_for(name: str):
        def hook(mod, args, out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            entry = acc[name]
            if full:
                xx = x.T @ x
                entry[0] = xx if entry[0] is None else entry[0] + xx
            entry[1] += (x * x).sum(0).cpu()
            entry[2] += x.shape[0]
        return hook

    def stop(mod, args, out):
        raise _Stop

    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    if stop_after is not None:
        handles.append(stop_after.register_forward_hook(stop))
    dev = _device(model)
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                try:
                    model(input_ids=windows[start : start + batch_size].to(dev), use_cache=False)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, (xx, sq, n) in acc.items():
        n = max(n, 1)
        out[name] = InputStats(hessian=(xx / n).float() if xx is not None else None, sq_mean=(sq / n).float(), n=n)
    return out


def by_block(model: nn.Module, targets: Iterable[tuple[str, nn.Linear]]) -> list[tuple[nn.Module | None, list[tuple[str, nn.Linear]]]]:
    """Group ``targets`` by the decoder block holding them, in block order; linears outside any block
    come last with block None (calibrated in one full pass)."""
    blocks = decoder_blocks(model)
    targets = list(targets)
    groups: list[tuple[nn.Module | None, list[tuple[str, nn.Linear]]]] = []
    seen: set[str] = set()
    if blocks is not None:
        for block in blocks:
            ids = {id(m) for m in block.modules()}
            members = [(n, m) for n, m in targets if id(m) in ids]
            if members:
                groups.append((block, members))
                seen.update(n for n, _ in members)
    rest = [(n, m) for n, m in targets if n not in seen]
    if rest:
        groups.append((None, rest))
    return groups
