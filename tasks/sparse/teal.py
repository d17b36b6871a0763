"""TEAL: training-free activation sparsity by magnitude, before the linear layers of the MLP.

Liu, Ponnusamy, Cai, Guo, Kim & Athiwaratkun 2024, "Training-Free Activation Sparsity in Large Language
Models" (TEAL, arXiv:2408.14690). The input
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
``up_proj`` — which share one input — and ``down_proj``; add ``*.self_attn.*_proj`` for TEAL's
full set). ``allocation: uniform`` gives every site the level ``s``; ``allocation: greedy`` is TEAL's
block-wise greedy search (:mod:`tasks.sparse.allocation`): per block, the site whose next step
costs least block-output error is raised until the block's weight-weighted sparsity is ``s``.

The same machinery scores channels by ``|x_i| · c_i`` for a per-channel scale ``c`` when one is
given (:mod:`tasks.sparse.wina`); TEAL is ``c = 1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tasks.common.config import at_least, require
from tasks.common.patterns import matches_any
from tasks.lm.windows import token_windows
from tasks.sparse.allocation import greedy_path
from tasks.sparse.registry import ActivationSparsity, SparseMethodSpec, register_sparsifier


@dataclass(frozen=True, kw_only=True)
class MagnitudeConfig(SparseMethodSpec):
    """What TEAL and WINA share. ``mode``: ``topk`` (exact per token) or ``threshold`` (per-site
    calibrated thresholds). ``targets``: glob patterns on qualified ``nn.Linear`` names whose inputs
    are sparsified. ``allocation``: ``uniform`` (every site at the level) or ``greedy`` (TEAL's
    block-wise search; needs calibration tokens in either mode). ``greedy_step`` /
    ``greedy_last_fraction`` / ``greedy_max_level`` / ``greedy_windows``: the search's step
    (TEAL: 0.05), the share of each window's last positions its error counts (TEAL: 0.25), the
    highest level one site may reach, and how many calibration windows it runs on.
    ``calib_seq_len``/``calib_batch_size``: windows for the calibration forward passes.
    ``max_calib_values``: scores sampled per site for the quantiles (uniform random subsample).
    """

    mode: Literal["topk", "threshold"] = "topk"
    targets: tuple[str, ...] = ("*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")
    allocation: Literal["uniform", "greedy"] = "uniform"
    greedy_step: float = 0.05
    greedy_last_fraction: float = 0.25
    greedy_max_level: float = 0.95
    greedy_windows: int = 2
    calib_seq_len: int = 128
    calib_batch_size: int = 8
    max_calib_values: int = 1_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.targets) > 0, "targets", "needs at least one pattern")
        require(0.0 < self.greedy_step <= 0.5, "greedy_step", f"must be in (0, 0.5], got {self.greedy_step}")
        require(0.0 < self.greedy_last_fraction <= 1.0, "greedy_last_fraction",
                f"must be in (0, 1], got {self.greedy_last_fraction}")
        require(max(self.sparsities) < self.greedy_max_level < 1.0, "greedy_max_level",
                f"must lie between the highest sparsity ({max(self.sparsities)}) and 1, got {self.greedy_max_level}")
        at_least(self.greedy_windows, 1, "greedy_windows")
        at_least(self.calib_seq_len, 1, "calib_seq_len")
        at_least(self.calib_batch_size, 1, "calib_batch_size")
        at_least(self.max_calib_values, 1000, "max_calib_values")


@dataclass(frozen=True, kw_only=True)
class TealConfig(MagnitudeConfig):
    """TEAL: the magnitude ``|x_i|`` decides (see :class:`MagnitudeConfig` for the fields)."""

    method: Literal["teal"] = "teal"


def _scores(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    a = x.abs()
    return a if scale is None else a * scale.to(a.dtype)


def topk_sparsify(x: torch.Tensor, sparsity: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Zero the ``round(sparsity * d)`` lowest-scoring entries of each row of ``x`` (..., d).

    The score of channel ``i`` is ``|x_i|``, times ``scale[i]`` when a per-channel ``scale`` (d,) is
    given. Returns a new tensor (``x`` itself when nothing is dropped). Ties are broken by
    ``torch.topk``, so every row has exactly that many entries zeroed.
    """
    d = x.shape[-1]
    n_drop = math.floor(sparsity * d + 0.5)
    if n_drop <= 0:
        return x
    idx = torch.topk(_scores(x, scale), n_drop, dim=-1, largest=False, sorted=False).indices
    return x.scatter(-1, idx, 0)


