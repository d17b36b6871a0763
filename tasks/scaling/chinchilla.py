"""Approach 3 of Hoffmann et al. (2022), "Training Compute-Optimal Large Language Models",
as replicated by Epoch AI (Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt").

The parametric loss is ``L(N, D) = E + A / N**alpha + B / D**beta``. With ``a = log A``,
``b = log B``, ``e = log E`` it is fitted by minimising::

    sum_i  Huber_delta( LSE(a - alpha log N_i,  b - beta log D_i,  e) - log L_i )

with L-BFGS-B from a grid of starts; intervals come from a bootstrap over runs.
Parameter vectors are ordered ``theta = (a, b, e, alpha, beta)`` throughout.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from tasks.scaling.config import FitConfig

PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
THETA_NAMES = ("a", "b", "e", "alpha", "beta")


# --------------------------------------------------------------------------- objective


def huber_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                    delta: float, weights: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """The Approach-3 objective and its analytic gradient at ``theta = (a, b, e, alpha, beta)``.

    ``f = sum_i w_i H_delta(r_i)``, ``r_i = LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i``,
    ``H_delta(r) = r^2/2`` for ``|r| <= delta`` else ``delta (|r| - delta/2)``.
    With ``psi = H'(r) = clip(r, -delta, delta)`` and ``p_k`` the softmax weights of the three
    LSE terms: ``df/da = sum w psi p_1``, ``df/dalpha = -sum w psi p_1 log N`` (likewise b, beta
    with ``p_2``, ``log D``), ``df/de = sum w psi p_3``.

    Shapes: ``log_n``, ``log_d``, ``log_loss``, ``weights``: (n,). Returns ``(f, grad (5,))``.
    ``weights`` are bootstrap multiplicities (None: all 1).
    """
    a, b, e, alpha, beta = theta
    t1 = a - alpha * log_n
    t2 = b - beta * log_d
    m = np.maximum(np.maximum(t1, t2), e)
    x1 = np.exp(t1 - m)
    x2 = np.exp(t2 - m)
    x3 = np.exp(e - m)
    s = x1 + x2 + x3
    r = m + np.log(s) - log_loss
    psi = np.clip(r, -delta, delta)
    h = psi * (r - 0.5 * psi)  # = Huber_delta(r) in both branches
    if weights is None:
        f = h.sum()
        q = psi / s
    else:
        f = weights @ h
        q = weights * psi / s
    qx1 = q * x1
    qx2 = q * x2
    grad = np.array([qx1.sum(), qx2.sum(), q @ x3, -(qx1 @ log_n), -(qx2 @ log_d)])
    return float(f), grad


def grid_objective(thetas: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                   delta: float, chunk: int = 512) -> np.ndarray:
    """The objective at many parameter vectors at once: ``thetas`` (S, 5) -> (S,).

    Vectorised over starts and points (chunks of ``chunk`` starts bound the (chunk, n) buffers),
    so ranking all 4,500 grid starts costs one pass instead of 4,500 Python calls.
    """
    thetas = np.asarray(thetas, dtype=float)
    out = np.empty(len(thetas))
    for lo in range(0, len(thetas), chunk):
        th = thetas[lo:lo + chunk]
        a, b, e, alpha, beta = (th[:, k:k + 1] for k in range(5))
        t1 = a - alpha * log_n
        t2 = b - beta * log_d
        m = np.maximum(np.maximum(t1, t2), e)
        lse = m + np.log(np.exp(t1 - m) + np.exp(t2 - m) + np.exp(e - m))
        r = lse - log_loss
        psi = np.clip(r, -delta, delta)
        out[lo:lo + chunk] = (psi * (r - 0.5 * psi)).sum(axis=1)
    return out


def initial_grid(cfg: FitConfig) -> np.ndarray:
    """Every combination of the config's grid values, shape (grid_size, 5) in theta order."""
    mesh = np.meshgrid(cfg.grid_a, cfg.grid_b, cfg.grid_e, cfg.grid_alpha, cfg.grid_beta, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1).astype(float)


