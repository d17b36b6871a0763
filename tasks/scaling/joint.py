"""A joint Chinchilla fit of several series with a shared shape, fitted by variable projection.

``L_v(N, D) = E_v + A_v / N^alpha_v + B_v / D^beta_v`` for every series v (a data variant, an
architecture, a training method) of one ladder. By default the exponents are shared
(``alpha_v = alpha``, ``beta_v = beta``) and E, A, B are per series: the shape of the law is a
property of the model family and the training recipe, the intervention moves its levels. That is
an assumption QualityPajama shows can fail (interventions can move the exponents), so it is
*tested*: :func:`nested_test` compares it with a model where one series has exponents of its own.

Variable projection (Golub & Pereyra 1973, "The Differentiation of Pseudo-Inverses and Nonlinear
Least Squares Problems Whose Variables Separate", SIAM J. Numer. Anal. 10(2)): for fixed exponents the law is linear in (E, A, B), so
the non-negative least-squares solution is exact (every active set of three columns is tried) and
only the exponents are searched, on a grid with one zoom step. That is fast enough to refit every
bootstrap replicate (:func:`bootstrap_joint`), and it has no starting point to get wrong.

Deviation from Hoffmann et al.'s Approach 3 (Huber on log L, L-BFGS-B from a grid): the residual
here is least squares on L itself, which variable projection needs; at these losses (2-6 nats,
differences of a few hundredths) the two weightings differ by well under the seed noise. The
per-series Approach-3 laws (:mod:`tasks.scaling.chinchilla`) are fitted as before, beside this.

``N`` and ``D`` are scaled by their geometric means before the powers are taken, so the design
stays well conditioned at alpha = 2; A and B are reported in the original units.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tasks.scaling.compute_optimal import FlopsPerToken, holm_adjust, normal_pvalue

EXPONENTS = ("alpha", "beta")
# every non-empty active set of the three linear columns (E, A, B); the empty set is the zero law
_SUBSETS = [s for k in (1, 2, 3) for s in itertools.combinations(range(3), k)]


@dataclass(frozen=True)
class SeriesPoints:
    """One series' runs: N, D, L (nats) and a weight per run (a bootstrap count; 1 by default)."""

    N: np.ndarray
    D: np.ndarray
    L: np.ndarray
    w: np.ndarray | None = None

    def weights(self) -> np.ndarray:
        return np.ones(len(self.L)) if self.w is None else np.asarray(self.w, dtype=float)


@dataclass(frozen=True)
class ExponentGrid:
    """The exponent search: ``steps`` values of alpha and of beta evenly over ``[lo, hi]``, then one
    zoom of ``zoom_steps`` values over +-1 step around the optimum."""

    lo: float = 0.05
    hi: float = 2.0
    steps: int = 79
    zoom_steps: int = 11

    def values(self) -> np.ndarray:
        return np.linspace(self.lo, self.hi, self.steps)

    @property
    def step(self) -> float:
        return (self.hi - self.lo) / max(self.steps - 1, 1)


@dataclass
class JointFit:
    """Exponents and linear terms per series, the residual sum of squares and the points used."""

    params: dict[str, dict[str, float]]  # series -> {E, A, B, alpha, beta}
    sse: float
    n_points: int
    shared: tuple[str, ...]
    at_bound: dict[str, list[str]] = field(default_factory=dict)  # series -> exponents on the grid's edge

    def loss(self, series: str, N, D) -> np.ndarray:
        p = self.params[series]
        return p["E"] + p["A"] / np.asarray(N, float) ** p["alpha"] + p["B"] / np.asarray(D, float) ** p["beta"]

    def to_dict(self) -> dict:
        return {"params": self.params, "sse": self.sse, "n_points": self.n_points, "shared": list(self.shared),
                "at_bound": self.at_bound}


def _scales(data: Mapping[str, SeriesPoints]) -> tuple[float, float]:
    n = np.concatenate([p.N for p in data.values()])
    d = np.concatenate([p.D for p in data.values()])
    return float(np.exp(np.log(n).mean())), float(np.exp(np.log(d).mean()))