def threshold_sparsify(x: torch.Tensor, threshold: float, scale: torch.Tensor | None = None) -> torch.Tensor:
    """TEAL's ``s_t(x) = x * 1[|x| >= t]`` (score ``|x| * scale`` when given; ``t = 0`` returns ``x``)."""
    if threshold <= 0:
        return x
    return torch.where(_scores(x, scale) >= threshold, x, torch.zeros((), dtype=x.dtype, device=x.device))


def teal_sites(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules whose qualified names match a ``targets`` pattern, in model order."""
    sites = {
        name: mod
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and matches_any(name, targets)
    }
    if not sites:
        raise ValueError(f"targets {list(targets)} match no nn.Linear of {type(model).__name__}")
    return sites


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def calib_windows(calib_tokens: np.ndarray, seq: int) -> torch.Tensor:
    """``calib_tokens`` cut into windows of ``seq`` tokens, (n_windows, seq)."""
    if len(calib_tokens) < seq:
        raise ValueError(f"calib_tokens: need at least calib_seq_len={seq} tokens, got {len(calib_tokens)}")
    return token_windows(calib_tokens, seq)


@torch.no_grad()
def calibrate_scores(
    model: nn.Module, sites: dict[str, nn.Linear], calib_tokens: np.ndarray, cfg: MagnitudeConfig,
    scales: dict[str, torch.Tensor | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Sorted samples of each site's channel scores (``|x_i|``, times ``scales[site]`` when given).

    Runs the dense model over ``calib_tokens`` in windows of ``cfg.calib_seq_len`` and keeps a
    uniform random subsample of at most ``cfg.max_calib_values`` scores per site. The level-``s``
    threshold of a site is its ``s``-quantile (:func:`quantile`).
    """
    scales = scales or {}
    windows = calib_windows(calib_tokens, cfg.calib_seq_len)
    n_windows = len(windows)
    n_batches = math.ceil(n_windows / cfg.calib_batch_size)
    per_batch = math.ceil(cfg.max_calib_values / n_batches)
    samples: dict[str, list[torch.Tensor]] = {n: [] for n in sites}
    gens: dict[str, torch.Generator] = {}

    def collector(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            a = _scores(args[0].detach(), scales.get(name)).flatten().float()
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
    return {n: torch.sort(torch.cat(v)).values for n, v in samples.items()}


def quantile(sorted_samples: torch.Tensor, s: float) -> float:
    """The level-``s`` threshold: the floor(s·n)-th smallest sample (a fraction ~s lies below it)."""
    if s <= 0:
        return 0.0
    return float(sorted_samples[min(len(sorted_samples) - 1, math.floor(s * len(sorted_samples)))])


def calibrate_thresholds(
    model: nn.Module, sites: dict[str, nn.Linear], calib_tokens: np.ndarray, cfg: MagnitudeConfig,
    sparsities: tuple[float, ...],
) -> dict[float, dict[str, float]]:
    """Per-site thresholds for each level: ``{s: {site: t}}`` with ``t`` the ``s``-quantile of ``|x|``.
    Sites sharing an input (gate/up) see the same samples, so they get the same threshold."""
    scores = calibrate_scores(model, sites, calib_tokens, cfg)
    return {s: {n: quantile(v, s) for n, v in scores.items()} for s in sparsities}


def magnitude_sparsity(
    model: nn.Module, cfg: MagnitudeConfig, *, sparsity: float, calib_tokens: np.ndarray | None,
    scales: dict[str, torch.Tensor | None] | None = None,
) -> ActivationSparsity:
    """The handle of a magnitude method (TEAL: no ``scales``; WINA: column norms) at ``sparsity``.

    Per site a level (``sparsity``, or the greedy allocation's) becomes a top-k per token
    (``mode: topk``) or a calibrated threshold on the scores (``mode: threshold``). The handle's
    ``meta`` records the per-site ``levels`` (greedy) and ``thresholds`` (threshold mode).
    """
    require(0.0 <= sparsity < 1.0, "sparsity", f"must be in [0, 1), got {sparsity}")
    sites = teal_sites(model, cfg.targets)
    scales = scales or {}
    meta: dict = {"method": cfg.method, "mode": cfg.mode, "sparsity": sparsity, "allocation": cfg.allocation}
    needs_data = cfg.mode == "threshold" or cfg.allocation == "greedy"
    if needs_data and calib_tokens is None:
        raise ValueError(f"{cfg.method} with mode={cfg.mode}, allocation={cfg.allocation} needs calib_tokens "
                         "to fit its thresholds or allocation")
    scores = calibrate_scores(model, sites, calib_tokens, cfg, scales) if cfg.mode == "threshold" else None

    def make_fn(name: str, level: float):
        scale = scales.get(name)
        if scores is None:
            return lambda x, s=level, c=scale: topk_sparsify(x, s, c)
        return lambda x, t=quantile(scores[name], level), c=scale: threshold_sparsify(x, t, c)

    if cfg.allocation == "greedy":
        levels = _greedy_path(model, sites, cfg, calib_tokens, make_fn, max(sparsity, *cfg.sparsities)).levels(sparsity)
        meta["levels"] = {n: round(v, 6) for n, v in levels.items()}
    else:
        levels = {n: sparsity for n in sites}
    if scores is not None:
        meta["thresholds"] = {n: quantile(scores[n], levels[n]) for n in sites}
    fns = {n: (m, make_fn(n, levels[n])) for n, m in sites.items()}
    return ActivationSparsity(model, fns, meta=meta)


_PATHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _greedy_path(model: nn.Module, sites: dict[str, nn.Linear], cfg: MagnitudeConfig, calib_tokens: np.ndarray,
                 make_fn, up_to: float):
    """TEAL's greedy path for ``model`` up to ``up_to``, computed once per (config, calibration tokens,
    weights) and reused for every level of a sweep (the path does not depend on the level)."""
    fields = tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "sparsities")
    weights = tuple((n, m.weight.data_ptr(), m.weight._version) for n, m in sites.items())
    key = (fields, weights, hashlib.sha1(np.ascontiguousarray(calib_tokens).tobytes()).hexdigest(), up_to)
    cache = _PATHS.setdefault(model, {})
    if key not in cache:
        windows = calib_windows(calib_tokens, cfg.calib_seq_len)[: cfg.greedy_windows].to(_device(model))
        was_training = model.training
        model.eval()
        try:
            cache.clear()  # one path per model is enough for a sweep; drop older ones
            cache[key] = greedy_path(model, sites, windows, make_fn, up_to, step=cfg.greedy_step,
                                     last_fraction=cfg.greedy_last_fraction, max_level=cfg.greedy_max_level)
        finally:
            model.train(was_training)
    return cache[key]


@register_sparsifier("teal", TealConfig)
def teal(model: nn.Module, cfg: TealConfig, *, sparsity: float,
         calib_tokens: np.ndarray | None = None) -> ActivationSparsity:
    """TEAL at ``sparsity`` on ``cfg.targets``: a handle whose hooks sparsify each site's input.

    ``mode: topk`` with ``allocation: uniform`` needs no data; threshold mode and greedy allocation
    calibrate on ``calib_tokens`` (required) with the dense model before returning. The handle's
    ``meta["thresholds"]`` holds the thresholds (threshold mode); ``achieved_sparsity()`` reports
    the fraction of zeroed inputs once the model has run inside ``with handle:``.
    """
    return magnitude_sparsity(model, cfg, sparsity=sparsity, calib_tokens=calib_tokens)
