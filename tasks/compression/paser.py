"""PASER: choose the recovery data a pruned model needs most (and the random baseline of the same budget).

Follows He, Yin, Zhen, Zhang, Yuan & Ma, "PASER: Post-Training Data Selection for Efficient Pruned
Large Language Model Recovery" (2025, arXiv:2502.12594): cluster the candidates by meaning (MiniLM
sentence embeddings, Laplacian eigenmaps, spectral clustering), measure each candidate's capability
degradation (the Jensen–Shannon divergence between the unpruned and the pruned model's next-token
distributions), allocate the budget across clusters by their degradation, prioritise within a cluster
by degradation per unit of training cost, and filter irrelevant and redundant candidates.

Deviations: the paper's conflict filter is a Concept Consistency Graph over concepts extracted from
instruction–response pairs; scalelab recovers on plain text windows, where no such concepts exist, so
the filter drops near-duplicates by embedding similarity instead. ``allocation: mass`` (the default)
weighs a cluster's share by its size times its degradation; ``mean`` is the paper's ratio. Where the
paper is silent (manifold dimension, graph, rounding) the choice is a field of :class:`PaserConfig`.
Details: docs/pruning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tasks.common.config import at_least, require

DEGRADATIONS = ("jsd", "loss")
ALLOCATIONS = ("mass", "mean")
COSTS = ("log_length", "none")


@dataclass(frozen=True, kw_only=True)
class PaserConfig:
    """See the module docstring for each step's field."""

    n_clusters: int = 8
    manifold_dim: int = 8
    n_neighbors: int = 10
    degradation: Literal["jsd", "loss"] = "jsd"
    allocation: Literal["mass", "mean"] = "mass"
    cost: Literal["log_length", "none"] = "log_length"
    irrelevant_quantile: float = 0.1
    redundancy_threshold: float = 0.95
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        at_least(self.n_clusters, 1, "n_clusters")
        at_least(self.manifold_dim, 1, "manifold_dim")
        at_least(self.n_neighbors, 2, "n_neighbors")
        require(self.degradation in DEGRADATIONS, "degradation", f"must be one of {list(DEGRADATIONS)}, got {self.degradation!r}")
        require(self.allocation in ALLOCATIONS, "allocation", f"must be one of {list(ALLOCATIONS)}, got {self.allocation!r}")
        require(self.cost in COSTS, "cost", f"must be one of {list(COSTS)}, got {self.cost!r}")
        require(0 <= self.irrelevant_quantile < 1, "irrelevant_quantile",
                f"must be in [0, 1), got {self.irrelevant_quantile}")
        require(0 < self.redundancy_threshold <= 1, "redundancy_threshold",
                f"must be in (0, 1] (1 = keep duplicates), got {self.redundancy_threshold}")
        at_least(self.batch_size, 1, "batch_size")


@torch.no_grad()
def sample_degradation(dense: nn.Module, pruned: nn.Module, windows: torch.Tensor, *, kind: str = "jsd",
                       batch_size: int = 4) -> np.ndarray:
    """Per window (n, T): the mean over positions of JS(p_dense || p_pruned) in nats (``jsd``), or the
    pruned model's next-token loss minus the dense model's (``loss``; T-1 predictions). Shape (n,)."""
    if kind not in DEGRADATIONS:
        raise ValueError(f"degradation: must be one of {list(DEGRADATIONS)}, got {kind!r}")
    out = []
    for s in range(0, len(windows), batch_size):
        x = windows[s : s + batch_size]
        p = F.log_softmax(dense(input_ids=x, use_cache=False).logits.float(), dim=-1)
        q = F.log_softmax(pruned(input_ids=x, use_cache=False).logits.float(), dim=-1)
        if kind == "jsd":
            m = torch.logsumexp(torch.stack([p, q]), dim=0) - math.log(2.0)
            js = 0.5 * (p.exp() * (p - m)).sum(-1) + 0.5 * (q.exp() * (q - m)).sum(-1)
            out.append(js.mean(-1))
        else:
            tgt = x[:, 1:, None]
            rise = -q[:, :-1].gather(-1, tgt).squeeze(-1) + p[:, :-1].gather(-1, tgt).squeeze(-1)
            out.append(rise.mean(-1))
    return torch.cat(out).double().numpy()


