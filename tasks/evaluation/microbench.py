"""Evaluation subsets that rank models reliably: micro-benchmark selectors judged by MDAD.

From a models x items 0/1 correctness matrix (the evaluate stage's
``reports/downstream/correctness_<task>.parquet``, or a user's CSV) each selector picks ``n`` items and
weights, and estimates a model's full-benchmark accuracy from them: ``random``; ``stratified`` (by
item difficulty); ``anchor_points`` (Vivek, Ethayarajh, Yang & Kiela 2024, "Anchor Points: Benchmarking
Models with Much Fewer Examples", arXiv:2309.08638: k-medoids on the items' correctness vectors,
each anchor weighted by its cluster's share); ``learned_anchors`` (after SparseEval: Zhang, Guo, Lu,
Dai, Xia & Wang 2026, "SparseEval: Efficient Evaluation of Large Language Models by Sparse
Optimization", arXiv:2602.07909: the same anchors with non-negative weights and an intercept fitted by
L-BFGS-B). Selectors are fitted on training models and judged on held-out ones by cross-validation
over models, by MDAD (Yauney, Warraich & Swayamdipta 2025, "How Reliable is Language Model
Micro-Benchmarking?", arXiv:2510.08730), Kendall's tau and MAE.

Deviations: anchor points cluster on 0/1 correctness (Hamming distance), the paper on the
correct-class probability, which a 0/1 matrix does not have; ``learned_anchors`` is SparseEval's
linear, fixed-anchor special case (no MLP, no iterative anchor refinement), with a ridge towards the
anchor-point weights because a fold has tens of models and up to hundreds of weights. Details
(estimators, the MDAD binning): docs/evaluation.md.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from tasks.common.config import at_least, require
from tasks.common.io import atomic_path
from tasks.common.parallel import single_threaded_blas

METHODS = ("random", "stratified", "anchor_points", "learned_anchors")

# Gap bin edges in accuracy (0.01 = 1 point): half-point bins up to 5 points, where pairs are hard
# to rank and the paper's MDADs lie (3.5 points on MMLU-Pro), coarser above.
DEFAULT_GAP_BINS = (0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.07, 0.08, 0.09,
                    0.10, 0.125, 0.15, 0.175, 0.20, 0.25, 0.30, 0.35, 0.40, 0.50, 1.0)


@dataclass(frozen=True, kw_only=True)
class MicrobenchConfig:
    """How selectors are compared.

    ``methods``: selectors from :data:`METHODS`. ``probability``: the ``p`` a pair must be ranked
    correctly with. ``gap_bins``: increasing edges of the full-benchmark accuracy gap (fractions,
    not points). ``repeats``: random fold splits, each with a fresh subset draw per fold.
    ``folds``: cross-validation over models (capped at ``models // 2`` so every held-out fold has
    a pair). ``min_outcomes``: pair outcomes a gap bin needs (sparser bins are merged upward).
    ``strata``: difficulty strata of ``stratified``. ``kmedoids_iters``: alternation steps of the anchor clustering.
    ``ridge``/``max_iter``: the learned weights' pull toward the anchor-point weights and L-BFGS-B's
    iteration cap. ``seed``: every random draw derives from it.
    """

    methods: tuple[str, ...] = METHODS
    probability: float = 0.95
    gap_bins: tuple[float, ...] = DEFAULT_GAP_BINS
    # Each bin's ranking rate is a Monte Carlo estimate: with 50 outcomes its standard error near
    # p = 0.95 is ~3 points of probability, so MDAD can move by a bin between seeds.
    repeats: int = 50
    folds: int = 5
    min_outcomes: int = 50
    strata: int = 10
    kmedoids_iters: int = 30
    # Picked on benchmarks/microbench.py's synthetic IRT population (grid 0, 1e-4 ... 1e-1; n = 10,
    # 50, 250; 32 training models): 0 overfits (held-out MAE 2.4x the anchor points' at n = 50),
    # 1e-2 beat the anchor-point weights at every size. Tune it on your own matrix.
    ridge: float = 1e-2
    max_iter: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        require(len(self.methods) > 0, "methods", "name at least one selector")
        unknown = [m for m in self.methods if m not in METHODS]
        require(not unknown, "methods", f"unknown {unknown}; known: {', '.join(METHODS)}")
        require(len(set(self.methods)) == len(self.methods), "methods", f"has duplicates: {list(self.methods)}")
        require(0.5 < self.probability < 1, "probability", f"must be in (0.5, 1), got {self.probability}")
        edges = self.gap_bins
        require(len(edges) >= 2, "gap_bins", f"needs at least 2 edges, got {list(edges)}")
        require(all(math.isfinite(e) for e in edges) and edges[0] >= 0 and edges[-1] <= 1, "gap_bins",
                f"edges must lie in [0, 1] (accuracy, not points), got {list(edges)}")
        require(all(a < b for a, b in zip(edges, edges[1:])), "gap_bins",
                f"edges must increase strictly, got {list(edges)}")
        at_least(self.repeats, 1, "repeats")
        at_least(self.folds, 2, "folds")
        at_least(self.min_outcomes, 1, "min_outcomes")
        at_least(self.strata, 1, "strata")
        at_least(self.kmedoids_iters, 1, "kmedoids_iters")
        require(self.ridge >= 0 and math.isfinite(self.ridge), "ridge", f"must be >= 0, got {self.ridge}")
        at_least(self.max_iter, 1, "max_iter")


# ---------------------------------------------------------------------------------------------
# The correctness matrix


@dataclass(frozen=True)
class CorrectnessMatrix:
    """``correct``: (models, items) int8 0/1. ``source``: the file it came from (for messages).
    ``dropped_items``: items of a pipeline matrix that some model did not score (null), left out."""

    models: tuple[str, ...]
    items: tuple[str, ...]
    correct: np.ndarray
    source: str = "matrix"
    dropped_items: int = 0

    def __post_init__(self) -> None:
        c = self.correct
        require(c.ndim == 2 and c.shape == (len(self.models), len(self.items)), "correct",
                f"shape {c.shape} does not match {len(self.models)} models x {len(self.items)} items")
        require(bool(np.isin(c, (0, 1)).all()), "correct", "values must be 0 or 1")

    @property
    def accuracy(self) -> np.ndarray:
        """(models,) full-benchmark accuracy."""
        return self.correct.mean(axis=1)


def read_correctness_matrix(path: str | Path) -> CorrectnessMatrix:
    """Read and check a models x items correctness matrix.

    ``.parquet``: the evaluate stage's ``correctness_<task>.parquet`` (a ``model`` column, one
    0/1 column per item, null where a model did not score the item; such items are left out and
    counted in ``dropped_items``). Anything else is read as CSV: the first column is the model
    name, one column per item, every cell ``0`` or ``1``.

    Every problem is a ``ValueError`` starting with the file and naming the place: for a CSV the
    line (the header is line 1) and the 1-based column with its name. Refused: a cell that is not
    0 or 1 (an empty one included), an empty or repeated model name, a repeated item name, no item
    columns, fewer than 2 models.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: correctness matrix not found")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a correctness matrix")
    if path.suffix == ".parquet":
        try:
            frame = pl.read_parquet(path)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from None
        return _matrix_from_frame(frame, source=str(path), first_line=None)
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), None)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not header:
        raise ValueError(f"{path}: empty file (no header line)")
    seen: dict[str, int] = {}
    for col, name in enumerate(header, start=1):
        if col > 1 and not name.strip():
            raise ValueError(f"{path}: line 1, column {col}: empty item name")
        if name in seen:
            raise ValueError(f"{path}: line 1, column {col}: item {name!r} is repeated (first in column "
                             f"{seen[name]}); each item is one column")
        seen[name] = col
    try:
        frame = pl.read_csv(path, infer_schema_length=0)  # every cell as text: "0.5" must not become 0.5
    except (pl.exceptions.PolarsError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable CSV ({exc})") from None
    return _matrix_from_frame(frame, source=str(path), first_line=2)


def _matrix_from_frame(frame: pl.DataFrame, *, source: str, first_line: int | None) -> CorrectnessMatrix:
    """Check a frame (model column first) and build the matrix; ``first_line``: the CSV line of row
    0 (a CSV: every cell is text and must be 0/1), or None (Parquet: null marks an unscored item)."""
    def at(i: int, col: int | None = None) -> str:
        place = f"line {i + first_line}" if first_line is not None else f"row {i}"
        if col is not None:
            place += f", column {col + 1} ({frame.columns[col]!r})"
        return place

    if frame.width < 2:
        raise ValueError(f"{source}: no item columns (first column: model name, then one 0/1 column per item)")
    names = frame.to_series(0).cast(pl.String)
    for i, name in enumerate(names.to_list()):
        if name is None or not name.strip():
            raise ValueError(f"{source}: {at(i, 0)}: empty model name")
    first: dict[str, int] = {}
    for i, name in enumerate(names.to_list()):
        if name in first:
            raise ValueError(f"{source}: {at(i, 0)}: model {name!r} is repeated (first on "
                             f"{at(first[name])}); a model would count twice")
        first[name] = i
    if frame.height < 2:
        raise ValueError(f"{source}: {frame.height} model(s); ranking needs at least 2")
    item_cols = frame.columns[1:]
    bad_at: list[tuple[int, int, str]] = []  # (row, column, problem): the first bad cell in file order
    values = np.empty((frame.height, len(item_cols)), dtype=np.int8)
    unscored = np.zeros(len(item_cols), dtype=bool)
    for j, col in enumerate(item_cols, start=1):
        raw = frame[col]
        if first_line is not None:  # CSV text
            text = raw.str.strip_chars()
            ok = text.is_in(["0", "1"]).fill_null(False).to_numpy()
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                cell = text[i]
                bad_at.append((i, j, "empty cell; every model needs a 0 or 1 for every item" if not cell
                               else f"{raw[i]!r} is not 0 or 1"))
                continue
            values[:, j - 1] = (text == "1").to_numpy()
        else:
            if raw.dtype == pl.Boolean:
                raw = raw.cast(pl.Int8)
            num = raw.cast(pl.Float64, strict=False)
            present = raw.is_not_null().to_numpy()
            ok = ~present | num.is_in([0.0, 1.0]).fill_null(False).to_numpy()
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                bad_at.append((i, j, f"{raw[i]!r} is not 0 or 1"))
                continue
            unscored[j - 1] = not present.all()
            values[:, j - 1] = num.fill_null(0).to_numpy()
    if bad_at:
        i, j, problem = min(bad_at)
        raise ValueError(f"{source}: {at(i, j)}: {problem}")
    if unscored.all():
        raise ValueError(f"{source}: no item was scored by every model ({len(item_cols)} items, each null "
                         f"for some model)")
    keep = ~unscored
    return CorrectnessMatrix(models=tuple(names.to_list()), items=tuple(c for c, k in zip(item_cols, keep) if k),
                             correct=values[:, keep], source=source, dropped_items=int(unscored.sum()))


# ---------------------------------------------------------------------------------------------
# Selectors: (training models' correctness (M, I), n, rng, cfg) -> Subset


@dataclass(frozen=True)
class Subset:
    """``items``: (n,) column indices; ``weights``: (n,); the estimate of a model's full accuracy
    is ``intercept + correct[:, items] @ weights``."""

    items: np.ndarray
    weights: np.ndarray
    intercept: float = 0.0

    def estimate(self, correct: np.ndarray) -> np.ndarray:
        """(models, items) correctness -> (models,) estimated full-benchmark accuracy."""
        return self.intercept + correct[:, self.items].astype(np.float64) @ self.weights


def random_subset(train: np.ndarray, n: int, rng: np.random.Generator, cfg: MicrobenchConfig) -> Subset:
    """``n`` items uniformly without replacement, equal weights ``1/n`` (ignores ``train``'s values)."""
    items = rng.choice(train.shape[1], size=n, replace=False)
    return Subset(np.sort(items), np.full(n, 1.0 / n))


def difficulty_strata(train: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """(I,) stratum 0..k-1 of each item: ``k`` equal-count quantile strata of mean correctness over
    ``train``'s models (0 = hardest); ties are broken at random so equal-difficulty items split evenly."""
    n_items = train.shape[1]
    require(1 <= k <= n_items, "k", f"must be in [1, {n_items}], got {k}")
    order = np.lexsort((rng.random(n_items), train.mean(axis=0)))
    labels = np.empty(n_items, dtype=np.int64)
    for s, chunk in enumerate(np.array_split(order, k)):
        labels[chunk] = s
    return labels


def _allocate(n: int, sizes: np.ndarray) -> np.ndarray:
    """``n`` draws over strata of ``sizes``: one each, the rest in proportion to ``sizes - 1``
    (largest remainder), never more than a stratum holds."""
    spare = sizes - 1
    rest = n - len(sizes)
    quota = rest * spare / spare.sum() if spare.sum() else np.zeros(len(sizes))
    alloc = np.floor(quota).astype(np.int64)
    left = rest - int(alloc.sum())
    alloc[np.argsort(-(quota - alloc), kind="stable")[:left]] += 1
    return alloc + 1


def stratified_subset(train: np.ndarray, n: int, rng: np.random.Generator, cfg: MicrobenchConfig) -> Subset:
    """Stratified by difficulty: ``min(cfg.strata, n)`` quantile strata (:func:`difficulty_strata`),
    every stratum sampled, weights ``(N_s / I) / n_s`` (sum 1)."""
    n_items = train.shape[1]
    labels = difficulty_strata(train, min(cfg.strata, n), rng)
    sizes = np.bincount(labels)
    items, weights = [], []
    for s, take in enumerate(_allocate(n, sizes)):
        members = np.flatnonzero(labels == s)
        items.append(rng.choice(members, size=take, replace=False))
        weights.append(np.full(take, sizes[s] / n_items / take))
    items_a, weights_a = np.concatenate(items), np.concatenate(weights)
    order = np.argsort(items_a)
    return Subset(items_a[order], weights_a[order])


def _hamming_to(x: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """Hamming distance (fraction of models that disagree) between item vectors: x (I, M), centres
    (k, M) -> (I, k)."""
    m = x.shape[1]
    return (x.sum(1)[:, None] + centres.sum(1)[None, :] - 2.0 * x @ centres.T) / m


def kmedoids(x: np.ndarray, k: int, rng: np.random.Generator, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """k-medoids (alternating assignment / medoid update) with k-means++ seeding on Hamming distance.

    ``x``: (I, M) item vectors. Returns ``(medoids (k,), labels (I,))``; every cluster holds at
    least its medoid (a medoid is always labelled with its own cluster, so duplicate items cannot
    empty a cluster). Memory is O(I k + largest cluster^2), never O(I^2).
    """
    n_items = x.shape[0]
    require(1 <= k <= n_items, "k", f"must be in [1, {n_items}], got {k}")
    medoids = np.empty(k, dtype=np.int64)
    medoids[0] = rng.integers(n_items)
    chosen = np.zeros(n_items, dtype=bool)
    chosen[medoids[0]] = True
    nearest = _hamming_to(x, x[medoids[:1]])[:, 0]
    for c in range(1, k):
        w = np.where(chosen, 0.0, nearest**2)
        # Only duplicates of chosen items are left (k > distinct vectors): any unchosen item will do.
        p = w / w.sum() if w.sum() > 0 else (~chosen) / (~chosen).sum()
        medoids[c] = rng.choice(n_items, p=p)
        chosen[medoids[c]] = True
        nearest = np.minimum(nearest, _hamming_to(x, x[medoids[c:c + 1]])[:, 0])
    previous = np.full(n_items, -1)
    for _ in range(iters):
        labels = np.argmin(_hamming_to(x, x[medoids]), axis=1)
        labels[medoids] = np.arange(k)
        moved = labels != previous
        # A cluster whose members did not change keeps its medoid: only the others are recomputed.
        new = medoids.copy()
        for c in np.unique(np.concatenate([labels[moved], previous[moved & (previous >= 0)]])):
            members = np.flatnonzero(labels == c)
            if members.size > 2:
                cost = _hamming_to(x[members], x[members]).sum(axis=1)
                new[c] = members[int(np.argmin(cost))]
        if np.array_equal(new, medoids):
            break
        medoids, previous = new, labels
    labels = np.argmin(_hamming_to(x, x[medoids]), axis=1)
    labels[medoids] = np.arange(k)
    return medoids, labels


def anchor_points(train: np.ndarray, n: int, rng: np.random.Generator, cfg: MicrobenchConfig) -> Subset:
    """Anchor Points (Vivek et al., 2024): ``n`` k-medoids anchors of the items' correctness
    vectors across ``train``'s models, each weighted by its cluster's share ``|cluster| / I``
    (the weights sum to 1), so ``â = sum_k (|cluster_k| / I) C[m, anchor_k]``."""
    medoids, labels = kmedoids(train.T.astype(np.float64), n, rng, cfg.kmedoids_iters)
    weights = np.bincount(labels, minlength=n) / train.shape[1]
    order = np.argsort(medoids)
    return Subset(medoids[order], weights[order])


def learn_anchor_weights(train: np.ndarray, anchors: Subset, cfg: MicrobenchConfig) -> Subset:
    """SparseEval-style weights on fixed anchors: nonnegative ``w`` and intercept ``b`` minimising

        mean_m (b + C[m, anchors] . w - a_m)^2 + ridge * |w - w0|^2 / |w0|^2

    over ``train``'s models (``a_m`` their full accuracy, ``w0`` the anchors' own weights), by
    L-BFGS-B from ``(w0, 0)`` with the analytic gradient. The weights need not sum to 1: the
    intercept and the fit absorb the scale.
    """
    from scipy.optimize import minimize

    x = train[:, anchors.items].astype(np.float64)
    y = train.mean(axis=1)
    w0 = anchors.weights.astype(np.float64)
    scale = cfg.ridge / float(w0 @ w0)
    m = x.shape[0]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:-1], theta[-1]
        r = x @ w + b - y
        d = w - w0
        grad = np.append(2.0 / m * (x.T @ r) + 2.0 * scale * d, 2.0 / m * r.sum())
        return float(r @ r / m + scale * d @ d), grad

    with single_threaded_blas():  # OpenBLAS threads made each small L-BFGS-B run ~300x slower on 2 busy cores
        res = minimize(loss, np.append(w0, anchors.intercept), jac=True, method="L-BFGS-B",
                       bounds=[(0.0, None)] * len(w0) + [(None, None)], options={"maxiter": cfg.max_iter})
    return Subset(anchors.items, np.maximum(res.x[:-1], 0.0), float(res.x[-1]))


def learned_anchors(train: np.ndarray, n: int, rng: np.random.Generator, cfg: MicrobenchConfig) -> Subset:
    """:func:`anchor_points`, then :func:`learn_anchor_weights`."""
    return learn_anchor_weights(train, anchor_points(train, n, rng, cfg), cfg)


SELECTORS: dict[str, Callable[[np.ndarray, int, np.random.Generator, MicrobenchConfig], Subset]] = {
    "random": random_subset, "stratified": stratified_subset, "anchor_points": anchor_points,
    "learned_anchors": learned_anchors,
}


# ---------------------------------------------------------------------------------------------
# Metrics


def pair_outcomes(estimate: np.ndarray, full: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of models with a nonzero full gap: ``(gaps, scores)``, score 1 when the estimate
    orders the pair as the full benchmark does, 0.5 on a tie in the estimate, else 0."""
    i, j = np.triu_indices(len(full), k=1)
    gap = full[i] - full[j]
    keep = gap != 0
    est = np.sign(estimate[i] - estimate[j])[keep]
    truth = np.sign(gap[keep])
    return np.abs(gap[keep]), np.where(est == 0, 0.5, (est == truth).astype(np.float64))


def rank_probability(gaps: np.ndarray, scores: np.ndarray, edges: Sequence[float], *,
                     min_outcomes: int = 1) -> pl.DataFrame:
    """Ranking probability per gap bin: ``gap_low``, ``gap_high``, ``outcomes``, ``p_correct`` (mean
    score), ``min_gap`` and ``mean_gap`` (of the outcomes in the bin).

    Bins are ``[edges[b], edges[b+1])``, the last closed; walking up from the smallest gap, a bin
    with fewer than ``min_outcomes`` outcomes is merged with the ones above it until the merged bin
    has enough, and a short remainder at the top joins the bin below it. Every bin returned thus
    has ``>= min_outcomes`` outcomes, unless there are fewer in all (then one bin holds them all).
    """
    edges = np.asarray(edges, dtype=np.float64)
    gaps, scores = np.asarray(gaps, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    inside = (gaps >= edges[0]) & (gaps <= edges[-1])
    gaps, scores = gaps[inside], scores[inside]
    raw = np.minimum(np.searchsorted(edges, gaps, side="right") - 1, len(edges) - 2)
    counts = np.bincount(raw, minlength=len(edges) - 1)
    groups: list[list[int]] = []
    start, held = 0, 0
    for b, count in enumerate(counts):
        held += int(count)
        if held >= min_outcomes:
            groups.append([start, b])
            start, held = b + 1, 0
    if start < len(counts):
        if groups:
            groups[-1][1] = len(counts) - 1
        else:
            groups.append([0, len(counts) - 1])
    rows = []
    for lo, hi in groups:
        sel = (raw >= lo) & (raw <= hi)
        rows.append({"gap_low": float(edges[lo]), "gap_high": float(edges[hi + 1]), "outcomes": int(sel.sum()),
                     "p_correct": float(scores[sel].mean()) if sel.any() else None,
                     "min_gap": float(gaps[sel].min()) if sel.any() else None,
                     "mean_gap": float(gaps[sel].mean()) if sel.any() else None})
    return pl.DataFrame(rows, schema={"gap_low": pl.Float64, "gap_high": pl.Float64, "outcomes": pl.Int64,
                                      "p_correct": pl.Float64, "min_gap": pl.Float64, "mean_gap": pl.Float64})


def mdad(gaps: np.ndarray, scores: np.ndarray, *, probability: float = 0.95,
         edges: Sequence[float] = DEFAULT_GAP_BINS, min_outcomes: int = 20) -> float | None:
    """Minimum detectable ability difference from pair outcomes (see the module docstring).

    Bins as :func:`rank_probability` merges them; the lowest bin from which every bin up to the
    largest gap has mean score ``>= probability``; returns the smallest gap observed in it, or None
    when the top bin falls short or there are fewer than ``min_outcomes`` outcomes in all.

    >>> mdad(np.array([0.01, 0.01, 0.05, 0.05]), np.array([1, 0, 1, 1.0]), probability=0.9,
    ...      edges=(0, 0.02, 1), min_outcomes=2)
    0.05
    """
    bins = rank_probability(gaps, scores, edges, min_outcomes=min_outcomes)
    found = None
    for row in reversed(bins.to_dicts()):
        if row["outcomes"] < min_outcomes or row["p_correct"] < probability:
            break
        found = row["min_gap"]
    return found


def kendall_tau(estimate: np.ndarray, full: np.ndarray) -> float:
    """Kendall's tau-b between estimated and full accuracies; 0 when the estimate is constant (it
    ranks nothing), NaN when the full accuracies are (there is no ranking to recover)."""
    from scipy.stats import kendalltau

    if np.ptp(full) == 0:
        return math.nan
    if np.ptp(estimate) == 0:
        return 0.0
    return float(kendalltau(estimate, full).statistic)


# ---------------------------------------------------------------------------------------------
# The comparison


@dataclass
class MicrobenchResult:
    """``table``: one row per method and size (method, n, mdad, kendall_tau, mae, p_correct, pairs,
    outcomes). ``bins``: the per-bin ranking probability behind each MDAD."""

    table: pl.DataFrame
    bins: pl.DataFrame
    config: MicrobenchConfig
    folds: int
    notes: list[str] = field(default_factory=list)


def _rng(seed: int, *key: int) -> np.random.Generator:
    # One stream per (repeat, fold, selector, size): adding a method or size changes no other draw.
    return np.random.default_rng([seed, *key])


def _cross_validate(c: np.ndarray, full: np.ndarray, sizes: Sequence[int], folds: int, cfg: MicrobenchConfig,
                    gaps: dict, scores: dict, taus: dict, errors: dict) -> None:
    """Append each held-out fold's pair outcomes, tau and absolute errors to the (method, n) lists."""
    n_models = len(full)
    anchor_key = METHODS.index("anchor_points")
    for r in range(cfg.repeats):
        split = np.array_split(_rng(cfg.seed, r).permutation(n_models), folds)
        for f, test in enumerate(split):
            train = c[np.setdiff1d(np.arange(n_models), test)]
            for n in sizes:
                anchors = None
                for method in cfg.methods:
                    if method in ("anchor_points", "learned_anchors"):
                        if anchors is None:
                            anchors = anchor_points(train, n, _rng(cfg.seed, r, f, anchor_key, n), cfg)
                        subset = anchors if method == "anchor_points" else learn_anchor_weights(train, anchors, cfg)
                    else:
                        subset = SELECTORS[method](train, n, _rng(cfg.seed, r, f, METHODS.index(method), n), cfg)
                    est = subset.estimate(c[test])
                    g, s = pair_outcomes(est, full[test])
                    key = (method, n)
                    gaps[key].append(g)
                    scores[key].append(s)
                    taus[key].append(kendall_tau(est, full[test]))
                    errors[key].append(np.abs(est - full[test]))


def compare_selectors(matrix: CorrectnessMatrix, sizes: Sequence[int], cfg: MicrobenchConfig) -> MicrobenchResult:
    """Every selector of ``cfg.methods`` at every size, cross-validated over models.

    ``sizes``: subset sizes, each in ``[1, items]``. The models need at least 4 (two folds of two
    held-out models). ``learned_anchors`` reuses ``anchor_points``' anchors of the same repeat,
    fold and size (the same draw), so the two differ only in their weights.

    >>> res = compare_selectors(read_correctness_matrix("m.csv"), [10, 50], MicrobenchConfig(repeats=5))
    >>> res.table.columns[:5]
    ['method', 'n', 'mdad', 'kendall_tau', 'mae']
    """
    c = matrix.correct
    n_models, n_items = c.shape
    require(len(sizes) > 0, "sizes", "name at least one subset size")
    for n in sizes:
        require(isinstance(n, (int, np.integer)) and n >= 1, "sizes", f"{n!r} is not a positive integer")
        require(n <= n_items, "sizes", f"{n} is larger than the {n_items} items of {matrix.source}")
    require(len(set(sizes)) == len(sizes), "sizes", f"has duplicates: {list(sizes)}")
    folds = min(cfg.folds, n_models // 2)
    if folds < 2:
        raise ValueError(f"{matrix.source}: {n_models} models; cross-validation over models needs at least 4 "
                         f"(2 folds of 2 held-out models)")
    full = matrix.accuracy
    notes = []
    if folds < cfg.folds:
        notes.append(f"folds: {folds} (not {cfg.folds}): {n_models} models leave each held-out fold a pair")
    gaps: dict[tuple[str, int], list[np.ndarray]] = {(m, n): [] for m in cfg.methods for n in sizes}
    scores = {k: [] for k in gaps}
    taus = {k: [] for k in gaps}
    errors = {k: [] for k in gaps}
    with single_threaded_blas():  # every product here is small: BLAS threads only contend
        _cross_validate(c, full, sizes, folds, cfg, gaps, scores, taus, errors)
    rows, bins = [], []
    for method in cfg.methods:
        for n in sizes:
            key = (method, n)
            g, s = np.concatenate(gaps[key]), np.concatenate(scores[key])
            t = np.asarray(taus[key])
            rows.append({"method": method, "n": int(n),
                         "mdad": mdad(g, s, probability=cfg.probability, edges=cfg.gap_bins,
                                      min_outcomes=cfg.min_outcomes),
                         "kendall_tau": float(np.nanmean(t)) if np.isfinite(t).any() else None,
                         "mae": float(np.concatenate(errors[key]).mean()),
                         "p_correct": float(s.mean()) if s.size else None,
                         "outcomes": int(s.size)})
            bins.append(rank_probability(g, s, cfg.gap_bins, min_outcomes=cfg.min_outcomes).with_columns(
                pl.lit(method).alias("method"), pl.lit(int(n), dtype=pl.Int64).alias("n")))
    schema = {"method": pl.String, "n": pl.Int64, "mdad": pl.Float64, "kendall_tau": pl.Float64, "mae": pl.Float64,
              "p_correct": pl.Float64, "outcomes": pl.Int64}
    bins_frame = pl.concat(bins).select("method", "n", pl.exclude("method", "n"))
    return MicrobenchResult(pl.DataFrame(rows, schema=schema), bins_frame, cfg, folds, notes)


def plot_mdad(table: pl.DataFrame, path: str | Path, *, probability: float, title: str = "") -> None:
    """MDAD (accuracy points) against subset size per method on a log size axis; a size with no
    reliable gap is an open marker on the top edge. Methods are nudged apart along x (a few
    percent) so equal values stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    finite = [v for v in table["mdad"].to_list() if v is not None]
    top = (max(finite) * 100 * 1.15) if finite else 10.0
    methods = table["method"].unique(maintain_order=True).to_list()
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":")]
    for i, method in enumerate(methods):
        sub = table.filter(pl.col("method") == method).sort("n")
        colour, (marker, line) = plt.cm.tab10(i % 10), styles[i % len(styles)]
        nudge = 1.0 + 0.03 * (i - (len(methods) - 1) / 2)
        xs = [n * nudge for n in sub["n"].to_list()]
        values = sub["mdad"].to_list()
        ax.plot(xs, [v * 100 if v is not None else math.nan for v in values], marker=marker, ls=line,
                color=colour, label=method)
        missing = [x for x, v in zip(xs, values) if v is None]
        if missing:
            ax.scatter(missing, [top] * len(missing), marker=marker, facecolors="none", edgecolors=[colour],
                       clip_on=False, zorder=3)
    sizes = sorted(set(table["n"].to_list()))
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_ylim(0, top * 1.02)
    ax.set_xlabel("subset size n (items)")
    ax.set_ylabel(f"MDAD: accuracy points ranked right w.p. >= {probability:g}")
    ax.set_title(title or "MDAD per subset size")
    ax.text(0.99, 0.01, "open marker on top: no gap ranked reliably", transform=ax.transAxes, ha="right",
            va="bottom", fontsize=7, color="grey")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def irt_population(n_models: int = 40, n_items: int = 1000, *, seed: int = 0) -> CorrectnessMatrix:
    """A synthetic 2-parameter logistic IRT population: ability ``theta_m ~ N(0, 1)``, item
    difficulty ``b_j ~ N(0, 1)``, discrimination ``a_j ~ LogNormal(0, 0.5)``,
    ``P(correct) = 1 / (1 + exp(-a_j (theta_m - b_j)))``, each cell one Bernoulli draw."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, 1.0, n_models)
    b = rng.normal(0.0, 1.0, n_items)
    a = rng.lognormal(0.0, 0.5, n_items)
    p = 1.0 / (1.0 + np.exp(-a[None, :] * (theta[:, None] - b[None, :])))
    correct = (rng.random((n_models, n_items)) < p).astype(np.int8)
    return CorrectnessMatrix(models=tuple(f"m{i:02d}" for i in range(n_models)),
                             items=tuple(f"i{j:04d}" for j in range(n_items)), correct=correct,
                             source=f"irt_2pl(models={n_models}, items={n_items}, seed={seed})")



# ---------------------------------------------------------------------------------------------
# In the evaluate stage


@dataclass(frozen=True, kw_only=True)
class MicrobenchStageConfig:
    """The ``evaluate.microbench`` block: compare the selectors on each task's correctness matrix.

    ``sizes`` larger than a task's items are left out (with a note); ``repeats``/``methods``/
    ``probability``/``seed``: as in :class:`MicrobenchConfig`. Only models that scored every item
    of the ladder's ``limit`` enter (SmolLM2's rows, scored on fewer items, would otherwise cut
    every model's items to its own)."""

    enabled: bool = True
    sizes: tuple[int, ...] = (10, 25, 50)
    methods: tuple[str, ...] = METHODS
    repeats: int = 20
    probability: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        require(len(self.sizes) > 0 and all(n >= 1 for n in self.sizes), "sizes",
                f"must be positive item counts, got {list(self.sizes)}")
        require(len(set(self.sizes)) == len(self.sizes), "sizes", f"has duplicates: {list(self.sizes)}")
        at_least(self.repeats, 1, "repeats")
        self.compare_config()  # methods / probability checked where they are defined

    def compare_config(self) -> MicrobenchConfig:
        return MicrobenchConfig(methods=self.methods, repeats=self.repeats, probability=self.probability,
                                seed=self.seed)


def microbench_task(task: str, wide: pl.DataFrame, cfg: MicrobenchStageConfig
                    ) -> tuple[MicrobenchResult | None, list[str]]:
    """The selectors compared on one task's ``correctness_<task>`` frame (``model`` then 0/1/null
    item columns); ``(None, notes)`` when too few complete models or items are left."""
    complete = wide.filter(pl.all_horizontal(pl.exclude("model").is_not_null()))
    notes = []
    if complete.height < wide.height:
        notes.append(f"{task}: {wide.height - complete.height} model(s) scored on fewer items left out")
    if complete.height < 4:
        return None, notes + [f"{task}: {complete.height} complete model(s); the comparison needs at least 4"]
    matrix = _matrix_from_frame(complete, source=f"correctness_{task}", first_line=None)
    sizes = [n for n in cfg.sizes if n <= len(matrix.items)]
    if len(sizes) < len(cfg.sizes):
        notes.append(f"{task}: sizes {[n for n in cfg.sizes if n not in sizes]} exceed its {len(matrix.items)} items")
    if not sizes:
        return None, notes
    result = compare_selectors(matrix, sizes, cfg.compare_config())
    return result, notes + result.notes