def _solve_small(g: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Batched solve of ``g c = r`` for k = 1, 2, 3 by Cramer's rule (numpy's batched LAPACK call
    costs ~10x more at these sizes); singular systems give non-finite entries."""
    k = r.shape[-1]
    with np.errstate(all="ignore"):
        if k == 1:
            return r / g[..., 0]
        if k == 2:
            det = g[..., 0, 0] * g[..., 1, 1] - g[..., 0, 1] * g[..., 1, 0]
            c0 = (r[..., 0] * g[..., 1, 1] - g[..., 0, 1] * r[..., 1]) / det
            c1 = (g[..., 0, 0] * r[..., 1] - r[..., 0] * g[..., 1, 0]) / det
            return np.stack([c0, c1], axis=-1)
        cof = np.stack([np.cross(g[..., 1, :], g[..., 2, :]), np.cross(g[..., 2, :], g[..., 0, :]),
                        np.cross(g[..., 0, :], g[..., 1, :])], axis=-1)  # adjugate's columns (g symmetric)
        det = np.einsum("...i,...i->...", g[..., 0, :], cof[..., :, 0])
        return np.einsum("...ij,...j->...i", cof, r) / det[..., None]


def _nnls3(gram: np.ndarray, rhs: np.ndarray, yy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact non-negative least squares with three columns, batched over leading axes.

    ``gram`` (..., 3, 3) = X^T W X, ``rhs`` (..., 3) = X^T W y, ``yy`` (...) = y^T W y. Tries every
    active set; the feasible one with the least residual is the NNLS optimum (the optimum is the
    unconstrained solution on its own positive set). Returns ``(coef (..., 3), sse (...))``.
    """
    shape = rhs.shape[:-1]
    best_sse = np.array(yy, dtype=float, copy=True)  # the all-zero solution
    best = np.zeros(shape + (3,))
    for s in _SUBSETS:
        idx = np.array(s)
        c = _solve_small(gram[..., idx[:, None], idx[None, :]], rhs[..., idx])
        sse = yy - np.einsum("...i,...i->...", c, rhs[..., idx])
        ok = np.all(c >= 0, axis=-1) & np.isfinite(sse) & (sse < best_sse)
        best_sse = np.where(ok, sse, best_sse)
        for j, col in enumerate(s):
            best[..., col] = np.where(ok, c[..., j], best[..., col])
        for col in set(range(3)) - set(s):
            best[..., col] = np.where(ok, 0.0, best[..., col])
    return best, np.maximum(best_sse, 0.0)


@dataclass(frozen=True)
class Packed:
    """Several series' runs as (V, n_max) arrays, padded with weight-0 runs (N = n0, D = d0)."""

    names: tuple[str, ...]
    N: np.ndarray
    D: np.ndarray
    L: np.ndarray
    W: np.ndarray


def pack(data: Mapping[str, SeriesPoints], names: Sequence[str], n0: float, d0: float) -> Packed:
    n_max = max(len(data[m].L) for m in names)
    shape = (len(names), n_max)
    N, D, L, W = np.full(shape, n0), np.full(shape, d0), np.zeros(shape), np.zeros(shape)
    for i, m in enumerate(names):
        p = data[m]
        k = len(p.L)
        N[i, :k], D[i, :k], L[i, :k], W[i, :k] = p.N, p.D, p.L, p.weights()
    return Packed(tuple(names), N, D, L, W)


