"""TEAL: training-free activation sparsity by magnitude, before the linear layers of the MLP.

Liu et al., 2024, "Training-Free Activation Sparsity in Large Language Models" (TEAL). The input
``x`` of a linear layer is sparsified as ``s_t(x)_i = x_i * 1[|x_i| >= t]`` so the product
``W s_t(x)`` reads only the weight columns of surviving channels (:mod:`kernels.sparse_gemv`).
Two ways of choosing what survives:

* ``mode: topk`` — per token, keep the ``d - round(s * d)`` largest-magnitude channels of the ``d``
  input channels: achieved sparsity is exactly ``round(s * d) / d`` for every token. This is the
  oracle form (it needs a top-k per token, which a decoding kernel avoids).
* ``mode: threshold`` — the paper's deployable form: one threshold per site, the ``s``-quantile of
  ``|x|`` over calibration tokens (TEAL fits thresholds from calibration distributions of hidden
  states, which are zero-mean and unimodal — Gaussian before attention/MLP, Laplacian for the
  intermediate states). Achieved sparsity on other text is close to, not exactly, ``s``.

Sites: the ``nn.Linear`` layers whose names match ``targets`` (default: the MLP's ``gate_proj``,
``up_proj`` — which share one input — and ``down_proj``). Each gets the same level ``s``: uniform
allocation. **Not yet:** TEAL's greedy per-layer allocation (raise, step by step, the sparsity of
the block whose increase costs least in output error until the model-level average is reached);
``allocation`` only admits ``uniform`` until that is written. Attention projections are not in
this issue's scope but are reachable by adding their names (``*.self_attn.q_proj`` ...) to ``targets``.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from tasks.common.config import require
from tasks.sparse.registry import ActivationSparsity, SparseMethodSpec, register_sparsifier


@dataclass(frozen=True, kw_only=True)
class TealConfig(SparseMethodSpec):
    """``mode``: ``topk`` (exact per token) or ``threshold`` (per-site calibrated thresholds).
    ``targets``: glob patterns on qualified ``nn.Linear`` names whose inputs are sparsified.
    ``calib_seq_len``/``calib_batch_size``: windows for the calibration forward passes.
    ``max_calib_values``: |x| samples kept per site for the quantile (uniform random subsample).
    ``allocation``: per-site levels; only ``uniform`` (greedy allocation is not written yet).
    """

    method: Literal["teal"] = "teal"
    mode: Literal["topk", "threshold"] = "topk"
    targets: tuple[str, ...] = ("*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")
    allocation: Literal["uniform"] = "uniform"
    calib_seq_len: int = 128
    calib_batch_size: int = 8
    max_calib_values: int = 1_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.targets) > 0, "targets", "needs at least one pattern")
        require(self.calib_seq_len >= 1, "calib_seq_len", f"must be >= 1, got {self.calib_seq_len}")
        require(self.calib_batch_size >= 1, "calib_batch_size", f"must be >= 1, got {self.calib_batch_size}")
        require(self.max_calib_values >= 1000, "max_calib_values", f"must be >= 1000, got {self.max_calib_values}")


def topk_sparsify(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Zero the ``round(sparsity * d)`` smallest-magnitude entries of each row of ``x`` (..., d).

    Returns a new tensor (``x`` itself when nothing is dropped). Ties are broken by ``torch.topk``,
    so every row has exactly that many entries zeroed (more where ``x`` already had zeros kept).
    """
    d = x.shape[-1]
    n_drop = math.floor(sparsity * d + 0.5)
    if n_drop <= 0:
        return x
    idx = torch.topk(x.abs(), n_drop, dim=-1, largest=False, sorted=False).indices
    return x.scatter(-1, idx, 0)


def threshold_sparsify(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """TEAL's ``s_t(x) = x * 1[|x| >= t]`` (``t = 0`` returns ``x``)."""
    if threshold <= 0:
        return x
    return torch.where(x.abs() >= threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))


