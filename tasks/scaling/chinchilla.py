"""Approach 3 of Hoffmann et al. (2022), "Training Compute-Optimal Large Language Models"
(arXiv:2203.15556), as replicated by Epoch AI (Besiroglu, Erdil, Barnett & You 2024, "Chinchilla
Scaling: A replication attempt").

The parametric loss is ``L(N, D) = E + A / N**alpha + B / D**beta``. With ``a = log A``,
``b = log B``, ``e = log E`` it is fitted by minimising::

    sum_i  Huber_delta( LSE(a - alpha log N_i,  b - beta log D_i,  e) - log L_i )

from a grid of starts; intervals come from a bootstrap over runs. The default optimiser
(``FitConfig.optimizer = "batched"``) is a damped Newton method with the exact 5x5 Hessian run on
every start (and every bootstrap replicate x start) at once in numpy; rows it does not certify
as converged are finished by L-BFGS-B, which ``optimizer = "scipy"`` uses throughout.
Parameter vectors are ordered ``theta = (a, b, e, alpha, beta)`` throughout.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from tasks.common.parallel import single_threaded_blas
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


def huber_objective_batched(thetas: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                            delta: float, weights: np.ndarray | None = None
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The objective, its gradient and its Hessian at many parameter vectors at once.

    ``thetas`` (B, 5); ``weights`` None, (n,) or (B, n) (row k weights problem k). Returns
    ``f`` (B,), ``grad`` (B, 5) and ``hess`` (B, 5, 5), as :func:`huber_objective` per row.
    With ``J_i = grad r_i = sum_k p_k g_k`` (``g_1 = (1, 0, 0, -log N, 0)``,
    ``g_2 = (0, 1, 0, 0, -log D)``, ``g_3 = (0, 0, 1, 0, 0)``: the LSE terms are linear in theta),
    ``hess = sum_i w_i [H''(r_i) J_i J_i^T + psi_i (sum_k p_k g_k g_k^T - J_i J_i^T)]`` where
    ``H''(r) = 1`` for ``|r| <= delta`` else 0 (Huber is piecewise quadratic/linear in r).
    """
    thetas = np.asarray(thetas, dtype=float)
    a, b, e, alpha, beta = (thetas[:, k:k + 1] for k in range(5))
    t1 = a - alpha * log_n
    t2 = b - beta * log_d
    m = np.maximum(np.maximum(t1, t2), e)
    x1 = np.exp(t1 - m)
    x2 = np.exp(t2 - m)
    x3 = np.exp(e - m)
    s = x1 + x2 + x3
    r = m + np.log(s) - log_loss
    psi = np.clip(r, -delta, delta)
    w = np.ones_like(r) if weights is None else np.broadcast_to(weights, r.shape)
    f = (w * (psi * (r - 0.5 * psi))).sum(axis=1)
    p1, p2, p3 = x1 / s, x2 / s, x3 / s
    v = w * psi
    u = w * ((np.abs(r) <= delta) - psi)
    # Every entry is sum_i c_i * phi_i for a product c of p's and a feature phi in
    # {1, log N, log D, log^2 N, log N log D, log^2 D}: one (B, n) @ (n, k) product per c.
    one = np.ones_like(log_n)
    feat_n = np.stack([one, log_n, log_n**2], axis=1)
    feat_d = np.stack([one, log_d, log_d**2], axis=1)
    up1, up2 = u * p1, u * p2
    s11 = (up1 * p1 + v * p1) @ feat_n  # (B, 3): a-a, a-alpha, alpha-alpha
    s22 = (up2 * p2 + v * p2) @ feat_d
    s33 = (u * p3 * p3 + v * p3).sum(axis=1)
    s12 = (up1 * p2) @ np.stack([one, log_n, log_d, log_n * log_d], axis=1)
    s13 = (up1 * p3) @ feat_n[:, :2]
    s23 = (up2 * p3) @ feat_d[:, :2]
    g1 = (v * p1) @ feat_n[:, :2]
    g2 = (v * p2) @ feat_d[:, :2]
    grad = np.stack([g1[:, 0], g2[:, 0], (v * p3).sum(axis=1), -g1[:, 1], -g2[:, 1]], axis=1)
    hess = np.empty((len(thetas), 5, 5))
    entries = {(0, 0): s11[:, 0], (0, 3): -s11[:, 1], (3, 3): s11[:, 2],
               (1, 1): s22[:, 0], (1, 4): -s22[:, 1], (4, 4): s22[:, 2], (2, 2): s33,
               (0, 1): s12[:, 0], (0, 4): -s12[:, 2], (1, 3): -s12[:, 1], (3, 4): s12[:, 3],
               (0, 2): s13[:, 0], (2, 3): -s13[:, 1], (1, 2): s23[:, 0], (2, 4): -s23[:, 1]}
    for (j, k), val in entries.items():
        hess[:, j, k] = val
        hess[:, k, j] = val
    return f, grad, hess


