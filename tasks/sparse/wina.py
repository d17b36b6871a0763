"""WINA: weight-informed neuron activation, training-free activation sparsity.

Follows Chen, Zhao, Ko, Banbury, Zhuang, Liang & Chen 2025, "WINA: Weight Informed Neuron Activation
for Accelerating Large Language Model Inference" (arXiv:2505.19427; code microsoft/wina): input
channel ``i`` of ``y = W x`` is kept when ``|x_i| · ‖W[:, i]‖₂`` is among the ``k = d · (1 − s)``
largest of the token, which minimises ``‖W x − W s(x)‖`` exactly when ``W``'s columns are orthogonal.
Everything else is TEAL's (:mod:`tasks.sparse.teal`): sites by glob, ``mode: topk | threshold``,
``allocation: uniform | greedy``.

Deviations, each a config field: ``norms: all`` (the paper: every site uses column norms) or
``gate_k`` (the authors' code: only ``gate_proj`` and ``k_proj``); ``transform`` (the paper's
orthogonalising rotation, :mod:`tasks.sparse.rotation`) is off by default so ``wina`` alone is the
criterion on the model's own weights, where the authors' scripts turn it on. The authors' code never
sparsifies the first 1% of positions; here every position is treated alike, as in the paper's
equations. Details: docs/sparse.md.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from tasks.common.patterns import matches_any
from tasks.sparse.registry import ActivationSparsity, register_sparsifier
from tasks.sparse.rotation import OrthogonalRotation
from tasks.sparse.teal import MagnitudeConfig, magnitude_sparsity, teal_sites

ALL_LINEARS = ("*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.self_attn.o_proj",
               "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")
CODE_NORM_SITES = ("*.mlp.gate_proj", "*.self_attn.k_proj")
"""Where the authors' code uses column norms (``norms: gate_k``)."""


@dataclass(frozen=True, kw_only=True)
class WinaConfig(MagnitudeConfig):
    """WINA's fields: those of :class:`~tasks.sparse.teal.MagnitudeConfig` (``targets`` default to
    every linear of each block, as in the paper), ``norms``: ``all`` (paper) or ``gate_k``
    (the authors' code: column norms for gate and k only), and ``transform``: apply the
    orthogonalising rotation (:mod:`tasks.sparse.rotation`)."""

    method: Literal["wina"] = "wina"
    targets: tuple[str, ...] = ALL_LINEARS
    norms: Literal["all", "gate_k"] = "all"
    transform: bool = False


def column_norms(linear: nn.Linear) -> torch.Tensor:
    """‖W[:, i]‖₂ for each input channel ``i`` of ``linear`` (weight stored out × in), in fp32."""
    return linear.weight.detach().float().norm(dim=0)


def wina_scales(sites: dict[str, nn.Linear], norms: str) -> dict[str, torch.Tensor | None]:
    """Per-site channel scales: the column norms where ``norms`` uses them, else ``None`` (|x| alone)."""
    return {
        name: column_norms(mod) if norms == "all" or matches_any(name, CODE_NORM_SITES) else None
        for name, mod in sites.items()
    }


@register_sparsifier("wina", WinaConfig)
def wina(model: nn.Module, cfg: WinaConfig, *, sparsity: float,
         calib_tokens: np.ndarray | None = None) -> ActivationSparsity:
    """WINA at ``sparsity`` on ``cfg.targets``; see the module docstring. Calibration tokens are
    needed for ``mode: threshold`` and ``allocation: greedy``, as for TEAL."""
    rotation = rotation_of(model) if cfg.transform else None
    with rotation if rotation is not None else contextlib.nullcontext():
        scales = wina_scales(teal_sites(model, cfg.targets), cfg.norms)
        handle = magnitude_sparsity(model, cfg, sparsity=sparsity, calib_tokens=calib_tokens, scales=scales)
    handle.around = rotation
    handle.meta["norms"] = cfg.norms
    handle.meta["transform"] = cfg.transform
    return handle


_ROTATIONS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, OrthogonalRotation]] = weakref.WeakKeyDictionary()


def rotation_of(model: nn.Module) -> OrthogonalRotation:
    """The model's :class:`OrthogonalRotation`, built once per set of weights, so a sweep's levels share
    it (and the greedy allocation, cached on the rotated weights, is searched once)."""
    key = tuple((p.data_ptr(), p._version) for p in model.parameters())
    cached = _ROTATIONS.get(model)
    if cached is None or cached[0] != key:
        cached = (key, OrthogonalRotation(model))
        _ROTATIONS[model] = cached
    return cached[1]