def teal_sites(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules whose qualified names match a ``targets`` pattern, in model order."""
    sites = {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in targets)
    }
    if not sites:
        raise ValueError(f"targets {list(targets)} match no nn.Linear of {type(model).__name__}")
    return sites


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def calibrate_thresholds(
    model: nn.Module, sites: dict[str, nn.Linear], calib_tokens: np.ndarray, cfg: TealConfig,
    sparsities: tuple[float, ...],
) -> dict[float, dict[str, float]]:
    """Per-site thresholds for each level: ``{s: {site: t}}`` with ``t`` the ``s``-quantile of ``|x|``.

    Runs the dense model over ``calib_tokens`` in windows of ``cfg.calib_seq_len`` and keeps a
    uniform random subsample of at most ``cfg.max_calib_values`` input magnitudes per site. Sites
    sharing an input (gate/up) see the same samples, so they get the same threshold.
    """
    seq = cfg.calib_seq_len
    n_windows = len(calib_tokens) // seq
    if n_windows == 0:
        raise ValueError(f"calib_tokens: need at least calib_seq_len={seq} tokens, got {len(calib_tokens)}")
    windows = torch.from_numpy(np.asarray(calib_tokens[: n_windows * seq], dtype=np.int64)).view(n_windows, seq)
    n_batches = math.ceil(n_windows / cfg.calib_batch_size)
    per_batch = math.ceil(cfg.max_calib_values / n_batches)
    samples: dict[str, list[torch.Tensor]] = {n: [] for n in sites}
    gens: dict[str, torch.Generator] = {}

    def collector(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            a = args[0].detach().abs().flatten().float()
            if a.numel() > per_batch:
                g = gens.setdefault(name, torch.Generator(device="cpu").manual_seed(cfg.seed))
                a = a[torch.randint(a.numel(), (per_batch,), generator=g).to(a.device)]
            samples[name].append(a.cpu())

        return hook

    handles = [m.register_forward_pre_hook(collector(n)) for n, m in sites.items()]
    was_training = model.training
    model.eval()
    try:
        device = _device(model)
        for i in range(0, n_windows, cfg.calib_batch_size):
            model(input_ids=windows[i : i + cfg.calib_batch_size].to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out: dict[float, dict[str, float]] = {}
    sorted_samples = {n: torch.sort(torch.cat(v)).values for n, v in samples.items()}
    for s in sparsities:
        # t = the floor(s*n)-th smallest |x|: a fraction ~s of samples lies strictly below it.
        out[s] = {
            n: (0.0 if s <= 0 else float(v[min(len(v) - 1, math.floor(s * len(v)))]))
            for n, v in sorted_samples.items()
        }
    return out


@register_sparsifier("teal", TealConfig)
def teal(model: nn.Module, cfg: TealConfig, *, sparsity: float,
         calib_tokens: np.ndarray | None = None) -> ActivationSparsity:
    """TEAL at ``sparsity`` on ``cfg.targets``: a handle whose hooks sparsify each site's input.

    ``mode: topk`` needs no data. ``mode: threshold`` calibrates per-site thresholds on
    ``calib_tokens`` (required) with the dense model before returning. The handle's
    ``meta["thresholds"]`` holds them (threshold mode); ``achieved_sparsity()`` reports the
    fraction of zeroed inputs once the model has run inside ``with handle:``.
    """
    require(0.0 <= sparsity < 1.0, "sparsity", f"must be in [0, 1), got {sparsity}")
    sites = teal_sites(model, cfg.targets)
    meta: dict = {"method": "teal", "mode": cfg.mode, "sparsity": sparsity, "allocation": cfg.allocation}
    if cfg.mode == "topk":
        fns = {n: (m, lambda x, s=sparsity: topk_sparsify(x, s)) for n, m in sites.items()}
    else:
        if calib_tokens is None:
            raise ValueError("TEAL threshold mode needs calib_tokens to fit its thresholds")
        thresholds = calibrate_thresholds(model, sites, calib_tokens, cfg, (sparsity,))[sparsity]
        meta["thresholds"] = thresholds
        fns = {n: (m, lambda x, t=thresholds[n]: threshold_sparsify(x, t)) for n, m in sites.items()}
    return ActivationSparsity(model, fns, meta=meta)
