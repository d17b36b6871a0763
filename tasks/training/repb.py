"""RePB: dynamic data pruning within local windows of batches, with cumulative temporal rescaling.

RePB (Zhou et al., "Inconsistency Biases in Dynamic Data Pruning", ICLR 2026) fixes two biases of loss-based dynamic pruning: *score context drift* (comparing loss
scores computed under different model states) and *temporal gradient bias* (a sample selected
more or less often than the rest shifts the effective data distribution). What the paper
specifies — prune within local windows of batches whose scores come from a near-constant model
state; reweight each kept sample's loss by its historical selection frequency — is kept. The
paper targets multi-epoch image training (scores of one pass decide the subset of the next, and
the frequency is counted per sample over epochs); this ladder trains single-epoch LMs, so the
rest is adapted, each adaptation a :class:`RePBConfig` field:

1. **Score** = the sample's mean per-token loss under the weights of the current optimizer step,
   for every sample of the step (all micro-batches): the training forward's own losses when
   ``grad_accum == 1``, a no-grad scoring forward otherwise. *Deviation*: the paper scores in one
   pass and prunes in the next; a single-epoch run has no next pass, so the step is scored and
   pruned at once. The step's ``grad_accum`` micro-batches are a local window of batches scored
   by *exactly* one model state — the paper's window in its strictest form.
2. **Fresh-score pool** (``window``, ``score_norm``): the step's scores are normalised within the
   step, ``z_i = (l_i - mean(l)) / std(l)`` by default, and pooled with the normalised scores of the
   last ``window - 1`` steps. Normalising removes what the model state changes between steps —
   the loss level falls fast early in a short run and its spread changes — so older steps'
   scores stay comparable (raw losses, ``score_norm: none``, make every older step look harder and
   the current one keep far fewer than ``keep_ratio``). The pool keeps what normalisation leaves:
   a step with a heavier upper tail keeps more than ``keep_ratio``, a flat one fewer.
3. **Selection**: keep the step's samples whose normalised score is at or above the pool's
   ``k``-th largest, ``k = ceil(keep_ratio * |pool|)`` (ties kept), and never fewer than one; on
   average ``keep_ratio`` of the samples is kept.
4. **Cumulative temporal rescaling** (``frequency_regions``, ``prior``, ``weight_min/max``): a
   frequency unit ``u`` seen ``n`` times before the step and selected ``s`` of those has frequency
   ``f_u = (s + prior * keep_ratio) / (n + prior)``, and a kept sample's loss weight is
   ``w = clip(keep_ratio / f_u, weight_min, weight_max)`` — rarely selected data counts more when it
   is, often selected data less, the importance weight that pulls the expected cumulative gradient
   back towards unpruned training's. *Deviation*: the paper's unit is the sample, counted across
   epochs; in one epoch a sample is seen once, its frequency is the prior and its weight exactly 1,
   so the rescaling would never act. Here the unit is a region: sample ids (windows of the token
   stream, in stream order) are split into ``frequency_regions`` contiguous regions, ``u =
   id * R // n_samples``; the sampler visits every region many times per epoch, so a region the
   selection keeps passing over (boilerplate, repetitive or easy text) gets its kept samples
   up-weighted from the first epoch on. ``frequency_regions: 0`` is the paper's per-sample unit.
5. **Step loss** ``sum_i m_i w_i l_i / sum_i m_i`` over the whole step (``m`` the keep mask): the
   weighted mean over kept samples, so the gradient scale does not shrink with ``keep_ratio``;
   :func:`weighted_step_loss` gives each micro-batch's share.

Not implemented: the paper's "uniform resampling" (its exact rule is not available here).
Runs at equal optimizer steps to unpruned training (the same batches are drawn; pruned samples
contribute no gradient), so the saving is in the data the update sees, not in compute.

Loop contract, once per optimizer step::

    keep, weight = selector.select(scores, ids)   # (B_total,) over all micro-batches, in order
    n_kept = int(keep.sum())
    for m in range(grad_accum):                   # rows m*b:(m+1)*b
        weighted_step_loss(per_sample_loss_m, weight[m*b:(m+1)*b], n_kept).backward()
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import deque
from typing import Any

import numpy as np
import torch

from tasks.training.config import RePBConfig


def normalise_scores(scores: np.ndarray, how: str) -> np.ndarray:
    """One step's scores (B,) made comparable with other steps' (``RePBConfig.score_norm``).

    ``zscore``: ``(l - mean) / std`` (zeros when all are equal); ``center``: ``l - mean``;
    ``rank``: average rank scaled to [0, 1] (ties share a rank; 0.5 for a single sample);
    ``none``: unchanged.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if how == "none":
        return scores.copy()
    if how == "rank":
        if len(scores) == 1:
            return np.full(1, 0.5)
        order = np.argsort(scores, kind="stable")
        ranks = np.empty(len(scores))
        ranks[order] = np.arange(len(scores))
        # ties share the mean of their ranks, so equal losses are never split by position
        _, inverse = np.unique(scores, return_inverse=True)
        ranks = np.bincount(inverse, weights=ranks)[inverse] / np.bincount(inverse)[inverse]
        return ranks / (len(scores) - 1)
    centred = scores - scores.mean()
    if how == "center":
        return centred
    std = scores.std()
    return centred / std if std > 0 else np.zeros_like(scores)