def _newton_step(grad: np.ndarray, hess: np.ndarray, lam: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Damped Newton steps for a batch: ``(B, 5)`` steps, Newton decrements, PD and finite flags.

    The Hessian is scaled to unit diagonal (``a`` and ``alpha`` differ in scale by ~log N), its
    eigenvalues replaced by ``|lambda_k| + lam`` (negative curvature flipped so the step always
    descends — Levenberg–Marquardt damping in the scaled space). The decrement
    ``g^T H^-1 g`` (undamped, meaningful only where ``pd``) is twice the predicted decrease.
    """
    diag = np.abs(np.diagonal(hess, axis1=1, axis2=2))
    # A relative floor: an (almost) zero diagonal beside large entries would overflow the scaling.
    d = np.sqrt(np.maximum(diag, 1e-12 * diag.max(axis=1, keepdims=True) + 1e-300))
    hs = hess / (d[:, :, None] * d[:, None, :])
    gs = grad / d
    # Rows whose Hessian or gradient is not finite (overflow far from the data) get no step and
    # no PD flag: the caller stops them and hands them to L-BFGS-B. eigh would fail on them.
    finite = np.isfinite(hs).all(axis=(1, 2)) & np.isfinite(gs).all(axis=1)
    hs = np.where(finite[:, None, None], hs, np.eye(hess.shape[1]))
    gs = np.where(finite[:, None], gs, 0.0)
    d = np.where(finite[:, None], d, 1.0)
    ev, vec = np.linalg.eigh(hs)
    top = np.abs(ev).max(axis=1, keepdims=True)
    pd = ev.min(axis=1) > 1e-13 * top[:, 0]
    ev_abs = np.maximum(np.abs(ev), 1e-13 * top)
    gq = np.einsum("bji,bj->bi", vec, gs)
    step = -np.einsum("bij,bj->bi", vec, gq / (ev_abs + lam[:, None])) / d
    decrement = (gq**2 / ev_abs).sum(axis=1)
    return step, decrement, pd & finite, finite


def minimise_batched(starts: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                     delta: float, weights: np.ndarray | None, lo: np.ndarray, hi: np.ndarray,
                     max_iter: int = 300) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimise the Approach-3 objective from every row of ``starts`` (B, 5) at once.

    Damped (Levenberg–Marquardt) projected Newton (Bertsekas 1982) with the exact Hessian of
    :func:`huber_objective_batched`, iterates clipped to the box ``[lo, hi]``: a coordinate at a
    bound whose gradient pushes outward is held there (the active set) and the Newton step is
    taken in the others; a step is kept when it satisfies Armijo's sufficient decrease, after
    which the damping shrinks; otherwise the damping grows and the step is retried.
    ``weights``: None, (n,) or (B, n).

    A row is certified converged at a KKT point: the Hessian reduced to the free coordinates is
    positive definite, their Newton decrement ``g^T H^-1 g <= 1e-13 f`` (the objective is within
    ~1e-13 relative of the local minimum on the face), and every held coordinate's gradient
    points out of the box. Small ladders often put ``e`` at its lower bound (E is not
    identified), so certifying on a face keeps those fits out of the slow L-BFGS-B path. Rows
    stopped otherwise — singular on the face, by the damping cap or ``max_iter`` — return their
    best iterate with ``converged`` False, for the caller to finish with L-BFGS-B.
    Returns ``thetas`` (B, 5), ``objectives`` (B,), ``converged`` (B,).
    """
    theta = np.clip(np.asarray(starts, dtype=float), lo, hi)
    B = len(theta)
    w = None if weights is None else np.broadcast_to(weights, (B, len(log_n)))
    wsum = np.full(B, float(len(log_n))) if w is None else w.sum(axis=1)
    f, g, h = huber_objective_batched(theta, log_n, log_d, log_loss, delta, w)
    lam = np.full(B, 1e-3)
    running = np.isfinite(f)
    converged = np.zeros(B, dtype=bool)
    margin = 1e-9 * (hi - lo)
    for _ in range(max_iter):
        idx = np.flatnonzero(running)
        if idx.size == 0:
            break
        th, gi = theta[idx], g[idx]
        held = ((th <= lo + margin) & (gi > 0)) | ((th >= hi - margin) & (gi < 0))
        # Newton on the free coordinates: held rows/columns become identity with zero gradient.
        free = ~held
        h_face = np.where(free[:, :, None] & free[:, None, :], h[idx], 0.0)
        h_face[:, np.arange(5), np.arange(5)] += held
        step, dec, pd, finite = _newton_step(np.where(held, 0.0, gi), h_face, lam[idx])
        running[idx[~finite]] = False  # overflowed: left to L-BFGS-B
        idx, step, dec, pd = idx[finite], step[finite], dec[finite], pd[finite]
        if idx.size == 0:
            break
        # 1e-13 relative; the absolute floor covers exact fits (f* = 0)
        done = pd & (dec <= 1e-13 * f[idx] + 1e-28 * wsum[idx])
        converged[idx[done]] = True
        running[idx[done]] = False
        keep = ~done
        idx, step = idx[keep], step[keep]
        if idx.size == 0:
            break
        trial = np.clip(theta[idx] + step, lo, hi)
        ft, gt, ht = huber_objective_batched(trial, log_n, log_d, log_loss, delta,
                                             None if w is None else w[idx])
        slope = np.einsum("bi,bi->b", g[idx], trial - theta[idx])
        ok = np.isfinite(ft) & (ft <= f[idx] + 1e-4 * slope) & (ft < f[idx])
        acc = idx[ok]
        theta[acc], f[acc], g[acc], h[acc] = trial[ok], ft[ok], gt[ok], ht[ok]
        lam[acc] = np.where(lam[acc] < 1e-9, 0.0, lam[acc] * 0.2)
        rej = idx[~ok]
        lam[rej] = np.maximum(lam[rej] * 10.0, 1e-6)
        running[rej[lam[rej] > 1e12]] = False  # no descent left at any damping: a bound or rounding
    return theta, f, converged


def initial_grid(cfg: FitConfig) -> np.ndarray:
    """Every combination of the config's grid values, shape (grid_size, 5) in theta order."""
    mesh = np.meshgrid(cfg.grid_a, cfg.grid_b, cfg.grid_e, cfg.grid_alpha, cfg.grid_beta, indexing="ij")
    return np.stack([m.ravel() for m in mesh], axis=1).astype(float)


def _bounds(cfg: FitConfig) -> list[tuple[float, float]]:
    return [cfg.bound_a, cfg.bound_b, cfg.bound_e, cfg.bound_alpha, cfg.bound_beta]


def _lbfgs(theta0: np.ndarray, args: tuple, cfg: FitConfig, bounds: list[tuple[float, float]]):
    return minimize(huber_objective, theta0, args=args, jac=True, method="L-BFGS-B", bounds=bounds,
                    options={"ftol": cfg.lbfgs_ftol, "gtol": cfg.lbfgs_gtol, "maxiter": cfg.lbfgs_maxiter})


def minimise_starts(starts: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                    cfg: FitConfig, weights: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimise the objective from each row of ``starts`` (B, 5) with ``cfg.optimizer``.

    ``weights``: None or (B, n) bootstrap multiplicities, row k for start k. "scipy" runs
    L-BFGS-B from every start; "batched" runs :func:`minimise_batched` on all rows at once and
    finishes the rows it does not certify with L-BFGS-B from where it stopped.
    Returns ``thetas`` (B, 5), ``objectives`` (B,) and ``converged`` (B,).
    """
    bounds = _bounds(cfg)
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    starts = np.clip(np.asarray(starts, dtype=float), lo, hi)
    B = len(starts)
    thetas, objs, ok = starts.copy(), np.full(B, np.inf), np.zeros(B, dtype=bool)
    with single_threaded_blas():
        if cfg.optimizer == "batched" and B:
            thetas, objs, ok = minimise_batched(starts, log_n, log_d, log_loss, cfg.huber_delta, weights,
                                                lo, hi, cfg.newton_maxiter)
        for k in np.flatnonzero(~ok):
            if weights is None:
                args = (log_n, log_d, log_loss, cfg.huber_delta)
            else:
                used = weights[k] > 0  # resampling with replacement == weighting runs by multiplicity
                args = (log_n[used], log_d[used], log_loss[used], cfg.huber_delta, weights[k, used].astype(float))
            res = _lbfgs(thetas[k], args, cfg, bounds)
            if not np.isfinite(objs[k]) or res.fun <= objs[k]:
                thetas[k], objs[k] = res.x, res.fun
            ok[k] = res.success
    return thetas, objs, ok


# --------------------------------------------------------------------------- results


@dataclass
class ChinchillaFit:
    """A point estimate of ``L(N, D) = E + A/N^alpha + B/D^beta`` (Approach 3).

    ``objective`` is the Huber sum at the optimum; ``rmse_log`` the RMSE of log-loss residuals.
    ``excluded`` lists dropped input rows (index into the arrays given) with the reason;
    ``local_optima`` (k, 5) holds the best distinct optima the optimiser reached from the starts
    (theta order, best first; up to 4) — a diagnostic of how many basins the grid found —
    with their objectives ``local_optima_objectives`` (k,) and ``local_optima_starts`` (k,),
    the number of starts that ended in each.
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
    local_optima_objectives: np.ndarray = field(default_factory=lambda: np.empty(0))
    local_optima_starts: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=int))

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

    ``samples`` (n_requested, 5): columns E, A, B, alpha, beta of replicate i in row i, NaN where
    the replicate failed, so row i is the same resample for every law fitted on the same
    ladder (see :func:`resample_keys`); ``objectives`` (n_requested,) likewise.
    ``intervals``: percentile interval at ``confidence`` over the finite rows, for those and for
    the derived ``a_exp = beta/(alpha+beta)`` (N* ∝ C^a_exp), ``b_exp = alpha/(alpha+beta)``
    and ``G``. ``keys`` (K, 2) are the distinct (N, D) runs resampled, sorted; ``counts``
    (n_requested, K) their multiplicities per replicate; ``n_redrawn`` how many draws were
    rejected as degenerate; ``at_bound`` (n_requested, 5) whether each theta coordinate
    ended on its box bound.
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
    keys: np.ndarray = field(default_factory=lambda: np.empty((0, 2)))
    counts: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=int))
    n_redrawn: int = 0
    at_bound: np.ndarray = field(default_factory=lambda: np.empty((0, 5), dtype=bool))

    def column(self, name: str) -> np.ndarray:
        return self.samples[:, PARAM_NAMES.index(name)]

    @property
    def n_ok(self) -> int:
        return int(np.isfinite(self.objectives).sum())


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