def surfaces(pk: Packed, alphas: np.ndarray, betas: np.ndarray, n0: float, d0: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """NNLS residual and (E, A', B') of every packed series at every (alpha, beta) of its grid.

    ``alphas`` / ``betas``: one grid for all, shape (Ga,) / (Gb,), or one per series, (V, Ga) /
    (V, Gb). ``A'`` and ``B'`` are in scaled units (``N / n0``, ``D / d0``). Returns
    ``(sse (V, Ga, Gb), coef (V, Ga, Gb, 3))``; one batched computation for all series.
    """
    V = len(pk.names)
    alphas = np.broadcast_to(np.atleast_1d(alphas), (V, np.shape(alphas)[-1]))
    betas = np.broadcast_to(np.atleast_1d(betas), (V, np.shape(betas)[-1]))
    w = pk.W
    x = (pk.N / n0)[:, None, :] ** -alphas[:, :, None]  # (V, Ga, n)
    y = (pk.D / d0)[:, None, :] ** -betas[:, :, None]  # (V, Gb, n)
    ga, gb = alphas.shape[1], betas.shape[1]
    xw, yw = x * w[:, None, :], y * w[:, None, :]
    gram = np.empty((V, ga, gb, 3, 3))
    gram[..., 0, 0] = w.sum(1)[:, None, None]
    gram[..., 0, 1] = gram[..., 1, 0] = xw.sum(2)[:, :, None]
    gram[..., 0, 2] = gram[..., 2, 0] = yw.sum(2)[:, None, :]
    gram[..., 1, 1] = (xw * x).sum(2)[:, :, None]
    gram[..., 2, 2] = (yw * y).sum(2)[:, None, :]
    gram[..., 1, 2] = gram[..., 2, 1] = np.einsum("van,vbn->vab", xw, y)
    rhs = np.empty((V, ga, gb, 3))
    rhs[..., 0] = (w * pk.L).sum(1)[:, None, None]
    rhs[..., 1] = np.einsum("van,vn->va", xw, pk.L)[:, :, None]
    rhs[..., 2] = np.einsum("vbn,vn->vb", yw, pk.L)[:, None, :]
    yy = np.broadcast_to((w * pk.L * pk.L).sum(1)[:, None, None], (V, ga, gb))
    coef, sse = _nnls3(gram, rhs, yy)
    return sse, coef


def sse_surface(p: SeriesPoints, alphas: np.ndarray, betas: np.ndarray, n0: float, d0: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """NNLS residual and (E, A', B') of one series at every (alpha, beta) of the grid:
    ``(sse (Ga, Gb), coef (Ga, Gb, 3))`` (:func:`surfaces` for one series)."""
    sse, coef = surfaces(pack({"s": p}, ["s"], n0, d0), np.asarray(alphas), np.asarray(betas), n0, d0)
    return sse[0], coef[0]


def _zoom(grid: ExponentGrid, centre: float) -> np.ndarray:
    if grid.zoom_steps <= 1:
        return np.array([centre])
    return np.clip(np.linspace(centre - grid.step, centre + grid.step, grid.zoom_steps), grid.lo, grid.hi)


def _search(data: Mapping[str, SeriesPoints], members: Sequence[str], grid: ExponentGrid, n0: float, d0: float,
            alphas: np.ndarray, betas: np.ndarray, shared: tuple[str, ...]) -> tuple[float, dict[str, tuple[float, float]]]:
    """Least total SSE of ``members`` on an (alpha, beta) grid, with ``shared`` exponents common to
    them and the others per series; returns ``(sse, {series: (alpha, beta)})``."""
    sse = surfaces(pack(data, members, n0, d0), alphas, betas, n0, d0)[0]  # (V, Ga, Gb)
    if shared == ("alpha", "beta"):
        total = sse.sum(0)
        i, j = np.unravel_index(np.argmin(total), total.shape)
        return float(total[i, j]), {m: (alphas[i], betas[j]) for m in members}
    if shared == ("alpha",):
        per = sse.min(2)  # (V, Ga): each series' best beta at every alpha
        i = int(np.argmin(per.sum(0)))
        js = sse[:, i, :].argmin(1)
        return float(per[:, i].sum()), {m: (alphas[i], betas[j]) for m, j in zip(members, js)}
    if shared == ("beta",):
        per = sse.min(1)
        j = int(np.argmin(per.sum(0)))
        is_ = sse[:, :, j].argmin(1)
        return float(per[:, j].sum()), {m: (alphas[i], betas[j]) for m, i in zip(members, is_)}
    out, total = {}, 0.0
    for m, sm in zip(members, sse):
        i, j = np.unravel_index(np.argmin(sm), sm.shape)
        out[m] = (alphas[i], betas[j])
        total += float(sm[i, j])
    return total, out


def _polish(data: Mapping[str, SeriesPoints], members: Sequence[str], start: tuple[float, float],
            grid: ExponentGrid, n0: float, d0: float) -> tuple[float, float]:
    """Nelder-Mead on (alpha, beta) from the grid's optimum, inside the grid's range: the grid
    leaves the SSE up to ~1% above the continuous optimum."""
    from scipy.optimize import minimize

    pk = pack(data, members, n0, d0)

    def total(ab: np.ndarray) -> float:
        a, b = np.clip(ab, grid.lo, grid.hi)
        return float(surfaces(pk, np.array([a]), np.array([b]), n0, d0)[0].sum())

    res = minimize(total, np.array(start), method="Nelder-Mead",
                   options={"xatol": 1e-5, "fatol": 1e-14, "initial_simplex": np.array(
                       [start, (start[0] + grid.step / 4, start[1]), (start[0], start[1] + grid.step / 4)])})
    best = np.clip(res.x, grid.lo, grid.hi)
    return (float(best[0]), float(best[1])) if total(best) <= total(np.array(start)) else start


def fit_joint(data: Mapping[str, SeriesPoints], *, shared: Sequence[str] = EXPONENTS,
              own: Sequence[str] = (), grid: ExponentGrid = ExponentGrid(), scales: tuple[float, float] | None = None,
              window: Mapping[str, tuple[float, float]] | None = None, polish: bool = True) -> JointFit:
    """Fit every series of ``data`` at once: ``shared`` exponents common to all series except those
    in ``own`` (which get exponents of their own), E, A, B >= 0 per series.

    ``window``: search only within +-``half_width`` of a given (alpha, beta) centre, as
    ``{"centre": (a, b), "half_width": (h, h)}`` -- used by the bootstrap around the point estimate.
    ``polish``: finish with Nelder-Mead on the exponents (not for one shared exponent).
    A one-series call is the per-series least-squares law.

    >>> fit = fit_joint({"raw": SeriesPoints(N, D, L), "dedup": SeriesPoints(N, D, L2)})  # doctest: +SKIP
    >>> fit.params["dedup"]["alpha"] == fit.params["raw"]["alpha"]                           # doctest: +SKIP
    True
    """
    shared = tuple(e for e in EXPONENTS if e in shared)
    unknown = [s for s in own if s not in data]
    if unknown:
        raise ValueError(f"own: {unknown[0]!r} is not a fitted series ({sorted(data)})")
    n0, d0 = scales or _scales(data)
    alphas = betas = grid.values()
    if window is not None:
        (ca, cb), (ha, hb) = window["centre"], window["half_width"]
        alphas = alphas[(alphas >= ca - ha) & (alphas <= ca + ha)]
        betas = betas[(betas >= cb - hb) & (betas <= cb + hb)]
    groups = [([m for m in data if m not in own], shared)] + [([m], ()) for m in own]
    exps: dict[str, tuple[float, float]] = {}
    for members, sh in groups:
        if not members:
            continue
        _, coarse = _search(data, members, grid, n0, d0, alphas, betas, sh)
        # one zoom around the coarse optimum; a shared exponent zooms once for the group
        if sh == ("alpha", "beta"):
            a, b = next(iter(coarse.values()))
            _, fine = _search(data, members, grid, n0, d0, _zoom(grid, a), _zoom(grid, b), sh)
        elif not sh:
            fine = {}
            for m in members:
                a, b = coarse[m]
                fine |= _search(data, [m], grid, n0, d0, _zoom(grid, a), _zoom(grid, b), ())[1]
        else:  # one shared exponent: keep the coarse optimum (a zoom would need a union of windows)
            fine = coarse
        if polish and sh == ("alpha", "beta"):
            ab = _polish(data, members, next(iter(fine.values())), grid, n0, d0)
            fine = dict.fromkeys(members, ab)
        elif polish and not sh:
            fine = {m: _polish(data, [m], fine[m], grid, n0, d0) for m in members}
        exps |= fine
    params, total, at_bound = {}, 0.0, {}
    names = list(data)
    sse_all, coef_all = surfaces(pack(data, names, n0, d0), np.array([[exps[m][0]] for m in names]),
                                 np.array([[exps[m][1]] for m in names]), n0, d0)
    for k, m in enumerate(names):
        a, b = exps[m]
        sse, coef = sse_all[k], coef_all[k]
        e_, a_, b_ = coef[0, 0]
        params[m] = {"E": float(e_), "A": float(a_ * n0 ** a), "B": float(b_ * d0 ** b),
                     "alpha": float(a), "beta": float(b)}
        total += float(sse[0, 0])
        edge = [name for name, v in (("alpha", a), ("beta", b)) if min(abs(v - grid.lo), abs(v - grid.hi)) < 1e-6]
        if edge:
            at_bound[m] = edge
    n = int(sum(len(p.L) for p in data.values()))
    return JointFit(params=params, sse=total, n_points=n, shared=shared, at_bound=at_bound)


def _fitted(fit: JointFit, data: Mapping[str, SeriesPoints]) -> dict[str, np.ndarray]:
    return {m: fit.loss(m, p.N, p.D) for m, p in data.items()}


def likelihood_ratio(sse_null: float, sse_alt: float, n: int) -> float:
    """Gaussian likelihood-ratio statistic ``n log(SSE_0 / SSE_1)`` of two nested least-squares fits."""
    if sse_alt <= 0:
        return float("inf") if sse_null > 0 else 0.0
    return float(n * np.log(max(sse_null, sse_alt) / sse_alt))


def _shared_vs_own(data: Mapping[str, SeriesPoints], tested: Sequence[str], grid: ExponentGrid, n0: float,
                   d0: float) -> tuple[float, dict[str, float]]:
    """The SSE with every exponent shared, and for each tested series the SSE when it alone has
    exponents of its own: one coarse surface per series, then three zooms of +-1 step around each
    optimum (the resolution shrinks ~125-fold, so the statistic does not depend on where the grid's
    points fall). Every zoom level is one batched :func:`surfaces` call over all groups."""
    names = list(data)
    values = grid.values()
    pk = pack(data, names, n0, d0)
    coarse = surfaces(pk, values, values, n0, d0)[0]  # (V, G, G)
    total = coarse.sum(0)
    idx = {m: i for i, m in enumerate(names)}
    # groups: (members mask over names, surface to start from); the null, then per tested series
    # "everyone else shared" and "this one alone"
    masks, starts = [np.ones(len(names), bool)], [total]
    for v in tested:
        others = np.ones(len(names), bool)
        others[idx[v]] = False
        masks += [others, ~others]
        starts += [total - coarse[idx[v]], coarse[idx[v]]]
    centres = np.array([np.unravel_index(np.argmin(st), st.shape) for st in starts])
    ab = np.stack([values[centres[:, 0]], values[centres[:, 1]]], axis=1)  # (K, 2)
    steps = max(grid.zoom_steps, 3)
    half = grid.step
    rows = np.repeat(np.arange(len(names))[None, :], len(masks), 0).ravel()  # (K*V,) series of each row
    big = Packed(tuple(names[r] for r in rows), pk.N[rows], pk.D[rows], pk.L[rows], pk.W[rows])
    weight = np.stack(masks).astype(float).ravel()  # rows outside their group count 0
    best = np.zeros(len(masks))
    for _ in range(3):
        za = np.clip(ab[:, [0]] + np.linspace(-half, half, steps)[None, :], grid.lo, grid.hi)  # (K, s)
        zb = np.clip(ab[:, [1]] + np.linspace(-half, half, steps)[None, :], grid.lo, grid.hi)
        sse = surfaces(big, np.repeat(za, len(names), 0), np.repeat(zb, len(names), 0), n0, d0)[0]
        group = (sse * weight[:, None, None]).reshape(len(masks), len(names), steps, steps).sum(1)  # (K, s, s)
        flat = group.reshape(len(masks), -1).argmin(1)
        i, j = np.unravel_index(flat, (steps, steps))
        ab = np.stack([za[np.arange(len(masks)), i], zb[np.arange(len(masks)), j]], axis=1)
        best = group.reshape(len(masks), -1)[np.arange(len(masks)), flat]
        half = 2 * half / (steps - 1)
    null = float(best[0])
    return null, {v: float(best[1 + 2 * k] + best[2 + 2 * k]) for k, v in enumerate(tested)}


def nested_test(data: Mapping[str, SeriesPoints], tested: Sequence[str], *, grid: ExponentGrid = ExponentGrid(),
                n_bootstrap: int = 200, seed: int = 0, level: float = 0.05,
                min_points: int = 5) -> dict[str, dict]:
    """Does series v move the exponents? For each v in ``tested``: the null model shares (alpha,
    beta) across every series; the alternative gives v exponents of its own.

    The statistic is the Gaussian likelihood ratio of the two least-squares fits; its null distribution comes from a parametric bootstrap (residuals of
    the shared fit, resampled with replacement onto its fitted values; one set of replicates serves
    every v). p-values are Holm-adjusted across ``tested``. The answer per v: ``yes`` (adjusted
    p < ``level``), ``no``, or ``cannot tell`` when v has fewer than ``min_points`` runs, fewer than
    2 distinct N or D, or its own exponents end on the edge of the search grid (not identified by
    its points).
    """
    n0, d0 = _scales(data)
    null = fit_joint(data, grid=grid, scales=(n0, d0))
    n = null.n_points
    s0, s1 = _shared_vs_own(data, tested, grid, n0, d0)
    observed = {v: likelihood_ratio(s0, s1[v], n) for v in tested}
    fitted = _fitted(null, data)
    resid = np.concatenate([data[m].L - fitted[m] for m in data])
    resid = resid - resid.mean()
    rng = np.random.default_rng(seed)
    exceed = dict.fromkeys(tested, 0)
    for _ in range(n_bootstrap):
        draw = rng.choice(resid, size=len(resid), replace=True)
        star, k = {}, 0
        for m, p in data.items():
            star[m] = SeriesPoints(p.N, p.D, fitted[m] + draw[k:k + len(p.L)], p.w)
            k += len(p.L)
        b0, b1 = _shared_vs_own(star, tested, grid, n0, d0)
        for v in tested:
            exceed[v] += likelihood_ratio(b0, b1[v], n) >= observed[v] - 1e-12
    raw_p = [(1 + exceed[v]) / (n_bootstrap + 1) if n_bootstrap else float("nan") for v in tested]
    adj = holm_adjust(raw_p)
    out = {}
    for v, p_raw, p_adj in zip(tested, raw_p, adj):
        pts = data[v]
        own = fit_joint({v: pts}, grid=grid, scales=(n0, d0))
        reasons = []
        if len(pts.L) < min_points:
            reasons.append(f"{len(pts.L)} runs (< {min_points})")
        if len(np.unique(pts.N)) < 2 or len(np.unique(pts.D)) < 2:
            reasons.append("fewer than 2 distinct N or D")
        if v in own.at_bound:
            reasons.append(f"its own {' and '.join(own.at_bound[v])} end on the search grid's edge "
                           f"[{grid.lo}, {grid.hi}]")
        answer = "cannot tell" if reasons else ("yes" if np.isfinite(p_adj) and p_adj < level else "no")
        out[v] = {"moves_exponents": answer, "lr_statistic": observed[v], "p_value": p_raw,
                  "p_holm": float(p_adj), "n_bootstrap": n_bootstrap, "reasons": reasons,
                  "shared": {"alpha": null.params[v]["alpha"], "beta": null.params[v]["beta"]},
                  "own": {"alpha": own.params[v]["alpha"], "beta": own.params[v]["beta"]}}
    return out


@dataclass
class JointBootstrap:
    """Per replicate and series, the law's parameters (NaN where a replicate failed)."""

    series: list[str]
    samples: dict[str, np.ndarray]  # series -> (n_replicates, 5): E, A, B, alpha, beta
    n_requested: int


def run_keys(data: Mapping[str, SeriesPoints]) -> list[tuple[float, float]]:
    """The distinct (N, D) runs of the ladder, across series."""
    return sorted({(float(n), float(d)) for p in data.values() for n, d in zip(p.N, p.D)})


def bootstrap_joint(data: Mapping[str, SeriesPoints], point: JointFit, *, n_bootstrap: int, seed: int = 0,
                    grid: ExponentGrid = ExponentGrid(), window: float = 0.6, min_distinct: int = 2) -> JointBootstrap:
    """Refit the joint law on resampled ladders: distinct (N, D) runs drawn with replacement, the
    same draw for every series (the series share the ladder, so their differences stay paired).

    Each replicate searches +-``window`` around the point estimate's exponents (a replicate whose
    optimum is on that window's edge is kept; the window is wide against the intervals seen).
    Draws with fewer than ``min_distinct`` distinct N or D are redrawn.
    """
    keys = run_keys(data)
    index = {k: i for i, k in enumerate(keys)}
    key_of = {m: np.array([index[(float(n), float(d))] for n, d in zip(p.N, p.D)]) for m, p in data.items()}
    n_keys = len(keys)
    n_uniq = np.array([k[0] for k in keys])
    d_uniq = np.array([k[1] for k in keys])
    rng = np.random.default_rng(seed)
    n0, d0 = _scales(data)
    centre = next(iter(point.params.values()))
    win = {"centre": (centre["alpha"], centre["beta"]), "half_width": (window, window)}
    series = list(data)
    samples = {m: np.full((n_bootstrap, 5), np.nan) for m in series}
    for r in range(n_bootstrap):
        for _ in range(100):
            counts = np.bincount(rng.integers(0, n_keys, n_keys), minlength=n_keys).astype(float)
            used = counts > 0
            if len(np.unique(n_uniq[used])) >= min_distinct and len(np.unique(d_uniq[used])) >= min_distinct:
                break
        star = {m: SeriesPoints(p.N, p.D, p.L, p.weights() * counts[key_of[m]]) for m, p in data.items()}
        if point.shared != EXPONENTS:
            fit = fit_joint(star, shared=point.shared, grid=grid, scales=(n0, d0), polish=False)
        else:
            fit = fit_joint(star, grid=grid, scales=(n0, d0), window=win, polish=False)
        for m in series:
            q = fit.params[m]
            samples[m][r] = [q["E"], q["A"], q["B"], q["alpha"], q["beta"]]
    return JointBootstrap(series=series, samples=samples, n_requested=n_bootstrap)


def optimal_point(params: np.ndarray | Mapping[str, float], C, flops: FlopsPerToken,
                  n_range: tuple[float, float], n_grid: int = 256) -> dict[str, np.ndarray]:
    """The compute-optimal loss L*(C) = min over N of L(N, C / f(N)), searched on ``n_grid``
    log-spaced sizes over ``n_range``, with the N* and D* that reach it.

    A numerical minimum instead of Hoffmann et al.'s closed form (their eq. 4), which is undefined
    when a fit puts A or B at 0; inside the range they agree. ``params``: a {E, A, B, alpha, beta}
    mapping, or (n, 5) replicate rows -> arrays of shape (n, len(C)); ``at_edge`` marks optima on
    the searched range's edge (the law asks for a model size the ladder says nothing about).
    """
    if isinstance(params, Mapping):
        params = np.array([[params[k] for k in ("E", "A", "B", "alpha", "beta")]], dtype=float)
    p = np.asarray(params, dtype=float)
    C = np.atleast_1d(np.asarray(C, dtype=float))
    N = np.geomspace(n_range[0], n_range[1], n_grid)  # (g,)
    D = C[:, None] / flops(N)[None, :]  # (m, g)
    with np.errstate(all="ignore"):
        L = (p[:, 0, None, None] + p[:, 1, None, None] / N[None, None, :] ** p[:, 3, None, None]
             + p[:, 2, None, None] / D[None, :, :] ** p[:, 4, None, None])  # (n, m, g)
    L = np.where(np.isfinite(L), L, np.inf)
    k = L.argmin(axis=2)
    loss = np.take_along_axis(L, k[..., None], axis=2)[..., 0]
    loss = np.where(np.isfinite(loss), loss, np.nan)
    return {"loss": loss, "N_opt": N[k], "D_opt": np.take_along_axis(np.broadcast_to(D, L.shape), k[..., None], 2)[..., 0],
            "at_edge": (k == 0) | (k == n_grid - 1)}


def ladder_range(data: Mapping[str, SeriesPoints], below: float = 10.0, above: float = 100.0) -> tuple[float, float]:
    """The sizes a projection may choose from: ``[N_min / below, N_max * above]`` of the ladder."""
    n = np.concatenate([p.N for p in data.values()])
    return float(n.min() / below), float(n.max() * above)


def projected_differences(point: JointFit, boot: JointBootstrap, reference: str, compared: Sequence[str],
                          budgets: Sequence[float], flops: FlopsPerToken, confidence: float,
                          n_range: tuple[float, float]) -> list[dict]:
    """Delta(C) = L*_v(C) - L*_ref(C) at each budget, with a percentile interval and a two-sided
    p-value from the paired replicates' standard error (Holm adjustment is the caller's, across every
    comparison it decides)."""
    C = np.asarray(budgets, dtype=float)
    ref_opt = optimal_point(point.params[reference], C, flops, n_range)
    ref_point, ref_boot = ref_opt["loss"][0], optimal_point(boot.samples[reference], C, flops, n_range)["loss"]
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    rows = []
    for v in compared:
        opt = optimal_point(point.params[v], C, flops, n_range)
        delta = opt["loss"][0] - ref_point
        reps = optimal_point(boot.samples[v], C, flops, n_range)["loss"] - ref_boot  # (n, m)
        ok = np.isfinite(reps)
        for j, c in enumerate(C):
            col = reps[ok[:, j], j]
            lo, hi = (np.quantile(col, [lo_q, hi_q]) if len(col) else (np.nan, np.nan))
            rows.append({"variant": v, "reference": reference, "compute_budget": float(c), "delta": float(delta[j]),
                         "ci_low": float(lo), "ci_high": float(hi), "p_value": normal_pvalue(delta[j], col),
                         "n_replicates": int(len(col)), "D_opt_variant": float(opt["D_opt"][0, j]),
                         "D_opt_reference": float(ref_opt["D_opt"][0, j]), "N_opt_variant": float(opt["N_opt"][0, j]),
                         "optimum_at_edge": bool(opt["at_edge"][0, j] or ref_opt["at_edge"][0, j])})
    return rows


def point_differences(point: JointFit, boot: JointBootstrap, reference: str, compared: Sequence[str],
                      N: float, D: float, confidence: float, *, run_sd: float | None = None,
                      seed: int = 0) -> list[dict]:
    """Predicted Delta = L_v(N, D) - L_ref(N, D) at one (N, D) off the ladder, with a percentile
    interval over the paired bootstrap (``ci_low``, ``ci_high``: where the law's Delta lies) and,
    given ``run_sd`` (the seed spread of a one-seed Delta), a prediction interval for one trained
    pair (``pi_low``, ``pi_high``: the bootstrap plus N(0, run_sd^2)) -- what a single pre-registered
    run is checked against."""

    def law(p: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return p[:, 0] + p[:, 1] / N ** p[:, 3] + p[:, 2] / D ** p[:, 4]

    lo_q = (1 - confidence) / 2
    ref_boot = law(boot.samples[reference])
    rows = []
    for v in compared:
        reps = law(boot.samples[v]) - ref_boot
        reps = reps[np.isfinite(reps)]
        lo, hi = np.quantile(reps, [lo_q, 1 - lo_q]) if len(reps) else (np.nan, np.nan)
        pred = reps + (np.random.default_rng([seed, 2]).normal(0.0, run_sd, len(reps)) if run_sd else 0.0)
        pi_lo, pi_hi = np.quantile(pred, [lo_q, 1 - lo_q]) if len(pred) else (np.nan, np.nan)
        rows.append({"variant": v, "reference": reference, "N": float(N), "D": float(D),
                     "pi_low": float(pi_lo), "pi_high": float(pi_hi), "run_sd": run_sd,
                     "predicted_loss": float(point.loss(v, N, D)), "predicted_reference_loss": float(point.loss(reference, N, D)),
                     "delta": float(point.loss(v, N, D) - point.loss(reference, N, D)),
                     "ci_low": float(lo), "ci_high": float(hi), "n_replicates": int(len(reps))})
    return rows
