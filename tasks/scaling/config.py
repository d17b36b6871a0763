"""Config of the scaling-law fit: the ``fit:`` section of ``params/fit.yaml``.

Load it with ``load_stage_config(FitConfig, root, "fit", preset)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from tasks.common.config import at_least, in_interval, require


@dataclass(frozen=True, kw_only=True)
class DecisionConfig:
    """Decisions on paired differences (:mod:`tasks.scaling.decisions`, :mod:`tasks.scaling.joint`):
    the ``fit.decisions`` section."""

    # Every other trained series is compared with this one (a data variant, or e.g. raw for raw+repb).
    reference: str = "raw"
    # Which series to compare; empty = every trained series but the reference.
    compared: tuple[str, ...] = ()
    # Targets decided on besides the whole validation split: each corpus source's documents
    # (``val:<source>``) and the downstream tasks' bits per byte of the gold answer (DataDecide's
    # most predictive proxy; needs the evaluate stage's items).
    per_source: bool = True
    downstream_bpb: bool = True
    # Document bootstrap replicates for observed differences.
    n_bootstrap: int = 1000
    # Exponents shared by every series in the joint fit ("alpha", "beta"); E, A and B are per series.
    shared: tuple[str, ...] = ("alpha", "beta")
    # Exponent search of the variable-projection fit: `grid_steps` values over [grid_lo, grid_hi],
    # then `zoom_steps` over +-1 step around the optimum.
    grid_lo: float = 0.05
    grid_hi: float = 2.0
    grid_steps: int = 40
    zoom_steps: int = 11
    # Replicates of the joint fit's paired bootstrap over runs (projections, backtest) and of the
    # nested test's parametric bootstrap.
    fit_bootstrap: int = 400
    nested_bootstrap: int = 200
    # Projections at these multiples of the ladder's largest compute budget.
    target_multiples: tuple[float, ...] = (3.0, 10.0)
    # Calls are made at family-wise level 1 - confidence (Holm within each family).
    confidence: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        require(bool(self.reference), "reference", "must name a trained series, got an empty string")
        require(self.reference not in self.compared, "compared",
                f"must not contain the reference {self.reference!r}")
        at_least(self.n_bootstrap, 100, "n_bootstrap")
        require(set(self.shared) <= {"alpha", "beta"}, "shared",
                f"may only list 'alpha' and 'beta', got {list(self.shared)}")
        require(0 < self.grid_lo < self.grid_hi, "grid_lo", f"need 0 < grid_lo < grid_hi, got {self.grid_lo}, {self.grid_hi}")
        at_least(self.grid_steps, 3, "grid_steps")
        at_least(self.zoom_steps, 1, "zoom_steps")
        at_least(self.fit_bootstrap, 0, "fit_bootstrap")
        at_least(self.nested_bootstrap, 0, "nested_bootstrap")
        require(len(self.target_multiples) >= 1 and all(m > 1 and math.isfinite(m) for m in self.target_multiples),
                "target_multiples", f"must list multiples > 1 of the largest trained budget, got {self.target_multiples}")
        in_interval(self.confidence, 0, 1, "confidence", "()")


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    """The pre-registered run beyond the ladder (``scalelab validate``): a model of this shape trained
    on ``budget_multiple`` x the ladder's largest budget (``fit.validation``)."""

    d_model: int = 112
    n_layers: int = 3
    n_heads: int = 4
    budget_multiple: float = 3.0

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.d_model % self.n_heads == 0, "n_heads", f"must divide d_model {self.d_model}, got {self.n_heads}")
        require(self.budget_multiple > 1 and math.isfinite(self.budget_multiple), "budget_multiple",
                f"must be > 1 (a run beyond the ladder), got {self.budget_multiple}")


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """Approach-3 (Hoffmann et al. 2022; Epoch AI's replication) and IsoFLOP fit settings.

    The initialisation grid defaults to Hoffmann's / Epoch's: alpha, beta in {0, 0.5, ..., 2},
    e in {-1, -0.5, ..., 1}, a, b in {0, 5, ..., 25} (4,500 starts).
    """

    # Huber on log-loss residuals; 1e-3 as Hoffmann et al. and Epoch.
    huber_delta: float = 1e-3
    # Bootstrap over runs (resampling with replacement) for every interval; the optimiser's
    # inverse Hessian is not trusted for intervals (Epoch's note).
    n_bootstrap: int = 1000
    # Replicates for the laws of compressed and sparse series (``<variant>+<setting>``; also caps
    # their backtest's, and skips their Huber-delta sensitivity refits); None = n_bootstrap. Their many
    # laws dominate a pipeline's fit time.
    derived_n_bootstrap: int | None = None
    bootstrap_seed: int = 0
    # Worker processes for the bootstrap; 1 runs in this process.
    n_jobs: int = 2
    confidence: float = 0.95

    grid_alpha: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0)
    grid_beta: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0)
    grid_e: tuple[float, ...] = (-1.0, -0.5, 0.0, 0.5, 1.0)
    grid_a: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
    grid_b: tuple[float, ...] = (0.0, 5.0, 10.0, 15.0, 20.0, 25.0)
    # The objective is evaluated at every grid point (vectorised); L-BFGS-B then runs from the
    # `n_starts` best of them. 0 runs L-BFGS-B from every grid point, as Epoch did (slow: minutes).
    n_starts: int = 64
    # Each bootstrap replicate starts from the point estimate and from the 4 corners of a small
    # grid around it: alpha and beta scaled by (1 -/+ spread), with a and b shifted so each term
    # keeps its value at the mean log N / log D. 0 uses the point estimate only.
    bootstrap_start_spread: float = 0.25
    # Each replicate also starts from the `bootstrap_n_starts` best points of the initial grid
    # ranked on that replicate's own weighted objective, so a replicate whose optimum lies in
    # another basin than the point estimate's can still reach it. 0: the starts above only.
    bootstrap_n_starts: int = 8
    # The bootstrap resamples distinct (N, D) runs; a replicate with fewer distinct N, D or
    # (N, D) points than these is redrawn (counted as `n_redrawn`): a law on one model size
    # cannot separate A/N^alpha from E and is no sample of the estimator's spread.
    bootstrap_min_distinct_n: int = 2
    bootstrap_min_distinct_d: int = 2
    bootstrap_min_distinct_points: int = 5

    # Box bounds of L-BFGS-B on (a, b, e, alpha, beta); a fit that ends on one is warned about.
    bound_a: tuple[float, float] = (-30.0, 60.0)
    bound_b: tuple[float, float] = (-30.0, 60.0)
    bound_e: tuple[float, float] = (-5.0, 5.0)
    bound_alpha: tuple[float, float] = (0.0, 5.0)
    bound_beta: tuple[float, float] = (0.0, 5.0)

    # The objective is ~1e-3 in size, so scipy's default ftol (relative to max(|f|, 1)) stops
    # early; Epoch refits with tighter tolerances for the same reason.
    lbfgs_ftol: float = 1e-15
    lbfgs_gtol: float = 1e-11
    lbfgs_maxiter: int = 2000
    # "batched": a damped Newton method over every start (and bootstrap replicate) at once in
    # numpy, with the exact 5x5 Hessian; starts it does not certify as converged are finished by
    # L-BFGS-B. "scipy": L-BFGS-B from every start, one at a time (~40 ms each; the reference).
    optimizer: Literal["batched", "scipy"] = "batched"
    # Iteration cap of the batched Newton method; starts still running then go to L-BFGS-B.
    newton_maxiter: int = 1000

    # Drop the k highest-loss runs before fitting (Epoch drops 5 on the Chinchilla points, which
    # are early/under-trained outliers); 0 for our own ladder. Excluded rows are reported.
    exclude_top_loss: int = 0
    # Fewer points than this: fit anyway but warn (OLMo's ladder asks for at least 5).
    min_points: int = 5
    # N spanning less than this many decades: alpha and beta are nearly unidentifiable; warn.
    min_n_decades: float = 1.0

    # Which parameter count is N: "total" (embeddings included, as Hoffmann et al. and Epoch) or
    # "non_embedding" (Kaplan et al. 2020). Read from reports/train.csv's n_params_total /
    # n_params_nonembed; reports without them fall back to their n_params.
    n_definition: Literal["total", "non_embedding"] = "total"
    # Runs trained for more passes over their variant's tokens than this are left out (repeated
    # data changes the law, Muennighoff et al. 2023); None keeps every run.
    max_epochs: float | None = 1.0

    # Identification: a law is reported as identified, and compared with others, only when no
    # parameter of (E, alpha, beta) is at a bound, alpha's and beta's intervals are narrower than
    # `max_ci_width`, |corr(alpha, beta)| over the bootstrap is at most `max_abs_rho_alpha_beta`,
    # and the backtest's median relative error is at most `max_backtest_rel_error`.
    max_ci_width: float = 0.4
    max_abs_rho_alpha_beta: float = 0.9
    max_backtest_rel_error: float = 0.03
    # Backtest: refit without the largest compute level, predict it; intervals from this many
    # bootstrap replicates of the training part (0: no interval).
    backtest_bootstrap: int = 200
    # Point refits at these Huber deltas show how much E, alpha, beta depend on the loss's choice.
    huber_delta_sensitivity: tuple[float, ...] = (1e-4, 1e-3, 1e-2)

    # IsoFLOP (Approach 2): runs whose log10(6ND) lie within this many decades of a level's
    # first run share the level; a level needs >= 3 distinct N for a parabola.
    isoflop_log10_tolerance: float = 0.1
    isoflop_min_points: int = 3

    # Compute budgets (FLOPs) at which the compute-optimal allocation is projected and variants
    # are compared.
    compute_budgets: tuple[float, ...] = (1e18, 1e19, 1e20, 1e21, 1e22, 1e23, 1e24)
    # "x better than y at C" and reversals are called at family-wise level 1 - reversal_confidence
    # (Holm 1979 over every pair x budget, and over pairs for reversals); budgets outside the
    # measured compute range of both ladders are reported but not tested.
    reversal_confidence: float = 0.95
    # Paired decisions (observed and projected Delta against a reference series).
    decisions: DecisionConfig = field(default_factory=DecisionConfig)
    # The pre-registered check at larger scale (flows/validate.py).
    validation: ValidationConfig = field(default_factory=ValidationConfig)

    def __post_init__(self) -> None:
        require(self.huber_delta > 0, "huber_delta", f"must be > 0, got {self.huber_delta}")
        at_least(self.n_bootstrap, 0, "n_bootstrap")
        require(self.derived_n_bootstrap is None or self.derived_n_bootstrap >= 0, "derived_n_bootstrap",
                f"must be >= 0 or null, got {self.derived_n_bootstrap}")
        at_least(self.n_jobs, 1, "n_jobs")
        in_interval(self.confidence, 0, 1, "confidence", "()")
        require(0 < self.reversal_confidence < 1, "reversal_confidence",
                f"must be in (0, 1), got {self.reversal_confidence}")
        for name in ("grid_alpha", "grid_beta", "grid_e", "grid_a", "grid_b"):
            values = getattr(self, name)
            require(len(values) >= 1, name, "must list at least one value")
            require(all(math.isfinite(v) for v in values), name, f"must be finite, got {values}")
        require(self.n_starts >= 0, "n_starts", f"must be >= 0 (0 = every grid point), got {self.n_starts}")
        require(0 <= self.bootstrap_start_spread < 1, "bootstrap_start_spread",
                f"must be in [0, 1), got {self.bootstrap_start_spread}")
        for name, grid in (("bound_a", "grid_a"), ("bound_b", "grid_b"), ("bound_e", "grid_e"),
                           ("bound_alpha", "grid_alpha"), ("bound_beta", "grid_beta")):
            lo, hi = getattr(self, name)
            require(lo < hi, name, f"lower bound must be below upper, got ({lo}, {hi})")
            values = getattr(self, grid)
            require(all(lo <= v <= hi for v in values), name,
                    f"must contain every value of {grid} {values}, got ({lo}, {hi})")
        require(self.lbfgs_ftol > 0, "lbfgs_ftol", f"must be > 0, got {self.lbfgs_ftol}")
        require(self.lbfgs_gtol > 0, "lbfgs_gtol", f"must be > 0, got {self.lbfgs_gtol}")
        require(self.optimizer in ("batched", "scipy"), "optimizer",
                f"must be 'batched' or 'scipy', got {self.optimizer!r}")
        at_least(self.newton_maxiter, 1, "newton_maxiter")
        at_least(self.lbfgs_maxiter, 1, "lbfgs_maxiter")
        require(self.bootstrap_n_starts >= 0, "bootstrap_n_starts",
                f"must be >= 0, got {self.bootstrap_n_starts}")
        for name, least in (("bootstrap_min_distinct_n", 1), ("bootstrap_min_distinct_d", 1),
                            ("bootstrap_min_distinct_points", 1)):
            require(getattr(self, name) >= least, name, f"must be >= {least}, got {getattr(self, name)}")
        require(self.n_definition in ("total", "non_embedding"), "n_definition",
                f"must be 'total' or 'non_embedding', got {self.n_definition!r}")
        require(self.max_epochs is None or self.max_epochs > 0, "max_epochs",
                f"must be > 0 or null, got {self.max_epochs}")
        require(self.max_ci_width > 0, "max_ci_width", f"must be > 0, got {self.max_ci_width}")
        require(0 < self.max_abs_rho_alpha_beta <= 1, "max_abs_rho_alpha_beta",
                f"must be in (0, 1], got {self.max_abs_rho_alpha_beta}")
        require(self.max_backtest_rel_error > 0, "max_backtest_rel_error",
                f"must be > 0, got {self.max_backtest_rel_error}")
        at_least(self.backtest_bootstrap, 0, "backtest_bootstrap")
        require(all(d > 0 and math.isfinite(d) for d in self.huber_delta_sensitivity), "huber_delta_sensitivity",
                f"must be positive finite deltas, got {self.huber_delta_sensitivity}")
        at_least(self.exclude_top_loss, 0, "exclude_top_loss")
        at_least(self.min_points, 1, "min_points")
        at_least(self.min_n_decades, 0, "min_n_decades")
        require(self.isoflop_log10_tolerance > 0, "isoflop_log10_tolerance",
                f"must be > 0, got {self.isoflop_log10_tolerance}")
        require(self.isoflop_min_points >= 3, "isoflop_min_points",
                f"a parabola needs >= 3 points, got {self.isoflop_min_points}")
        require(len(self.compute_budgets) >= 1, "compute_budgets", "must list at least one budget")
        require(all(c > 0 and math.isfinite(c) for c in self.compute_budgets), "compute_budgets",
                f"must be positive finite FLOPs, got {self.compute_budgets}")
        require(list(self.compute_budgets) == sorted(set(self.compute_budgets)), "compute_budgets",
                f"must be strictly increasing, got {self.compute_budgets}")

    @property
    def grid_size(self) -> int:
        return (len(self.grid_a) * len(self.grid_b) * len(self.grid_e)
                * len(self.grid_alpha) * len(self.grid_beta))


def derived_config(cfg: FitConfig) -> FitConfig:
    """``cfg`` for a compressed or sparse series: ``derived_n_bootstrap`` replicates, at most that many
    for its backtest, and no Huber-delta sensitivity refits (a diagnostic that identification does
    not use; three full multi-start fits per law)."""
    import dataclasses

    if cfg.derived_n_bootstrap is None:
        return cfg
    return dataclasses.replace(cfg, n_bootstrap=cfg.derived_n_bootstrap,
                               backtest_bootstrap=min(cfg.backtest_bootstrap, cfg.derived_n_bootstrap),
                               huber_delta_sensitivity=())