def cluster(embeddings: np.ndarray, cfg: PaserConfig) -> np.ndarray:
    """Cluster labels (n,): spectral clustering on a Laplacian-eigenmap embedding of ``embeddings``.

    With fewer candidates than the graph needs, the neighbours, coordinates and clusters shrink to
    what ``n`` allows (``n_clusters <= n // 2``); one cluster when ``n < 4``."""
    from sklearn.cluster import SpectralClustering
    from sklearn.manifold import SpectralEmbedding

    n = len(embeddings)
    k = min(cfg.n_clusters, n // 2)
    if k <= 1 or n < 4:
        return np.zeros(n, dtype=np.int64)
    x = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    neighbors = max(2, min(cfg.n_neighbors, n - 1))
    coords = SpectralEmbedding(n_components=min(cfg.manifold_dim, n - 2), affinity="nearest_neighbors",
                               n_neighbors=neighbors, random_state=cfg.seed).fit_transform(x)
    labels = SpectralClustering(n_clusters=k, affinity="nearest_neighbors", n_neighbors=neighbors,
                                assign_labels="cluster_qr", random_state=cfg.seed).fit_predict(coords)
    return labels.astype(np.int64)


def allocate(weights: np.ndarray, available: np.ndarray, budget: int) -> np.ndarray:
    """Integer counts per cluster summing to ``min(budget, available.sum())``, proportional to
    ``weights`` (largest remainder), each at most ``available``; what a full cluster cannot take
    is shared among the others by the same rule."""
    weights = np.asarray(weights, dtype=np.float64).clip(min=0)
    available = np.asarray(available, dtype=np.int64)
    budget = int(min(budget, available.sum()))
    counts = np.zeros(len(weights), dtype=np.int64)
    open_ = available > 0
    while counts.sum() < budget and open_.any():
        w = np.where(open_, weights, 0.0)
        w = np.where(open_, 1.0, 0.0) if w.sum() <= 0 else w
        room = budget - counts.sum()
        ideal = room * w / w.sum()
        add = np.floor(ideal).astype(np.int64)
        rest = room - add.sum()
        order = np.argsort(-(ideal - add), kind="stable")
        for i in order[:rest]:
            add[i] += 1
        add = np.minimum(add, available - counts)
        counts += add
        open_ = counts < available
        if add.sum() == 0:
            break
    return counts


@dataclass
class Selection:
    """Chosen candidate indices (in priority order) and how they were chosen."""

    indices: np.ndarray
    labels: np.ndarray | None = None
    cluster_scores: dict[int, float] = field(default_factory=dict)
    allocation: dict[int, int] = field(default_factory=dict)
    dropped_irrelevant: int = 0
    skipped_redundant: int = 0


def paser_select(embeddings: np.ndarray, degradation: np.ndarray, lengths: np.ndarray, k: int,
                 cfg: PaserConfig, labels: np.ndarray | None = None) -> Selection:
    """Up to ``k`` candidate indices by PASER (see the module docstring); ``labels`` skips the clustering."""
    n = len(degradation)
    if not (len(embeddings) == len(lengths) == n):
        raise ValueError(f"embeddings ({len(embeddings)}), degradation ({n}) and lengths ({len(lengths)}) differ in length")
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    labels = cluster(embeddings, cfg) if labels is None else np.asarray(labels)
    deg = np.asarray(degradation, dtype=np.float64)
    relevant = deg > np.quantile(deg, cfg.irrelevant_quantile) if cfg.irrelevant_quantile > 0 else np.ones(n, bool)
    if relevant.sum() < k:  # never drop below the budget: keep the most degraded
        relevant = np.zeros(n, bool)
        relevant[np.argsort(-deg, kind="stable")[:k]] = True
    ids = sorted(set(labels.tolist()))
    scores = {c: float(deg[labels == c].mean()) for c in ids}
    sizes = np.array([(labels == c).sum() for c in ids])
    w = np.array([scores[c] for c in ids]) * (sizes if cfg.allocation == "mass" else 1)
    available = np.array([(relevant & (labels == c)).sum() for c in ids])
    counts = allocate(w, available, k)
    cost = np.log1p(np.asarray(lengths, dtype=np.float64)) if cfg.cost == "log_length" else np.ones(n)
    ies = deg / cost
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    chosen: list[int] = []
    skipped = 0
    for c, want in zip(ids, counts):
        members = np.flatnonzero(relevant & (labels == c))
        members = members[np.argsort(-ies[members], kind="stable")]
        taken: list[int] = []
        for i in members:
            if len(taken) == want:
                break
            if taken and cfg.redundancy_threshold < 1 and float((unit[taken] @ unit[i]).max()) > cfg.redundancy_threshold:
                skipped += 1
                continue
            taken.append(int(i))
        chosen += taken
    if len(chosen) < k:  # clusters short after the redundancy filter: the next best by IES, relevant ones first
        have = set(chosen)
        left = [i for i in np.lexsort((-ies, ~relevant)) if i not in have]
        chosen += [int(i) for i in left[: k - len(chosen)]]
    order = np.array(sorted(chosen, key=lambda i: -ies[i]), dtype=np.int64)
    return Selection(order, labels, scores, {int(c): int(m) for c, m in zip(ids, counts)},
                     int(n - relevant.sum()), skipped)


def random_select(n: int, k: int, seed: int = 0) -> Selection:
    """``min(k, n)`` distinct indices drawn uniformly (the baseline at PASER's budget)."""
    rng = np.random.default_rng(seed)
    return Selection(np.sort(rng.choice(n, size=min(k, n), replace=False)).astype(np.int64))
