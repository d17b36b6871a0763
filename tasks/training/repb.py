"""RePB: dynamic data pruning within local windows of batches, with cumulative temporal rescaling.

The method (METHODS.md, "Training"): score samples by their loss under a near-constant model
state, compare scores only within a local window of recent batches, back-propagate the
highest-scoring ones, and reweight each kept sample's loss by its historical selection frequency.
The paper leaves most details open; the choices made here (each a :class:`RePBConfig` field):

1. **Score** = the sample's mean per-token loss from the forward pass of the current step (no extra
   forward). Over ``window`` consecutive batches the weights move little, so scores of recent
   batches are comparable to the current ones ("near-constant model state").
2. **Selection**: pool the scores of the last ``window - 1`` batches and the current one; keep the
   current batch's samples whose score is at or above the pool's ``(1 - keep_ratio)`` quantile,
   and never fewer than one. A batch of mostly easy samples thus keeps fewer than
   ``keep_ratio * B`` and a hard one more; on average ``keep_ratio`` is kept.
3. **Cumulative temporal rescaling**: for a sample (a window of the token stream, identified by its
   index) seen ``n`` times before and selected ``s`` of those, the frequency estimate is
   ``f = (s + prior * keep_ratio) / (n + prior)`` (a sample never seen gets ``f = keep_ratio``),
   and its loss weight when kept is ``w = clip(keep_ratio / f, weight_min, weight_max)``.
   Samples that are rarely selected count more when they are, often-selected ones less, which
   is the importance weight that keeps the expected gradient close to that of unpruned training.
4. The step's loss is ``sum_i m_i w_i l_i / sum_i m_i`` (``m`` the keep mask): the mean over
   kept samples, so the gradient scale does not shrink with ``keep_ratio``.

Runs at equal optimizer steps to unpruned training (the same batches are drawn; pruned samples
contribute no gradient). The forward pass covers the whole batch, so the saving is in the data the
update sees, not in compute; a second forward on the kept subset would trade one for the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.training.config import RePBConfig


class RePBSelector:
    """Keeps the window of recent scores and each sample's selection history.

    >>> sel = RePBSelector(RePBConfig(enabled=True, window=4, keep_ratio=0.5))
    >>> keep, weight = sel.select(np.array([3.0, 1.0, 2.0, 0.5]), np.array([0, 1, 2, 3]))
    >>> keep.tolist()
    [True, False, True, False]
    """

    def __init__(self, cfg: RePBConfig) -> None:
        self.cfg = cfg
        # The last window-1 batches' scores (maxlen 0 when window == 1: the pool is the batch alone).
        self._window: deque[np.ndarray] = deque(maxlen=cfg.window - 1)
        self._seen: dict[int, int] = {}
        self._selected: dict[int, int] = {}
        self.n_seen_total = 0
        self.n_kept_total = 0

    def frequency(self, sample_ids: np.ndarray) -> np.ndarray:
        """Smoothed historical selection frequency of each sample (before the current step)."""
        c = self.cfg
        n = np.array([self._seen.get(int(i), 0) for i in sample_ids], dtype=np.float64)
        s = np.array([self._selected.get(int(i), 0) for i in sample_ids], dtype=np.float64)
        return (s + c.prior * c.keep_ratio) / (n + c.prior)

    def select(self, scores: np.ndarray, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decide which samples of the current batch to keep and their loss weights.

        ``scores``: shape (B,), per-sample loss; ``sample_ids``: shape (B,), ints identifying the
        sample across steps. Returns ``(keep, weight)``: bool (B,) and float64 (B,) (weight 0 where
        not kept). Updates the window and the selection history.
        """
        c = self.cfg
        scores = np.asarray(scores, dtype=np.float64)
        sample_ids = np.asarray(sample_ids)
        pool = np.concatenate([*self._window, scores]) if self._window else scores
        # The k-th largest score of the pool, k = ceil(keep_ratio * |pool|): ties at it are all kept.
        k = max(1, math.ceil(c.keep_ratio * len(pool) - 1e-9))
        threshold = np.partition(pool, len(pool) - k)[len(pool) - k]
        keep = scores >= threshold
        if not keep.any():
            keep[int(np.argmax(scores))] = True
        weight = np.clip(c.keep_ratio / self.frequency(sample_ids), c.weight_min, c.weight_max)
        weight = np.where(keep, weight, 0.0)
        for i, k in zip(sample_ids.tolist(), keep.tolist()):
            self._seen[i] = self._seen.get(i, 0) + 1
            if k:
                self._selected[i] = self._selected.get(i, 0) + 1
        self._window.append(scores)
        self.n_seen_total += len(scores)
        self.n_kept_total += int(keep.sum())
        return keep, weight

    @property
    def kept_fraction(self) -> float | None:
        return self.n_kept_total / self.n_seen_total if self.n_seen_total else None

    def weighted_loss(self, per_sample: torch.Tensor, sample_ids: np.ndarray) -> torch.Tensor:
        """Select on ``per_sample`` (B,) losses and return ``sum(m*w*l) / sum(m)`` (differentiable)."""
        keep, weight = self.select(per_sample.detach().float().cpu().numpy(), sample_ids)
        w = torch.from_numpy(weight).to(per_sample.device, per_sample.dtype)
        return (per_sample * w).sum() / float(keep.sum())

    # -- checkpointing: tensors for the safetensors file, scalars for the JSON ------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        ids = np.fromiter(self._seen.keys(), dtype=np.int64, count=len(self._seen))
        seen = np.fromiter(self._seen.values(), dtype=np.int64, count=len(self._seen))
        sel = np.array([self._selected.get(int(i), 0) for i in ids], dtype=np.int64)
        out = {
            "repb.ids": torch.from_numpy(ids),
            "repb.seen": torch.from_numpy(seen),
            "repb.selected": torch.from_numpy(sel),
        }
        if self._window:
            out["repb.window"] = torch.from_numpy(np.stack(list(self._window)))
        return out

    def state_scalars(self) -> dict[str, Any]:
        return {"n_seen_total": self.n_seen_total, "n_kept_total": self.n_kept_total}

    def load_state(self, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
        ids = tensors["repb.ids"].numpy().tolist()
        self._seen = dict(zip(ids, tensors["repb.seen"].numpy().tolist()))
        self._selected = {i: s for i, s in zip(ids, tensors["repb.selected"].numpy().tolist()) if s}
        self._window.clear()
        if "repb.window" in tensors:
            for row in tensors["repb.window"].numpy():
                self._window.append(row.astype(np.float64))
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


def compare_repb(spec, cfg, train_tokens: np.ndarray, val_tokens: np.ndarray, out_dir: str | Path,
                 **train_kwargs: Any) -> dict[str, Any]:
    """Train ``spec`` twice at equal optimizer steps, without and with RePB; return both results.

    Returns ``{"baseline": TrainResult, "repb": TrainResult, "delta_val_loss": repb - baseline,
    "kept_fraction": float}``. Runs go to ``out_dir/baseline`` and ``out_dir/repb``.
    """
    from tasks.training.loop import train_model

    out_dir = Path(out_dir)
    base_cfg, repb_cfg = _unpruned_and_pruned(cfg)
    base = train_model(spec, base_cfg, train_tokens, val_tokens, out_dir / "baseline", **train_kwargs)
    pruned = train_model(spec, repb_cfg, train_tokens, val_tokens, out_dir / "repb", **train_kwargs)
    return {
        "baseline": base,
        "repb": pruned,
        "delta_val_loss": pruned.val_loss - base.val_loss,
        "kept_fraction": pruned.repb_kept_frac,
    }
