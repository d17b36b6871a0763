"""WINA: weight-informed neuron activation, training-free activation sparsity.

Chen et al., 2025, "WINA: Weight Informed Neuron Activation for Accelerating Large Language Model
Inference" (public code: microsoft/wina). For a linear layer ``y = W x``, input channel ``i`` is
kept when its score ``|x_i| · ‖W[:, i]‖₂`` — the activation's magnitude times the norm of the
weight column it multiplies — is among the ``k = d · (1 − s)`` largest of the token. With
orthogonal columns this choice minimises ``‖W x − W s(x)‖`` exactly (the error is
``Σ_dropped x_i² ‖W[:, i]‖²``), which plain magnitude (TEAL) does not.

Everything else is TEAL's (:mod:`tasks.sparse.teal`): sites by glob on the linear layers' names,
``mode: topk`` (exact per token) or ``mode: threshold`` (per-site thresholds on the score,
calibrated as quantiles), ``allocation: uniform | greedy`` (TEAL's block-wise greedy allocation
to the model-wide level, which the paper adopts).

``norms`` chooses where the column norms enter:

* ``all`` (default, the paper): every site — q, k, v, o, gate, up and down projections;
* ``gate_k`` (the authors' public code): only ``gate_proj`` and ``k_proj`` use column norms, the
  other sites use ``|x_i|`` alone, i.e. TEAL.

**Not implemented:** the paper's optional orthogonalising transform of the weights (an SVD-based
rotation, folded into neighbouring layers through the RMSNorm, that makes each matrix's columns
orthogonal so the criterion above is exactly optimal). Without it WINA's criterion is the
column-norm-weighted heuristic on the model's own weights. The authors' code also never sparsifies
the first 1% of positions; here every position is treated alike, as in the paper's equations.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from tasks.sparse.registry import ActivationSparsity, register_sparsifier
from tasks.sparse.teal import MagnitudeConfig, magnitude_sparsity, teal_sites

ALL_LINEARS = ("*.self_attn.q_proj", "*.self_attn.k_proj", "*.self_attn.v_proj", "*.self_attn.o_proj",
               "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")
CODE_NORM_SITES = ("*.mlp.gate_proj", "*.self_attn.k_proj")
"""Where the authors' code uses column norms (``norms: gate_k``)."""


@dataclass(frozen=True, kw_only=True)
class WinaConfig(MagnitudeConfig):
    """WINA's fields: those of :class:`~tasks.sparse.teal.MagnitudeConfig` (``targets`` default to
    every linear of each block, as in the paper), and ``norms``: ``all`` (paper) or ``gate_k``
    (the authors' code: column norms for gate and k only)."""

    method: Literal["wina"] = "wina"
    targets: tuple[str, ...] = ALL_LINEARS
    norms: Literal["all", "gate_k"] = "all"


def column_norms(linear: nn.Linear) -> torch.Tensor:
    """‖W[:, i]‖₂ for each input channel ``i`` of ``linear`` (weight stored out × in), in fp32."""
    return linear.weight.detach().float().norm(dim=0)


def wina_scales(sites: dict[str, nn.Linear], norms: str) -> dict[str, torch.Tensor | None]:
    """Per-site channel scales: the column norms where ``norms`` uses them, else ``None`` (|x| alone)."""
    return {
        name: column_norms(mod) if norms == "all" or any(fnmatch.fnmatchcase(name, p) for p in CODE_NORM_SITES) else None
        for name, mod in sites.items()
    }


@register_sparsifier("wina", WinaConfig)
def wina(model: nn.Module, cfg: WinaConfig, *, sparsity: float,
         calib_tokens: np.ndarray | None = None) -> ActivationSparsity:
    """WINA at ``sparsity`` on ``cfg.targets``; see the module docstring. Calibration tokens are
    needed for ``mode: threshold`` and ``allocation: greedy``, as for TEAL."""
    scales = wina_scales(teal_sites(model, cfg.targets), cfg.norms)
    handle = magnitude_sparsity(model, cfg, sparsity=sparsity, calib_tokens=calib_tokens, scales=scales)
    handle.meta["norms"] = cfg.norms
    return handle