def single_threaded_blas() -> contextlib.AbstractContextManager:
    """Limit BLAS to one thread while optimising.

    scipy's L-BFGS-B calls BLAS on 5x5 problems; with OpenBLAS's thread pool on a busy 2-core
    machine each call took ~3 ms instead of ~0.1 ms (measured: 17x slower per start).
    threadpoolctl comes with scikit-learn (an MLflow dependency); without it nothing is limited.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - fitting still works, only slower
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _bounds(cfg: FitConfig) -> list[tuple[float, float]]:
    return [cfg.bound_a, cfg.bound_b, cfg.bound_e, cfg.bound_alpha, cfg.bound_beta]


def _lbfgs(theta0: np.ndarray, args: tuple, cfg: FitConfig, bounds: list[tuple[float, float]]):
    return minimize(huber_objective, theta0, args=args, jac=True, method="L-BFGS-B", bounds=bounds,
                    options={"ftol": cfg.lbfgs_ftol, "gtol": cfg.lbfgs_gtol, "maxiter": cfg.lbfgs_maxiter})


# --------------------------------------------------------------------------- results


@dataclass
class ChinchillaFit:
    """A point estimate of ``L(N, D) = E + A/N^alpha + B/D^beta`` (Approach 3).

    ``objective`` is the Huber sum at the optimum; ``rmse_log`` the RMSE of log-loss residuals.
    ``excluded`` lists dropped input rows (index into the arrays given) with the reason;
    ``local_optima`` (k, 5) holds the best distinct optima L-BFGS-B reached from the starts
    (theta order, best first; up to 4) — a diagnostic of how many basins the grid found.
    """

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    theta: np.ndarray
    objective: float
    rmse_log: float
    n_points: int
    n_decades_n: float
    n_starts: int
    converged: bool
    excluded: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    local_optima: np.ndarray = field(default_factory=lambda: np.empty((0, 5)))

    def predict(self, N, D) -> np.ndarray:
        """Loss at (N, D); arrays broadcast."""
        N = np.asarray(N, dtype=float)
        D = np.asarray(D, dtype=float)
        return self.E + self.A / N**self.alpha + self.B / D**self.beta

    def params(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in PARAM_NAMES}


@dataclass
class BootstrapResult:
    """A bootstrap over runs of an Approach-3 fit.

    ``samples`` (n_ok, 5): columns E, A, B, alpha, beta of each successful replicate;
    ``intervals``: percentile interval at ``confidence`` for those and for the derived
    ``a_exp = beta/(alpha+beta)`` (N* ∝ C^a_exp), ``b_exp = alpha/(alpha+beta)`` and ``G``.
    """

    point: ChinchillaFit
    samples: np.ndarray
    objectives: np.ndarray
    confidence: float
    intervals: dict[str, tuple[float, float]]
    n_requested: int
    n_failed: int
    warnings: list[str] = field(default_factory=list)
    n_basin_switch: int = 0

    def column(self, name: str) -> np.ndarray:
        return self.samples[:, PARAM_NAMES.index(name)]


def theta_to_params(theta: np.ndarray) -> np.ndarray:
    """(..., 5) theta (a, b, e, alpha, beta) -> (..., 5) (E, A, B, alpha, beta)."""
    theta = np.asarray(theta, dtype=float)
    return np.stack([np.exp(theta[..., 2]), np.exp(theta[..., 0]), np.exp(theta[..., 1]),
                     theta[..., 3], theta[..., 4]], axis=-1)


# --------------------------------------------------------------------------- fitting


def _as_arrays(N, D, loss) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    N = np.asarray(N, dtype=float).ravel()
    D = np.asarray(D, dtype=float).ravel()
    loss = np.asarray(loss, dtype=float).ravel()
    if not (len(N) == len(D) == len(loss)):
        raise ValueError(f"N, D and loss must have the same length, got {len(N)}, {len(D)}, {len(loss)}")
    for name, arr in (("N", N), ("D", D), ("loss", loss)):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr <= 0))
        if bad.size:
            raise ValueError(f"{name} must be positive and finite; row {bad[0]} has {arr[bad[0]]!r}")
    return N, D, loss


def select_points(loss: np.ndarray, cfg: FitConfig) -> tuple[np.ndarray, list[dict]]:
    """The rows kept for fitting and the excluded ones with their reason.

    Rule: the ``cfg.exclude_top_loss`` highest-loss runs are dropped (Epoch drops 5 on the
    Chinchilla points); nothing else is dropped here.
    """
    keep = np.ones(len(loss), dtype=bool)
    excluded: list[dict] = []
    k = min(cfg.exclude_top_loss, len(loss))
    if k:
        order = np.argsort(-loss, kind="stable")[:k]
        keep[order] = False
        for rank, i in enumerate(order, 1):
            excluded.append({"row": int(i), "loss": float(loss[i]),
                             "reason": f"exclude_top_loss={cfg.exclude_top_loss}: loss rank {rank} (highest first)"})
    return keep, excluded


def _distinct(thetas: np.ndarray, objectives: np.ndarray, k: int) -> np.ndarray:
    """Up to ``k`` best distinct optima (differing by > 1e-3 in some coordinate), best first."""
    order = np.argsort(objectives)
    chosen: list[np.ndarray] = []
    for i in order:
        if not np.isfinite(objectives[i]):
            continue
        if all(np.max(np.abs(thetas[i] - c)) > 1e-3 for c in chosen):
            chosen.append(thetas[i])
        if len(chosen) >= k:
            break
    return np.array(chosen).reshape(-1, 5)


def _fit_warnings(theta: np.ndarray, N: np.ndarray, loss: np.ndarray, cfg: FitConfig) -> list[str]:
    out = []
    decades = float(np.log10(N.max() / N.min())) if len(N) else 0.0
    if len(N) < cfg.min_points:
        out.append(f"only {len(N)} points (< min_points={cfg.min_points}); the fit is underdetermined")
    if decades < cfg.min_n_decades:
        out.append(f"N spans {decades:.2f} decades (< {cfg.min_n_decades}); alpha and beta are nearly "
                   "unidentifiable (strongly correlated) — do not read the exponents as confident")
    for name, value, (lo, hi) in zip(THETA_NAMES, theta, _bounds(cfg)):
        tol = 1e-6 * (hi - lo)
        if value <= lo + tol or value >= hi - tol:
            out.append(f"{name} = {value:.6g} is at its bound ({lo}, {hi})")
    E = math.exp(theta[2])
    if len(loss) and E > loss.min():
        out.append(f"E = {E:.4g} exceeds the smallest observed loss {loss.min():.4g}")
    return out


def fit_chinchilla(N, D, loss, cfg: FitConfig) -> ChinchillaFit:
    """Fit ``L = E + A/N^alpha + B/D^beta`` by Approach 3 (Hoffmann et al. 2022, eq. in §3.3).

    ``N`` parameters, ``D`` tokens, ``loss`` final loss: arrays of shape (n,).
    The objective is evaluated at every point of the config's initial grid (vectorised);
    L-BFGS-B with the analytic gradient runs from the ``cfg.n_starts`` best grid points
    (every grid point when 0) and the lowest optimum is kept.

    >>> fit = fit_chinchilla(N, D, loss, FitConfig(exclude_top_loss=5))
    >>> fit.alpha, fit.beta
    """
    N, D, loss = _as_arrays(N, D, loss)
    keep, excluded = select_points(loss, cfg)
    Nk, Dk, Lk = N[keep], D[keep], loss[keep]
    if len(Nk) < 5:
        raise ValueError(f"Approach 3 has 5 parameters and needs at least 5 points, got {len(Nk)} "
                         f"after excluding {len(excluded)}")
    args = (np.log(Nk), np.log(Dk), np.log(Lk), cfg.huber_delta)
    grid = initial_grid(cfg)
    grid_f = grid_objective(grid, *args)
    n_starts = len(grid) if cfg.n_starts == 0 else min(cfg.n_starts, len(grid))
    starts = grid[np.argsort(grid_f, kind="stable")[:n_starts]]
    bounds = _bounds(cfg)
    thetas = np.empty((n_starts, 5))
    objs = np.full(n_starts, np.inf)
    ok = np.zeros(n_starts, dtype=bool)
    with single_threaded_blas():
        for i, t0 in enumerate(starts):
            res = _lbfgs(t0, args, cfg, bounds)
            thetas[i], objs[i], ok[i] = res.x, res.fun, res.success
    best = int(np.argmin(objs))
    theta = thetas[best]
    resid = np.logaddexp(np.logaddexp(theta[0] - theta[3] * args[0], theta[1] - theta[4] * args[1]),
                         theta[2]) - args[2]
    warnings = _fit_warnings(theta, Nk, Lk, cfg)
    if not ok[best]:
        warnings.append("L-BFGS-B did not report convergence at the best start")
    E, A, B, alpha, beta = theta_to_params(theta)
    return ChinchillaFit(
        E=float(E), A=float(A), B=float(B), alpha=float(alpha), beta=float(beta), theta=theta.copy(),
        objective=float(objs[best]), rmse_log=float(np.sqrt(np.mean(resid**2))), n_points=int(len(Nk)),
        n_decades_n=float(np.log10(Nk.max() / Nk.min())), n_starts=n_starts, converged=bool(ok[best]),
        excluded=excluded, warnings=warnings,
        local_optima=_distinct(thetas, objs, 4),
    )


# --------------------------------------------------------------------------- bootstrap


def bootstrap_starts(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, spread: float) -> np.ndarray:
    """The point estimate plus the 4 corners of a small grid around it, shape (1 or 5, 5).

    Corners scale alpha and beta by ``1 -/+ spread``; a and b shift by ``d_alpha * mean(log N)``
    (``d_beta * mean(log D)``) so A/N^alpha and B/D^beta keep their value at the data's centre,
    which keeps every start near the data instead of on a plateau where one term vanishes.
    """
    theta = np.asarray(theta, dtype=float)
    if spread == 0:
        return theta[None, :]
    out = [theta]
    for fa in (1 - spread, 1 + spread):
        for fb in (1 - spread, 1 + spread):
            t = theta.copy()
            t[3], t[4] = theta[3] * fa, theta[4] * fb
            t[0] += (t[3] - theta[3]) * log_n.mean()
            t[1] += (t[4] - theta[4]) * log_d.mean()
            out.append(t)
    return np.array(out)


def _bootstrap_chunk(log_n, log_d, log_loss, counts, starts, cfg: FitConfig):
    """Refit for each row of ``counts`` (multiplicities of each run) from every start.

    Returns thetas (k, 5), objectives (k,) and the index of the winning start (k,).
    """
    bounds = _bounds(cfg)
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    starts = np.clip(starts, lo, hi)
    thetas = np.full((len(counts), 5), np.nan)
    objs = np.full(len(counts), np.nan)
    winner = np.full(len(counts), -1)
    with single_threaded_blas():
        for j, c in enumerate(counts):
            used = c > 0  # resampling with replacement == weighting each run by its multiplicity
            args = (log_n[used], log_d[used], log_loss[used], cfg.huber_delta, c[used].astype(float))
            best, best_k = None, -1
            for k, t0 in enumerate(starts):
                res = _lbfgs(t0, args, cfg, bounds)
                # a start must beat the incumbent by more than rounding to count as another basin
                if np.isfinite(res.fun) and (best is None or res.fun < best.fun * (1 - 1e-9)):
                    best, best_k = res, k
            if best is not None:
                thetas[j], objs[j], winner[j] = best.x, best.fun, best_k
    return thetas, objs, winner


def derived_samples(samples: np.ndarray) -> dict[str, np.ndarray]:
    """Allocation exponents and G from (k, 5) samples of (E, A, B, alpha, beta).

    ``a_exp = beta/(alpha+beta)`` (N* ∝ C^a_exp), ``b_exp = alpha/(alpha+beta)``,
    ``G = (alpha A / (beta B))^(1/(alpha+beta))`` (Hoffmann et al. 2022, eq. 4).
    """
    _, A, B, alpha, beta = samples.T
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = alpha + beta
        G = np.exp((np.log(alpha * A) - np.log(beta * B)) / s)
        return {"a_exp": beta / s, "b_exp": alpha / s, "G": G}


def percentile_interval(x: np.ndarray, confidence: float) -> tuple[float, float]:
    x = np.asarray(x, dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return (float("nan"), float("nan"))
    q = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(x, [q, 100 - q])
    return (float(lo), float(hi))


def bootstrap_chinchilla(N, D, loss, cfg: FitConfig, *, fit: ChinchillaFit | None = None) -> BootstrapResult:
    """Percentile intervals by resampling runs with replacement (``cfg.n_bootstrap`` replicates).

    Each replicate is refitted with L-BFGS-B from the point estimate and the 4 corners of a
    small grid around it (:func:`bootstrap_starts`), keeping the lowest objective. Replicates are
    drawn as multinomial run multiplicities, all in this process from ``cfg.bootstrap_seed``, so
    results do not depend on ``cfg.n_jobs``; they are split over ``cfg.n_jobs`` processes.
    ``n_basin_switch`` in the result counts replicates won by a start other than the estimate.
    """
    N, D, loss = _as_arrays(N, D, loss)
    if fit is None:
        fit = fit_chinchilla(N, D, loss, cfg)
    keep, _ = select_points(loss, cfg)
    log_n, log_d, log_loss = np.log(N[keep]), np.log(D[keep]), np.log(loss[keep])
    n = len(log_n)
    rng = np.random.default_rng(cfg.bootstrap_seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=cfg.n_bootstrap)
    starts = bootstrap_starts(fit.theta, log_n, log_d, cfg.bootstrap_start_spread)
    n_jobs = max(1, min(cfg.n_jobs, cfg.n_bootstrap))
    if cfg.n_bootstrap == 0:
        thetas, objs, winner = np.empty((0, 5)), np.empty(0), np.empty(0, dtype=int)
    elif n_jobs == 1:
        thetas, objs, winner = _bootstrap_chunk(log_n, log_d, log_loss, counts, starts, cfg)
    else:
        chunks = np.array_split(counts, n_jobs * 4)
        # spawn, not fork: the parent may hold polars/BLAS thread pools that fork would copy locked.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=ctx) as pool:
            parts = list(pool.map(_bootstrap_chunk, *zip(*[(log_n, log_d, log_loss, c, starts, cfg)
                                                           for c in chunks])))
        thetas = np.concatenate([p[0] for p in parts])
        objs = np.concatenate([p[1] for p in parts])
        winner = np.concatenate([p[2] for p in parts])
    ok = np.isfinite(objs)
    samples = theta_to_params(thetas[ok])
    intervals = {name: percentile_interval(samples[:, k], cfg.confidence) for k, name in enumerate(PARAM_NAMES)}
    for name, values in derived_samples(samples).items():
        intervals[name] = percentile_interval(values, cfg.confidence)
    warnings = []
    n_failed = int((~ok).sum())
    if n_failed:
        warnings.append(f"{n_failed} of {cfg.n_bootstrap} bootstrap replicates failed to fit")
    if cfg.n_bootstrap and len(samples):
        lo_b = np.array([b[0] for b in _bounds(cfg)])
        hi_b = np.array([b[1] for b in _bounds(cfg)])
        tol = 1e-6 * (hi_b - lo_b)
        at_bound = ((thetas[ok] <= lo_b + tol) | (thetas[ok] >= hi_b - tol)).mean(axis=0)
        for name, frac in zip(THETA_NAMES, at_bound):
            if frac > 0:
                warnings.append(f"{name} is at its bound in {100 * frac:.1f}% of bootstrap replicates")
    return BootstrapResult(point=fit, samples=samples, objectives=objs[ok], confidence=cfg.confidence,
                           intervals=intervals, n_requested=cfg.n_bootstrap, n_failed=n_failed,
                           warnings=warnings, n_basin_switch=int((winner[ok] > 0).sum()))