def weighted_step_loss(per_sample_loss: torch.Tensor, weight: np.ndarray | torch.Tensor,
                       n_kept_total: int | float) -> torch.Tensor:
    """One micro-batch's share of RePB's step loss ``sum_i m_i w_i l_i / sum_i m_i``.

    ``per_sample_loss``: (b,) differentiable losses of the micro-batch; ``weight``: (b,) its slice
    of :meth:`RePBSelector.select`'s weights (0 where pruned); ``n_kept_total``: samples kept over
    the whole optimizer step. Summed over the step's micro-batches (or their gradients
    accumulated) this is the weighted mean over every kept sample of the step — no further
    division by ``grad_accum``.

    >>> weighted_step_loss(torch.tensor([1.0, 3.0]), np.array([0.0, 2.0]), 2).item()
    3.0
    """
    w = torch.as_tensor(weight).to(per_sample_loss.device, per_sample_loss.dtype)
    return (per_sample_loss * w).sum() / float(n_kept_total)


class RePBSelector:
    """The pool of recent steps' normalised scores and each region's (or sample's) selection history.

    ``n_samples``: the number of distinct sample ids (``WindowSampler.n_windows``; ids lie in
    ``[0, n_samples)``), needed to map ids to ``cfg.frequency_regions`` regions. Without it the
    frequency falls back to per sample, with a warning.

    >>> sel = RePBSelector(RePBConfig(enabled=True, window=4, keep_ratio=0.5), n_samples=4)
    >>> keep, weight = sel.select(np.array([3.0, 1.0, 2.0, 0.5]), np.array([0, 1, 2, 3]))
    >>> keep.tolist()
    [True, False, True, False]
    """

    def __init__(self, cfg: RePBConfig, n_samples: int | None = None) -> None:
        self.cfg = cfg
        if n_samples is not None and n_samples < 1:
            raise ValueError(f"n_samples: must be >= 1, got {n_samples}")
        self.regions = cfg.frequency_regions if n_samples is not None else 0
        if cfg.frequency_regions and n_samples is None:
            warnings.warn(f"RePBSelector: repb.frequency_regions={cfg.frequency_regions} needs n_samples "
                          "(the sampler's n_windows); falling back to per-sample frequencies, which stay "
                          "at the prior (weight 1) in a single-epoch run", stacklevel=2)
        self.n_samples = n_samples
        # The last window-1 steps' normalised scores (maxlen 0 when window == 1: the step alone).
        self._window: deque[np.ndarray] = deque(maxlen=cfg.window - 1)
        self._seen: dict[int, int] = {}
        self._selected: dict[int, int] = {}
        self.n_seen_total = 0
        self.n_kept_total = 0

    def frequency_unit(self, sample_ids: np.ndarray) -> np.ndarray:
        """The unit each sample's selection frequency is counted in: its region, or itself."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        if not self.regions:
            return ids
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n_samples):
            raise ValueError(f"sample_ids: must lie in [0, n_samples={self.n_samples}), got "
                             f"[{ids.min()}, {ids.max()}]")
        return ids * self.regions // self.n_samples

    def frequency(self, sample_ids: np.ndarray) -> np.ndarray:
        """Smoothed historical selection frequency of each sample's unit (before the current step)."""
        c = self.cfg
        units = self.frequency_unit(sample_ids).tolist()
        n = np.array([self._seen.get(u, 0) for u in units], dtype=np.float64)
        s = np.array([self._selected.get(u, 0) for u in units], dtype=np.float64)
        return (s + c.prior * c.keep_ratio) / (n + c.prior)

    def select(self, scores: np.ndarray, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decide which samples of the current optimizer step to keep and their loss weights.

        Call once per optimizer step. ``scores``: (B_total,) per-sample losses of all the step's
        micro-batches concatenated, under the step's weights; ``sample_ids``: (B_total,) ints
        identifying each sample across steps. Returns ``(keep, weight)``: bool (B_total,) and
        float64 (B_total,), weight 0 where not kept. Updates the pool and the selection history.
        """
        c = self.cfg
        scores = np.asarray(scores, dtype=np.float64)
        sample_ids = np.asarray(sample_ids)
        if scores.shape != sample_ids.shape or scores.ndim != 1 or not len(scores):
            raise ValueError(f"scores and sample_ids: need equal non-empty 1-d shapes, got "
                             f"{scores.shape} and {sample_ids.shape}")
        z = normalise_scores(scores, c.score_norm)
        pool = np.concatenate([*self._window, z]) if self._window else z
        # The k-th largest score of the pool, k = ceil(keep_ratio * |pool|): ties at it are all kept.
        k = max(1, math.ceil(c.keep_ratio * len(pool) - 1e-9))
        threshold = np.partition(pool, len(pool) - k)[len(pool) - k]
        keep = z >= threshold
        if not keep.any():
            keep[int(np.argmax(z))] = True
        weight = np.clip(c.keep_ratio / self.frequency(sample_ids), c.weight_min, c.weight_max)
        weight = np.where(keep, weight, 0.0)
        for u, kept in zip(self.frequency_unit(sample_ids).tolist(), keep.tolist()):
            self._seen[u] = self._seen.get(u, 0) + 1
            if kept:
                self._selected[u] = self._selected.get(u, 0) + 1
        self._window.append(z)
        self.n_seen_total += len(scores)
        self.n_kept_total += int(keep.sum())
        return keep, weight

    @property
    def kept_fraction(self) -> float | None:
        return self.n_kept_total / self.n_seen_total if self.n_seen_total else None

    def weighted_loss(self, per_sample: torch.Tensor, sample_ids: np.ndarray) -> torch.Tensor:
        """Select on the step's ``per_sample`` (B,) losses and return ``sum(m*w*l) / sum(m)``.

        For a step of one micro-batch (the training forward's losses are the scores);
        differentiable. With several micro-batches use :meth:`select` and :func:`weighted_step_loss`.
        """
        keep, weight = self.select(per_sample.detach().float().cpu().numpy(), sample_ids)
        return weighted_step_loss(per_sample, weight, int(keep.sum()))

    # -- checkpointing: tensors for the safetensors file, scalars for the JSON ------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        units = np.fromiter(self._seen.keys(), dtype=np.int64, count=len(self._seen))
        seen = np.fromiter(self._seen.values(), dtype=np.int64, count=len(self._seen))
        sel = np.array([self._selected.get(int(u), 0) for u in units], dtype=np.int64)
        out = {
            "repb.ids": torch.from_numpy(units),
            "repb.seen": torch.from_numpy(seen),
            "repb.selected": torch.from_numpy(sel),
        }
        if self._window:
            # flat + lengths: steps need not all have the same number of samples
            out["repb.window"] = torch.from_numpy(np.concatenate(list(self._window)))
            out["repb.window_lengths"] = torch.tensor([len(w) for w in self._window], dtype=torch.int64)
        return out

    def state_scalars(self) -> dict[str, Any]:
        return {"n_seen_total": self.n_seen_total, "n_kept_total": self.n_kept_total,
                "n_samples": self.n_samples, "regions": self.regions}

    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
        saved = (scalars.get("n_samples"), scalars.get("regions", 0))
        if saved != (self.n_samples, self.regions):
            raise ValueError(f"RePB state counts frequencies over (n_samples, regions) = {saved}, this "
                             f"selector over {(self.n_samples, self.regions)}; delete the checkpoint to retrain")
        units = tensors["repb.ids"].numpy().tolist()
        self._seen = dict(zip(units, tensors["repb.seen"].numpy().tolist()))
        self._selected = {u: s for u, s in zip(units, tensors["repb.selected"].numpy().tolist()) if s}
        self._window.clear()
        if "repb.window" in tensors:
            flat = tensors["repb.window"].numpy().astype(np.float64)
            lengths = tensors["repb.window_lengths"].numpy()
            for row in np.split(flat, np.cumsum(lengths)[:-1]):
                self._window.append(row)
        self.n_seen_total = int(scalars["n_seen_total"])
        self.n_kept_total = int(scalars["n_kept_total"])


def repb_arms(cfg, variant: str) -> list[tuple[str, Any]]:
    """The training arms ``cfg`` asks for on ``variant``: ``[(label suffix, config)]``.

    One arm (``""``, ``cfg``) unless ``variant`` is in ``cfg.repb.compare``; then the unpruned arm (``""``) and the
    RePB arm (``"+repb"``), identical but for ``repb.enabled``, so both run the same batches for
    the same number of optimizer steps. The unpruned arm's config equals a plain run's, so a
    ladder trained before is reused rather than retrained.
    """
    if variant not in cfg.repb.compare:
        return [("", cfg)]
    unpruned, pruned = _unpruned_and_pruned(cfg)
    return [("", unpruned), ("+repb", pruned)]


def _unpruned_and_pruned(cfg):
    """``cfg`` without and with RePB, otherwise identical (``compare`` cleared in both)."""
    off = dataclasses.replace(cfg.repb, enabled=False, compare=())
    return (dataclasses.replace(cfg, repb=off),
            dataclasses.replace(cfg, repb=dataclasses.replace(off, enabled=True)))
