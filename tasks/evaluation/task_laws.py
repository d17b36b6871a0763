"""Task scaling laws: (N, D) -> task loss (bpb of the gold answer) -> accuracy, chained.

Bhagia et al. (2024), "Establishing Task Scaling Laws via Compute-Efficient Model Ladders"
(arXiv:2412.04403, OLMo's ladder), in two steps:

1. per data variant, the gold answer's bits per byte as a Chinchilla law
   ``bpb(N, D) = E + A / N^alpha + B / D^beta`` (their eq. 1 on the task loss), fitted with
   scalelab's Approach-3 fitter (:func:`tasks.scaling.chinchilla.fit_chinchilla`), its bootstrap
   over runs and its identification diagnostics;
2. across every evaluated model, ``acc(bpb) = a / (1 + exp(-k (bpb - b0))) + c`` (their eq. 2), a
   sigmoid from near-chance models to well-trained ones, fitted by least squares (scipy), with a
   bootstrap over models for its band.

The chained prediction for a target (N, D) composes the two with paired bootstrap replicates
(replicate ``i`` of step 1 through replicate ``i`` of step 2), so its interval carries both steps'
uncertainty. :func:`curve_residuals` asks whether compressed and sparsified models sit on the
same bpb -> accuracy curve as the uncompressed ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tasks.common.config import at_least, in_interval, require
from tasks.common.io import atomic_path
from tasks.common.parallel import map_processes
from tasks.scaling.chinchilla import bootstrap_chinchilla, fit_chinchilla
from tasks.scaling.config import FitConfig
from tasks.scaling.diagnostics import identification, law_diagnostics


@dataclass(frozen=True, kw_only=True)
class TaskLawConfig:
    """``n_bootstrap``: replicates of both steps (runs for step 1, models for step 2).
    ``min_sigmoid_points``: models needed before step 2 is fitted (4 parameters).
    ``targets``: (N, D) points to predict, e.g. ``[[1.0e8, 2.0e9]]``; the ladder's largest run is
    always predicted too (an in-range check). ``confidence`` of every interval. ``n_jobs``:
    processes for the step-1 laws (one per task and variant; results do not depend on it)."""

    n_bootstrap: int = 200
    confidence: float = 0.95
    min_sigmoid_points: int = 6
    seed: int = 0
    targets: tuple[tuple[float, float], ...] = ()
    n_jobs: int = 2

    def __post_init__(self) -> None:
        at_least(self.n_bootstrap, 0, "n_bootstrap")
        at_least(self.n_jobs, 1, "n_jobs")
        in_interval(self.confidence, 0, 1, "confidence", "()")
        require(self.min_sigmoid_points >= 4, "min_sigmoid_points", f"must be >= 4 (a, k, b0, c), got {self.min_sigmoid_points}")
        require(all(len(t) == 2 and t[0] > 0 and t[1] > 0 for t in self.targets), "targets",
                f"each must be a positive [N, D] pair, got {list(self.targets)}")


def sigmoid(bpb: np.ndarray, a: float, k: float, b0: float, c: float) -> np.ndarray:
    """``a / (1 + exp(-k (bpb - b0))) + c``; with ``k < 0`` accuracy falls as the task loss grows."""
    z = np.clip(-k * (np.asarray(bpb, dtype=float) - b0), -500, 500)
    return a / (1.0 + np.exp(z)) + c


def _sigmoid_jac(bpb: np.ndarray, a: float, k: float, b0: float, c: float) -> np.ndarray:
    """d sigmoid / d (a, k, b0, c), shape (n, 4): analytic, so a fit costs no finite differences."""
    x = np.asarray(bpb, dtype=float)
    s = 1.0 / (1.0 + np.exp(np.clip(-k * (x - b0), -500, 500)))
    ds = a * s * (1.0 - s)
    return np.stack([s, ds * (x - b0), -ds * k, np.ones_like(x)], axis=1)


@dataclass
class SigmoidFit:
    a: float
    k: float
    b0: float
    c: float
    n_points: int
    rmse: float
    samples: np.ndarray = field(default_factory=lambda: np.empty((0, 4)))  # (R, 4) bootstrap, NaN where failed
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def predict(self, bpb) -> np.ndarray:
        return sigmoid(bpb, self.a, self.k, self.b0, self.c)

    def band(self, bpb, confidence: float) -> tuple[np.ndarray, np.ndarray]:
        """Percentile band of the bootstrap curves at ``bpb`` (NaN when there is no bootstrap)."""
        bpb = np.asarray(bpb, dtype=float)
        ok = np.isfinite(self.samples).all(axis=1)
        if not ok.any():
            return np.full(bpb.shape, np.nan), np.full(bpb.shape, np.nan)
        curves = np.stack([sigmoid(bpb, *s) for s in self.samples[ok]])
        q = [(1 - confidence) / 2, (1 + confidence) / 2]
        lo, hi = np.quantile(curves, q, axis=0)
        return lo, hi

    def to_dict(self) -> dict:
        return {"a": self.a, "k": self.k, "b0": self.b0, "c": self.c, "n_points": self.n_points, "rmse": self.rmse,
                "intervals": {k: list(v) for k, v in self.intervals.items()},
                "n_bootstrap_ok": int(np.isfinite(self.samples).all(axis=1).sum()), "warnings": self.warnings}


# Function evaluations per start: a well-posed 4-parameter fit converges in tens; flat or noisy
# accuracies (tiny models near chance) otherwise wander for thousands of steps without improving.
MAX_NFEV = 400


def _fit_once(bpb: np.ndarray, acc: np.ndarray, chance: float) -> np.ndarray | None:
    from scipy.optimize import curve_fit

    lo_b, hi_b = float(bpb.min()), float(bpb.max())
    span = max(hi_b - lo_b, 1e-3)
    # a in (0, 1 - c], c in [0, 1): accuracy stays a probability; b0 within a few spans of the data
    bounds = ([1e-6, -200.0 / span, lo_b - 3 * span, 0.0], [1.0, 200.0 / span, hi_b + 3 * span, 1.0])
    best = None
    for k0 in (-4.0 / span, -1.0 / span, -10.0 / span):
        p0 = [max(acc.max() - chance, 0.05), k0, float(np.median(bpb)), min(max(chance, 0.0), 0.99)]
        p0 = np.clip(p0, np.array(bounds[0]) + 1e-9, np.array(bounds[1]) - 1e-9)
        try:
            p, _ = curve_fit(sigmoid, bpb, acc, p0=p0, bounds=bounds, jac=_sigmoid_jac, maxfev=MAX_NFEV)
        except (RuntimeError, ValueError):
            continue
        sse = float(((sigmoid(bpb, *p) - acc) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, p)
    return None if best is None else best[1]


def fit_sigmoid(bpb: Sequence[float], acc: Sequence[float], *, chance: float, cfg: TaskLawConfig) -> SigmoidFit:
    """Step 2: least-squares fit of :func:`sigmoid` to (bpb, accuracy) of the evaluated models.

    ``chance`` (mean 1 / n_choices) seeds ``c``. Bootstrap: models resampled with replacement
    ``cfg.n_bootstrap`` times (seeded), each refitted; intervals are percentiles. Raises
    ``ValueError`` with fewer than ``cfg.min_sigmoid_points`` finite points or when no start converges.
    """
    x = np.asarray(bpb, dtype=float)
    y = np.asarray(acc, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    require(len(x) >= cfg.min_sigmoid_points, "points",
            f"the sigmoid has 4 parameters; need >= {cfg.min_sigmoid_points} models, got {len(x)}")
    p = _fit_once(x, y, chance)
    if p is None:
        raise ValueError("sigmoid fit: no start converged")
    rng = np.random.default_rng(cfg.seed)
    samples = np.full((cfg.n_bootstrap, 4), np.nan)
    for r in range(cfg.n_bootstrap):
        idx = rng.integers(0, len(x), len(x))
        if len(np.unique(x[idx])) < 4:
            continue
        q = _fit_once(x[idx], y[idx], chance)
        if q is not None:
            samples[r] = q
    good = np.isfinite(samples).all(axis=1)
    qs = [(1 - cfg.confidence) / 2, (1 + cfg.confidence) / 2]
    intervals = ({name: tuple(float(v) for v in np.quantile(samples[good, j], qs))
                  for j, name in enumerate(("a", "k", "b0", "c"))} if good.any() else {})
    warnings = []
    if np.ptp(y) < 0.05:
        warnings.append(f"accuracies span only {np.ptp(y):.3f}: the curve's shape is not constrained by these models")
    rmse = float(np.sqrt(np.mean((sigmoid(x, *p) - y) ** 2)))
    return SigmoidFit(a=float(p[0]), k=float(p[1]), b0=float(p[2]), c=float(p[3]), n_points=int(len(x)), rmse=rmse,
                      samples=samples, intervals=intervals, warnings=warnings)


def fit_bpb_law(N, D, bpb, cfg: TaskLawConfig) -> dict:
    """Step 1 for one variant: the Approach-3 law of bpb on (N, D) with its bootstrap and identification.

    Returns ``{"fit", "bootstrap", "identified", "identification_reasons", "samples"}`` (``samples``:
    (R, 5) replicate parameters E, A, B, alpha, beta, NaN where failed) or, with fewer than 5
    points, ``{"fit": None, "identified": False, "identification_reasons": [...]}``.
    """
    N, D, bpb = (np.asarray(v, dtype=float) for v in (N, D, bpb))
    if len(N) < 5:
        return {"fit": None, "identified": False,
                "identification_reasons": [f"too few points: {len(N)} (< 5, the parameters of Approach 3)"]}
    fcfg = FitConfig(n_bootstrap=max(cfg.n_bootstrap, 1), n_jobs=1, confidence=cfg.confidence, n_starts=16,
                     bootstrap_n_starts=2, backtest_bootstrap=0, huber_delta_sensitivity=(1e-3,),
                     bootstrap_seed=cfg.seed)
    fit = fit_chinchilla(N, D, bpb, fcfg)
    boot = bootstrap_chinchilla(N, D, bpb, fcfg, fit=fit)
    diag = law_diagnostics(N, D, bpb, 6.0 * N * D, None, fit, boot, fcfg)
    identified, reasons = identification(fit, boot, diag, N, fcfg)
    return {"fit": fit, "identified": identified, "identification_reasons": reasons, "samples": boot.samples,
            "intervals": {k: list(v) for k, v in boot.intervals.items()}, "warnings": fit.warnings + diag["warnings"],
            "backtest": diag["backtest"]}


def chained_prediction(law: dict, sig: SigmoidFit, N: float, D: float, confidence: float) -> dict:
    """(N, D) -> bpb (step 1) -> accuracy (step 2), point and paired-bootstrap interval."""
    fit = law["fit"]
    b = float(fit.predict(N, D))
    out = {"N": float(N), "D": float(D), "bpb": b, "acc": float(sig.predict(b)),
           "bpb_ci": [None, None], "acc_ci": [None, None]}
    s1 = law.get("samples")
    if s1 is None or not len(s1) or not len(sig.samples):
        return out
    R = min(len(s1), len(sig.samples))
    E, A, B, alpha, beta = (s1[:R, j] for j in range(5))
    with np.errstate(over="ignore", invalid="ignore"):
        bpbs = E + A / N**alpha + B / D**beta
    accs = np.array([sigmoid(bb, *s) if np.isfinite(bb) and np.isfinite(s).all() else np.nan
                     for bb, s in zip(bpbs, sig.samples[:R])])
    q = [(1 - confidence) / 2, (1 + confidence) / 2]
    if np.isfinite(bpbs).any():
        out["bpb_ci"] = [float(v) for v in np.quantile(bpbs[np.isfinite(bpbs)], q)]
    if np.isfinite(accs).any():
        out["acc_ci"] = [float(v) for v in np.quantile(accs[np.isfinite(accs)], q)]
    return out


def curve_residuals(sig: SigmoidFit, bpb: Sequence[float], acc: Sequence[float], *, confidence: float,
                    n_bootstrap: int = 2000, seed: int = 0) -> dict:
    """Do these points (compressed or sparse models) sit on the curve fitted to the others?

    Residual = observed accuracy - curve at the observed bpb. Reports the mean residual with a
    bootstrap interval over the points and the share inside the curve's band; ``verdict`` is
    ``"on the curve"`` when the mean's interval contains 0, else ``"above"`` / ``"below"``.
    """
    x = np.asarray(bpb, dtype=float)
    y = np.asarray(acc, dtype=float)
    if len(x) == 0:
        return {"n_points": 0, "verdict": "no points"}
    res = y - sig.predict(x)
    rng = np.random.default_rng(seed)
    reps = res[rng.integers(0, len(res), size=(n_bootstrap, len(res)))].mean(axis=1)
    lo, hi = (float(v) for v in np.quantile(reps, [(1 - confidence) / 2, (1 + confidence) / 2]))
    blo, bhi = sig.band(x, confidence)
    inside = float(np.mean((y >= blo) & (y <= bhi))) if np.isfinite(blo).all() else None
    verdict = "on the curve" if lo <= 0 <= hi else "above" if lo > 0 else "below"
    return {"n_points": int(len(x)), "mean_residual": float(res.mean()), "ci_low": lo, "ci_high": hi,
            "share_inside_band": inside, "verdict": verdict}


def fit_task_laws(rows: Sequence[dict], cfg: TaskLawConfig) -> dict:
    """Both steps for every task in ``rows`` (reports/downstream.csv rows).

    A row needs ``task``, ``family``, ``method``, ``variant``, ``n_params``, ``tokens``, ``bpb``,
    ``primary`` (the task's primary accuracy) and ``chance``. Step 1 uses the uncompressed ladder
    rows per variant; step 2 the uncompressed rows of every family (ladder and SmolLM2); compressed
    and sparse rows (``method != "none"``) are then checked against that curve, and a second
    curve over all rows is reported for comparison.
    """
    tasks = sorted({r["task"] for r in rows})
    out: dict = {"method": "Bhagia et al. 2024 two-step task law: bpb = E + A/N^alpha + B/D^beta per variant; "
                           "acc = a/(1+exp(-k(bpb-b0)))+c across models",
                 "config": dataclasses.asdict(cfg), "tasks": {}}
    usable = {task: [r for r in rows if r["task"] == task and _finite(r.get("bpb")) and _finite(r.get("primary"))]
              for task in tasks}
    jobs = {}
    for task, t_rows in usable.items():
        ladder = [r for r in t_rows if r["method"] == "none" and r["family"] == "ladder"]
        for v in sorted({r["variant"] for r in ladder}):
            pts = [r for r in ladder if r["variant"] == v]
            jobs[task, v] = ([r["n_params"] for r in pts], [r["tokens"] for r in pts], [r["bpb"] for r in pts])
    fitted = _fit_bpb_laws(jobs, cfg)
    for task in tasks:
        t_rows = usable[task]
        base = [r for r in t_rows if r["method"] == "none"]
        entry: dict = {"laws": {}, "sigmoid": None, "predictions": [], "compressed_on_curve": None}
        laws = {v: law for (t, v), law in fitted.items() if t == task}
        for v, law in laws.items():
            entry["laws"][v] = _law_dict(law)
        chance = float(np.mean([r["chance"] for r in t_rows])) if t_rows else 0.25
        try:
            sig = fit_sigmoid([r["bpb"] for r in base], [r["primary"] for r in base], chance=chance, cfg=cfg)
        except ValueError as exc:
            entry["sigmoid"] = {"skipped": str(exc)}
            out["tasks"][task] = entry
            continue
        entry["sigmoid"] = sig.to_dict()
        entry["chance"] = chance
        entry["_samples"] = sig.samples  # for the plot's band; keys starting with "_" stay out of the JSON
        for v, law in laws.items():
            if law["fit"] is None:
                continue
            pts = [r for r in base if r["family"] == "ladder" and r["variant"] == v]
            largest = max(pts, key=lambda r: (r["n_params"] * r["tokens"]))
            targets = [(largest["n_params"], largest["tokens"], "largest ladder run", largest["primary"])]
            targets += [(n, d, "target", None) for n, d in cfg.targets]
            for n, d, kind, observed in targets:
                pred = chained_prediction(law, sig, n, d, cfg.confidence)
                entry["predictions"].append({"variant": v, "kind": kind, "observed_acc": observed,
                                             "identified": law["identified"], **pred})
        comp = [r for r in t_rows if r["method"] != "none"]
        by_method = {}
        for m in sorted({r["method"] for r in comp}):
            mr = [r for r in comp if r["method"] == m]
            by_method[m] = curve_residuals(sig, [r["bpb"] for r in mr], [r["primary"] for r in mr],
                                           confidence=cfg.confidence, seed=cfg.seed)
        entry["compressed_on_curve"] = by_method
        out["tasks"][task] = entry
    return out


def _fit_bpb_laws(jobs: dict[tuple[str, str], tuple], cfg: TaskLawConfig) -> dict[tuple[str, str], dict]:
    """:func:`fit_bpb_law` for every ``(task, variant): (N, D, bpb)``, over ``cfg.n_jobs`` processes."""
    return map_processes(fit_bpb_law, {key: (*arrays, cfg) for key, arrays in jobs.items()}, cfg.n_jobs)


def _finite(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(float(x))


def _law_dict(law: dict) -> dict:
    fit = law["fit"]
    if fit is None:
        return {"identified": False, "identification_reasons": law["identification_reasons"]}
    ints = law.get("intervals", {})
    params = {k: {"value": v, "ci_low": (ints.get(k) or [None, None])[0], "ci_high": (ints.get(k) or [None, None])[1]}
              for k, v in fit.params().items()}
    return params | {"n_points": fit.n_points, "rmse_log": fit.rmse_log, "identified": law["identified"],
                     "identification_reasons": law["identification_reasons"], "warnings": law.get("warnings", []),
                     "backtest": law.get("backtest")}


def plot_task_law(task: str, rows: Sequence[dict], entry: dict, path, confidence: float) -> None:
    """bpb against accuracy: points by family (marker) and method (colour), the sigmoid and its band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    markers = {"ladder": "o", "smollm2": "s", "hf": "^"}
    methods = sorted({r["method"] for r in rows})
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for fam in sorted({r["family"] for r in rows}):
        for m in methods:
            pts = [r for r in rows if r["family"] == fam and r["method"] == m and _finite(r.get("bpb"))]
            if pts:
                ax.scatter([r["bpb"] for r in pts], [r["primary"] for r in pts], marker=markers.get(fam, "x"),
                           color=colours[m], label=f"{fam} / {m}", alpha=0.8, s=28)
    sig = entry.get("sigmoid") or {}
    xs = [r["bpb"] for r in rows if _finite(r.get("bpb"))]
    if "a" in sig and xs:
        grid = np.linspace(min(xs) * 0.95, max(xs) * 1.05, 200)
        fit = SigmoidFit(a=sig["a"], k=sig["k"], b0=sig["b0"], c=sig["c"], n_points=sig["n_points"], rmse=sig["rmse"],
                         samples=entry.get("_samples", np.empty((0, 4))))
        ax.plot(grid, fit.predict(grid), color="black", lw=1.5, label="sigmoid (uncompressed models)")
        lo, hi = fit.band(grid, confidence)
        if np.isfinite(lo).all():
            ax.fill_between(grid, lo, hi, color="grey", alpha=0.25, label=f"{confidence:.0%} band")
    if "chance" in entry:
        ax.axhline(entry["chance"], color="grey", ls=":", lw=1, label="chance")
    ax.set_xlabel("bits per byte of the gold answer")
    ax.set_ylabel("accuracy (primary metric)")
    ax.set_title(f"{task}: task loss -> accuracy")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