def _distinct(thetas: np.ndarray, objectives: np.ndarray, k: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Up to ``k`` best distinct optima (differing by > 1e-3 in some coordinate), best first.

    Returns their thetas (m, 5), objectives (m,) and how many of the given optima lie within
    1e-3 of each (m,), i.e. how many starts ended in that basin.
    """
    order = np.argsort(objectives)
    chosen: list[int] = []
    for i in order:
        if not np.isfinite(objectives[i]):
            continue
        if all(np.max(np.abs(thetas[i] - thetas[c])) > 1e-3 for c in chosen):
            chosen.append(int(i))
        if len(chosen) >= k:
            break
    basins = thetas[chosen].reshape(-1, 5)
    finite = np.isfinite(objectives)
    starts = np.array([int((np.max(np.abs(thetas[finite] - b), axis=1) <= 1e-3).sum()) for b in basins], dtype=int)
    return basins, objectives[chosen].astype(float), starts


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
    the optimiser (``cfg.optimizer``: batched damped Newton finished by L-BFGS-B where it does not
    certify convergence, or L-BFGS-B alone) runs from the ``cfg.n_starts`` best grid points
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
    thetas, objs, ok = minimise_starts(starts, *args[:3], cfg)
    best = int(np.argmin(objs))
    theta = thetas[best]
    resid = np.logaddexp(np.logaddexp(theta[0] - theta[3] * args[0], theta[1] - theta[4] * args[1]),
                         theta[2]) - args[2]
    warnings = _fit_warnings(theta, Nk, Lk, cfg)
    if not ok[best]:
        warnings.append("the optimiser did not report convergence at the best start")
    E, A, B, alpha, beta = theta_to_params(theta)
    basins, basin_objs, basin_starts = _distinct(thetas, objs, 4)
    return ChinchillaFit(
        E=float(E), A=float(A), B=float(B), alpha=float(alpha), beta=float(beta), theta=theta.copy(),
        objective=float(objs[best]), rmse_log=float(np.sqrt(np.mean(resid**2))), n_points=int(len(Nk)),
        n_decades_n=float(np.log10(Nk.max() / Nk.min())), n_starts=n_starts, converged=bool(ok[best]),
        excluded=excluded, warnings=warnings,
        local_optima=basins, local_optima_objectives=basin_objs, local_optima_starts=basin_starts,
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


def run_keys(N: np.ndarray, D: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (N, D) runs, sorted (K, 2), and each row's key index (n,).

    Rows sharing (N, D) — repeated seeds of one run, or one run's loss read twice — are one unit
    of the bootstrap: resampling them separately would treat correlated rows as independent.
    """
    keys, inverse = np.unique(np.stack([np.asarray(N, float), np.asarray(D, float)], axis=1),
                              axis=0, return_inverse=True)
    return keys, np.asarray(inverse).ravel()


def resample_keys(keys: np.ndarray, n_replicates: int, seed: int, *, min_distinct_n: int = 2,
                  min_distinct_d: int = 2, min_distinct_points: int = 5, max_draws: int = 1000
                  ) -> tuple[np.ndarray, int, np.ndarray]:
    """Bootstrap multiplicities of the sorted run keys (K, 2): ``counts`` (n_replicates, K).

    Replicate i draws ``multinomial(K, 1/K)`` from ``np.random.default_rng([seed, i])`` until
    the drawn keys hold at least ``min_distinct_n`` distinct N, ``min_distinct_d`` distinct D and
    ``min_distinct_points`` distinct keys (thresholds capped at what ``keys`` itself holds), so
    replicate i is a function of (seed, i, keys) alone: two laws fitted on the same ladder get
    the same resample in replicate i (common random numbers, which pair their differences).
    Returns ``counts``, the number of rejected (redrawn) draws, and ``failed`` (n_replicates,)
    where ``max_draws`` draws all degenerated (counts left 0).
    """
    K = len(keys)
    n_idx = np.unique(keys[:, 0], return_inverse=True)[1].ravel()
    d_idx = np.unique(keys[:, 1], return_inverse=True)[1].ravel()
    need_n = min(min_distinct_n, int(n_idx.max(initial=-1)) + 1)
    need_d = min(min_distinct_d, int(d_idx.max(initial=-1)) + 1)
    need_p = min(min_distinct_points, K)
    counts = np.zeros((n_replicates, K), dtype=np.int64)
    failed = np.zeros(n_replicates, dtype=bool)
    n_redrawn = 0
    if K == 0:
        return counts, 0, ~failed
    p = np.full(K, 1.0 / K)
    for i in range(n_replicates):
        rng = np.random.default_rng([seed, i])
        for _ in range(max_draws):
            c = rng.multinomial(K, p)
            used = c > 0
            if (used.sum() >= need_p and len(np.unique(n_idx[used])) >= need_n
                    and len(np.unique(d_idx[used])) >= need_d):
                counts[i] = c
                break
            n_redrawn += 1
        else:
            failed[i] = True
    return counts, n_redrawn, failed


def bootstrap_grid_starts(grid: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray,
                          delta: float, weights: np.ndarray, k: int, chunk: int = 512) -> np.ndarray:
    """The ``k`` best grid points (G, 5) on each replicate's weighted objective: (R, k, 5).

    The per-point Huber terms at the grid do not depend on the weights, so every replicate's
    ranking is one (G, n) @ (n, R) product instead of R passes over the grid.
    """
    G, R = len(grid), len(weights)
    k = min(k, G)
    if k == 0 or R == 0:
        return np.empty((R, 0, 5))
    wt = np.asarray(weights, dtype=float).T  # (n, R)
    f = np.empty((G, R))
    for lo in range(0, G, chunk):
        th = grid[lo:lo + chunk]
        a, b, e, alpha, beta = (th[:, j:j + 1] for j in range(5))
        t1 = a - alpha * log_n
        t2 = b - beta * log_d
        m = np.maximum(np.maximum(t1, t2), e)
        r = m + np.log(np.exp(t1 - m) + np.exp(t2 - m) + np.exp(e - m)) - log_loss
        psi = np.clip(r, -delta, delta)
        f[lo:lo + chunk] = (psi * (r - 0.5 * psi)) @ wt
    best = np.argpartition(f, k - 1, axis=0)[:k] if k < G else np.tile(np.arange(G)[:, None], (1, R))
    order = np.argsort(np.take_along_axis(f, best, axis=0), axis=0, kind="stable")
    best = np.take_along_axis(best, order, axis=0)  # (k, R), best first
    return grid[best.T]


def _bootstrap_chunk(log_n, log_d, log_loss, weights, starts, cfg: FitConfig):
    """Refit for each row of ``weights`` (k, n) (run multiplicities) from its starts (k, S, 5).

    Returns thetas (k, 5), objectives (k,) and the index of the winning start (k,); rows whose
    every start failed stay NaN (and -1).
    """
    k, S = starts.shape[:2]
    thetas = np.full((k, 5), np.nan)
    objs = np.full(k, np.nan)
    winner = np.full(k, -1)
    # every (replicate, start) pair is one row of a batched problem; 2,000 rows x 250 points
    # keep the batched optimiser's (rows, points) buffers near 4 MB each
    per_batch = max(1, 2000 // S)
    for lo_r in range(0, k, per_batch):
        c = weights[lo_r:lo_r + per_batch].astype(float)
        th, f, _ = minimise_starts(starts[lo_r:lo_r + per_batch].reshape(-1, 5), log_n, log_d, log_loss, cfg,
                                   weights=np.repeat(c, S, axis=0))
        th, f = th.reshape(len(c), S, 5), f.reshape(len(c), S)
        for j in range(len(c)):
            best_k = -1
            for s_k in range(S):
                # a start must beat the incumbent by more than rounding to count as another basin
                if np.isfinite(f[j, s_k]) and (best_k < 0 or f[j, s_k] < f[j, best_k] * (1 - 1e-9)):
                    best_k = s_k
            if best_k >= 0:
                thetas[lo_r + j], objs[lo_r + j], winner[lo_r + j] = th[j, best_k], f[j, best_k], best_k
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


def at_bound(thetas: np.ndarray, cfg: FitConfig) -> np.ndarray:
    """Whether each coordinate of ``thetas`` (..., 5) lies on its box bound (within 1e-6 of the box)."""
    lo_b = np.array([b[0] for b in _bounds(cfg)])
    hi_b = np.array([b[1] for b in _bounds(cfg)])
    tol = 1e-6 * (hi_b - lo_b)
    thetas = np.asarray(thetas, dtype=float)
    return (thetas <= lo_b + tol) | (thetas >= hi_b - tol)


def bootstrap_chinchilla(N, D, loss, cfg: FitConfig, *, fit: ChinchillaFit | None = None) -> BootstrapResult:
    """Percentile intervals by resampling runs with replacement (``cfg.n_bootstrap`` replicates),
    the interval method of Epoch AI's replication of Hoffmann et al. (2022) Approach 3.

    The unit resampled is a distinct (N, D) run (:func:`run_keys`); replicate i's multiplicities
    come from :func:`resample_keys` (seeded by ``(cfg.bootstrap_seed, i)``, degenerate draws —
    too few distinct N, D or points — redrawn and counted in ``n_redrawn``). Each replicate is
    refitted (with ``cfg.optimizer``, all replicates x starts of a chunk in one batch) from the
    point estimate, the 4 corners of a small grid around it (:func:`bootstrap_starts`) and the
    ``cfg.bootstrap_n_starts`` best initial-grid points on that replicate's own objective
    (:func:`bootstrap_grid_starts`), keeping the lowest objective. Replicates are split over
    ``cfg.n_jobs`` processes; results do not depend on it. ``n_basin_switch`` counts replicates
    won by a start other than the estimate. Failed replicates stay as NaN rows.
    """
    N, D, loss = _as_arrays(N, D, loss)
    if fit is None:
        fit = fit_chinchilla(N, D, loss, cfg)
    keep, _ = select_points(loss, cfg)
    log_n, log_d, log_loss = np.log(N[keep]), np.log(D[keep]), np.log(loss[keep])
    keys, inverse = run_keys(N[keep], D[keep])
    counts, n_redrawn, degenerate = resample_keys(
        keys, cfg.n_bootstrap, cfg.bootstrap_seed, min_distinct_n=cfg.bootstrap_min_distinct_n,
        min_distinct_d=cfg.bootstrap_min_distinct_d, min_distinct_points=cfg.bootstrap_min_distinct_points)
    weights = counts[:, inverse]  # (R, n): every row of a run carries the run's multiplicity
    local = bootstrap_starts(fit.theta, log_n, log_d, cfg.bootstrap_start_spread)
    todo = np.flatnonzero(~degenerate)
    grid_starts = bootstrap_grid_starts(initial_grid(cfg), log_n, log_d, log_loss, cfg.huber_delta,
                                        weights[todo], cfg.bootstrap_n_starts)
    starts = np.concatenate([np.broadcast_to(local, (len(todo), *local.shape)), grid_starts], axis=1)
    thetas = np.full((cfg.n_bootstrap, 5), np.nan)
    objs = np.full(cfg.n_bootstrap, np.nan)
    winner = np.full(cfg.n_bootstrap, -1)
    n_jobs = max(1, min(cfg.n_jobs, len(todo)))
    if len(todo) == 0:
        parts = []
    elif n_jobs == 1:
        parts = [_bootstrap_chunk(log_n, log_d, log_loss, weights[todo], starts, cfg)]
    else:
        pieces = np.array_split(np.arange(len(todo)), n_jobs * 4)
        # spawn, not fork: the parent may hold polars/BLAS thread pools that fork would copy locked.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=n_jobs, mp_context=ctx) as pool:
            parts = list(pool.map(_bootstrap_chunk, *zip(*[(log_n, log_d, log_loss, weights[todo[p]], starts[p], cfg)
                                                           for p in pieces])))
    if parts:
        thetas[todo] = np.concatenate([p[0] for p in parts])
        objs[todo] = np.concatenate([p[1] for p in parts])
        winner[todo] = np.concatenate([p[2] for p in parts])
    ok = np.isfinite(objs)
    samples = theta_to_params(thetas)  # NaN rows stay NaN
    intervals = {name: percentile_interval(samples[:, k], cfg.confidence) for k, name in enumerate(PARAM_NAMES)}
    for name, values in derived_samples(samples).items():
        intervals[name] = percentile_interval(values, cfg.confidence)
    warnings = []
    n_failed = int((~ok).sum())
    if n_failed:
        warnings.append(f"{n_failed} of {cfg.n_bootstrap} bootstrap replicates failed to fit "
                        f"({int(degenerate.sum())} could not be drawn non-degenerate); kept as missing rows")
    n_keys_n, n_keys_d = len(np.unique(keys[:, 0])), len(np.unique(keys[:, 1]))
    if cfg.n_bootstrap and (n_keys_n < cfg.bootstrap_min_distinct_n or n_keys_d < cfg.bootstrap_min_distinct_d
                            or len(keys) < cfg.bootstrap_min_distinct_points):
        warnings.append(f"the data hold {n_keys_n} distinct N, {n_keys_d} distinct D and {len(keys)} distinct runs, "
                        "below the bootstrap's minimums; replicates were required to match the data instead")
    bound = at_bound(thetas, cfg) & ok[:, None]
    if cfg.n_bootstrap and ok.any():
        for name, frac in zip(THETA_NAMES, bound[ok].mean(axis=0)):
            if frac > 0:
                warnings.append(f"{name} is at its bound in {100 * frac:.1f}% of bootstrap replicates")
    return BootstrapResult(point=fit, samples=samples, objectives=objs, confidence=cfg.confidence,
                           intervals=intervals, n_requested=cfg.n_bootstrap, n_failed=n_failed,
                           warnings=warnings, n_basin_switch=int((winner[ok] > 0).sum()),
                           keys=keys, counts=counts, n_redrawn=n_redrawn, at_bound=bound)
