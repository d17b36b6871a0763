"""Decisions on paired differences: does a series beat its reference, now and at larger compute?

Every series of a ladder (a data variant, a training method, an architecture) is scored on the same
validation documents, so "is v better than the reference?" is asked of the paired difference
``Delta = L_v - L_ref`` on the same documents, not of two separate laws, following DataDecide
(Magnusson et al. 2025, "DataDecide: How to Predict Best Pretraining Data with Small Experiments",
arXiv:2504.11393): :func:`observed_differences` at the ladder's points (a bootstrap over documents
widened by the seed noise of a one-seed Delta; Choshen, Zhang & Andreas 2024, "A Hitchhiker's Guide
to Scaling Law Estimation", arXiv:2410.11840, on the seed floor), :func:`decide_projected` beyond
the ladder from the joint shared-shape fit (:mod:`tasks.scaling.joint`), each comparison called
*better*, *worse* or *undecided* under Holm's step-down adjustment (Holm 1979, "A Simple Sequentially
Rejective Multiple Test Procedure", Scand. J. Statist. 6(2)), and a backtest plus DataDecide's
decision accuracy (:func:`backtest_decisions`, :func:`ranking_agreement`).

Deviation: windows of the validation stream cross document boundaries, so resampling documents
treats each document's summed loss as one unit and ignores that weak coupling. Details:
docs/fit.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from tasks.scaling.compute_optimal import FlopsPerToken, holm_adjust, normal_pvalue
from tasks.scaling.joint import (
    ExponentGrid, JointFit, SeriesPoints, bootstrap_joint, fit_joint, ladder_range, nested_test,
    projected_differences,
)

WHOLE_SPLIT = "val"  # the target named for the whole validation split; per source: "val:<source>"
DOC_COLUMNS = ("variant", "run", "seed", "doc", "source", "tokens", "loss_sum")


@dataclass(frozen=True)
class DocLosses:
    """Per-document summed losses of every (series, run, seed) on one target's documents.

    ``sums[key]`` is ``(n_docs,)`` float64 aligned with ``docs``; ``tokens`` the scored tokens per
    document (the same for every model: one validation split)."""

    docs: np.ndarray
    tokens: np.ndarray
    sums: dict[tuple[str, str, int], np.ndarray]

    def loss(self, key: tuple[str, str, int]) -> float:
        return float(self.sums[key].sum() / self.tokens.sum())

    def seeds(self, series: str, run: str) -> list[int]:
        return sorted(s for (v, r, s) in self.sums if v == series and r == run)


def check_doc_losses(frame: pl.DataFrame, source: str = "val_docs.parquet") -> None:
    """Refuse a per-document table that cannot be paired: missing columns, or (series, run, seed)
    groups scored on different documents."""
    missing = [c for c in DOC_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{source}: missing column {missing[0]!r} (need {', '.join(DOC_COLUMNS)})")
    counts = frame.group_by("variant", "run", "seed").agg(pl.len().alias("n"), pl.col("tokens").sum().alias("t"))
    if counts["n"].n_unique() > 1 or counts["t"].n_unique() > 1:
        bad = counts.sort("n").row(0, named=True)
        raise ValueError(f"{source}: {bad['variant']}/{bad['run']} seed {bad['seed']} was scored on {bad['n']} documents "
                         f"({bad['t']} tokens), others on {counts['n'].max()}: not one validation split")


def doc_losses(frame: pl.DataFrame, target: str = WHOLE_SPLIT) -> DocLosses:
    """The :class:`DocLosses` of ``target``: the whole split, or ``val:<source>`` (its documents only)."""
    if target != WHOLE_SPLIT:
        if not target.startswith(f"{WHOLE_SPLIT}:"):
            raise ValueError(f"target: {target!r} is neither {WHOLE_SPLIT!r} nor '{WHOLE_SPLIT}:<source>'")
        frame = frame.filter(pl.col("source") == target.split(":", 1)[1])
        if not frame.height:
            raise ValueError(f"target: no validation documents of source {target.split(':', 1)[1]!r}")
    frame = frame.sort("doc")
    first = frame.group_by("variant", "run", "seed", maintain_order=True).first().row(0, named=True)
    ref = frame.filter((pl.col("variant") == first["variant"]) & (pl.col("run") == first["run"])
                       & (pl.col("seed") == first["seed"]))
    docs, tokens = ref["doc"].to_numpy(), ref["tokens"].to_numpy().astype(float)
    sums = {}
    for (v, r, s), g in frame.group_by("variant", "run", "seed"):
        if not np.array_equal(g["doc"].to_numpy(), docs):
            raise ValueError(f"val_docs: {v}/{r} seed {s} was scored on other documents than {first['variant']}/"
                             f"{first['run']}: not one validation split")
        sums[(str(v), str(r), int(s))] = g["loss_sum"].to_numpy().astype(float)
    return DocLosses(docs=docs, tokens=tokens, sums=sums)


def pooled_sd(groups) -> tuple[float | None, int]:
    """Pooled within-group standard deviation of ``groups`` (sequences of values) and its degrees of
    freedom; groups of one value add nothing (None, 0 when no group has two)."""
    ss, dof = 0.0, 0
    for values in groups:
        if len(values) > 1:
            x = np.asarray(values)
            ss += float(((x - x.mean()) ** 2).sum())
            dof += len(x) - 1
    return (float(np.sqrt(ss / dof)), dof) if dof else (None, 0)


def seed_sigma(d: DocLosses) -> tuple[float | None, int]:
    """Pooled within-run standard deviation of the loss across training seeds, and its degrees of
    freedom (None, 0 when no run has two seeds)."""
    by_run: dict[tuple[str, str], list[float]] = {}
    for (v, r, s) in d.sums:
        by_run.setdefault((v, r), []).append(d.loss((v, r, s)))
    return pooled_sd(by_run.values())


def seed_sigma_delta(d: DocLosses, reference: str) -> tuple[float | None, int]:
    """Pooled standard deviation across seeds of the one-seed paired difference
    ``L(v, run, s) - L(reference, run, s)`` over every (series, run) with at least two seeds in
    common with the reference's run, and its degrees of freedom (None, 0 when there is none)."""
    deltas: dict[tuple[str, str], list[float]] = {}
    for (v, r, s) in d.sums:
        if v != reference and (reference, r, s) in d.sums:
            deltas.setdefault((v, r), []).append(d.loss((v, r, s)) - d.loss((reference, r, s)))
    return pooled_sd(deltas.values())


def document_weights(n_docs: int, n_bootstrap: int, seed: int) -> np.ndarray:
    """``(n_bootstrap, n_docs)`` multinomial counts: documents drawn with replacement."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_docs, np.full(n_docs, 1.0 / n_docs), size=n_bootstrap).astype(float)


def paired_difference(d: DocLosses, x: Sequence[tuple[str, str, int]], y: Sequence[tuple[str, str, int]],
                      weights: np.ndarray, *, sigma_seed: float | None, confidence: float, seed: int = 0) -> dict:
    """``Delta = mean over x's seeds of L - mean over y's seeds of L`` on the same documents.

    Replicates: the document bootstrap (``weights`` from :func:`document_weights`, shared by both
    sides) plus, when ``sigma_seed`` (the seed spread of a one-seed paired Delta,
    :func:`seed_sigma_delta`) is known, a normal draw of the seed noise of the mean over seeds:
    ``sigma_seed / sqrt(k)`` when both sides trained the same k seeds, else
    ``sigma_seed * sqrt((1/k_x + 1/k_y) / 2)``. Returns delta, the percentile interval, a two-sided p-value from the replicates' standard
    error (:func:`~tasks.scaling.compute_optimal.normal_pvalue`) and both sigmas.
    """
    t = d.tokens
    xs = np.stack([d.sums[k] for k in x]).mean(0)  # (n_docs,) seed-averaged sums
    ys = np.stack([d.sums[k] for k in y]).mean(0)
    diff = xs - ys
    delta = float(diff.sum() / t.sum())
    reps = (weights @ diff) / (weights @ t)
    sigma_doc = float(reps.std(ddof=1)) if len(reps) > 1 else float("nan")
    seed_sd = None
    if sigma_seed is not None:
        paired = sorted(k[2] for k in x) == sorted(k[2] for k in y)
        seed_sd = sigma_seed * (np.sqrt(1 / len(x)) if paired else np.sqrt((1 / len(x) + 1 / len(y)) / 2))
        reps = reps + np.random.default_rng([seed, 1]).normal(0.0, seed_sd, len(reps))
    lo_q = (1 - confidence) / 2
    lo, hi = np.quantile(reps, [lo_q, 1 - lo_q]) if len(reps) else (np.nan, np.nan)
    return {"delta": delta, "ci_low": float(lo), "ci_high": float(hi),
            "p_value": normal_pvalue(delta, reps),
            "sigma_doc": sigma_doc, "sigma_seed": seed_sd, "n_docs": int(len(t)),
            "n_seeds": min(len(x), len(y))}


def decide(rows: list[dict], confidence: float) -> list[dict]:
    """Holm-adjust the rows' p-values as one family and call each *better*, *worse* or *undecided*."""
    adj = holm_adjust([r["p_value"] for r in rows])
    level = 1 - confidence
    for r, p in zip(rows, adj):
        r["p_holm"] = float(p)
        decided = np.isfinite(p) and p < level and np.isfinite(r["delta"])
        r["decision"] = ("better" if r["delta"] < 0 else "worse") if decided else "undecided"
    return rows


def observed_differences(frame: pl.DataFrame, runs: pl.DataFrame, reference: str, compared: Sequence[str], *,
                         targets: Sequence[str] = (WHOLE_SPLIT,), n_bootstrap: int = 1000, confidence: float = 0.95,
                         seed: int = 0) -> list[dict]:
    """Observed Delta of every compared series against ``reference``, per target.

    ``frame``: per-document losses (:data:`DOC_COLUMNS`); ``runs``: one row per base-seed run with
    ``variant, run, D`` and ``compute_budget`` (None for points outside the IsoFLOP grid), as
    reports/train.csv. Rows: kind ``observed``, comparison ``same_size`` (each run both trained) and
    ``best`` (each series' best run at each budget -- :func:`with_budget` -- by its seed-averaged
    loss on the target),
    decided by :func:`decide` per (target, comparison).
    """
    check_doc_losses(frame)
    have = set(frame["variant"].unique().to_list())
    for name, what in [(reference, "reference")] + [(v, "compared series") for v in compared]:
        if name not in have:
            raise ValueError(f"decisions: the {what} {name!r} has no per-document validation losses "
                             f"(trained: {sorted(have)})")
    out = []
    runs, budget_kind = with_budget(runs)
    for target in targets:
        d = doc_losses(frame, target)
        weights = document_weights(len(d.docs), n_bootstrap, seed)
        sigma, _ = seed_sigma_delta(d, reference)
        same, best = [], []
        budgets = runs.filter(pl.col("budget").is_not_null())
        for v in compared:
            shared_runs = sorted(set(runs.filter(pl.col("variant") == v)["run"].to_list())
                                 & set(runs.filter(pl.col("variant") == reference)["run"].to_list()))
            for run in shared_runs:
                x, y = d.seeds(v, run), d.seeds(reference, run)
                if not x or not y:
                    continue
                budget = runs.filter((pl.col("variant") == v) & (pl.col("run") == run))["budget"][0]
                r = paired_difference(d, [(v, run, s) for s in x], [(reference, run, s) for s in y], weights,
                                      sigma_seed=sigma, confidence=confidence, seed=seed)
                same.append({"variant": v, "reference": reference, "target": target, "kind": "observed",
                             "comparison": "same_size", "budget": budget, "budget_kind": budget_kind, "run": run,
                             "reference_run": run} | r)
            for budget in sorted(set(budgets["budget"].to_list())):
                pick = {}
                for s in (v, reference):
                    cands = [r for r in budgets.filter((pl.col("variant") == s) & (pl.col("budget") == budget))
                             ["run"].to_list() if d.seeds(s, r)]
                    if cands:
                        pick[s] = min(cands, key=lambda r, s=s: np.mean([d.loss((s, r, k)) for k in d.seeds(s, r)]))
                if len(pick) < 2:
                    continue
                r = paired_difference(d, [(v, pick[v], k) for k in d.seeds(v, pick[v])],
                                      [(reference, pick[reference], k) for k in d.seeds(reference, pick[reference])],
                                      weights, sigma_seed=sigma, confidence=confidence, seed=seed)
                best.append({"variant": v, "reference": reference, "target": target, "kind": "observed",
                             "comparison": "best", "budget": budget, "budget_kind": budget_kind, "run": pick[v],
                             "reference_run": pick[reference]} | r)
        out += decide(same, confidence) + decide(best, confidence)
    return out


def with_budget(runs: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """Add ``budget``: the IsoFLOP compute budget where the ladder has one (points outside the grid
    get none), else each run's token budget (a sizes x tokens grid). Returns the frame and which
    (``"flops"`` or ``"tokens"``). Extra annealed points (``point == "anneal"``, train.csv) get
    none either way: they are no budget of the design."""
    if "compute_budget" in runs.columns and runs["compute_budget"].drop_nulls().len():
        return runs.with_columns(pl.col("compute_budget").cast(pl.Float64).alias("budget")), "flops"
    budget = pl.col("D").cast(pl.Float64)
    if "point" in runs.columns:
        budget = pl.when(pl.col("point") == "anneal").then(None).otherwise(budget)
    return runs.with_columns(budget.alias("budget")), "tokens"


def ranking_agreement(best_losses: Mapping[float, Mapping[str, float]]) -> dict:
    """DataDecide's decision accuracy: for each budget below the largest, the share of series pairs
    ranked the same way as at the largest budget (``best_losses[budget][series]`` = its best loss)."""
    budgets = sorted(best_losses)
    if len(budgets) < 2:
        return {"largest_budget": budgets[-1] if budgets else None, "per_budget": []}
    top = best_losses[budgets[-1]]
    rows = []
    for b in budgets[:-1]:
        here = best_losses[b]
        names = sorted(set(here) & set(top))
        pairs = [(a, c) for i, a in enumerate(names) for c in names[i + 1:]]
        agree = sum((here[a] < here[c]) == (top[a] < top[c]) for a, c in pairs)
        rows.append({"budget": b, "pairs": len(pairs), "agree": agree,
                     "accuracy": agree / len(pairs) if pairs else None})
    return {"largest_budget": budgets[-1], "per_budget": rows}


def series_points(runs: pl.DataFrame, names: Sequence[str]) -> dict[str, SeriesPoints]:
    """``{series: SeriesPoints}`` from rows with ``variant, N, D, loss``."""
    out = {}
    for v in names:
        sub = runs.filter(pl.col("variant") == v)
        out[v] = SeriesPoints(sub["N"].to_numpy().astype(float), sub["D"].to_numpy().astype(float),
                              sub["loss"].to_numpy().astype(float))
    return out


def projected_rows(fit: JointFit, data: Mapping[str, SeriesPoints], reference: str, compared: Sequence[str],
                   budgets: Sequence[float], flops: FlopsPerToken, *, n_bootstrap: int, confidence: float,
                   seed: int, grid: ExponentGrid, unique_tokens: Mapping[str, float] | None = None) -> list[dict]:
    """Projected Delta of the compute-optimal losses at ``budgets``, each row flagged
    ``repeats_data`` when the series' D*(C) exceeds its unique training tokens (Muennighoff et al.
    2023: repeated tokens are worth less, which a single-epoch ladder cannot measure)."""
    boot = bootstrap_joint(data, fit, n_bootstrap=n_bootstrap, seed=seed, grid=grid)
    rows = projected_differences(fit, boot, reference, compared, budgets, flops, confidence, ladder_range(data))
    for r in rows:
        flags = []
        for s, need in ((r["variant"], r["D_opt_variant"]), (reference, r["D_opt_reference"])):
            have = (unique_tokens or {}).get(s)
            if have is not None and need > have:
                flags.append(f"{s}: D* {need:.3g} > {have:.3g} unique tokens")
        r["budget"] = r.pop("compute_budget")
        r |= {"budget_kind": "flops", "target": WHOLE_SPLIT, "kind": "projected", "comparison": "compute_optimal",
              "repeats_data": "; ".join(flags) or None, "n_seeds": None, "n_docs": None}
    return rows


def backtest_decisions(runs: pl.DataFrame, observed_best: Sequence[dict], reference: str, compared: Sequence[str],
                       *, n_bootstrap: int, confidence: float, seed: int, grid: ExponentGrid,
                       shared: Sequence[str]) -> dict:
    """Refit the joint law on every budget but the largest (:func:`with_budget`), predict each
    series' best loss among the held-out runs' (N, D) and so Delta there, and check it against the
    observed ``best`` Delta on the whole split: is the sign right, does the interval cover it?"""
    runs, kind = with_budget(runs)
    budgets = sorted(runs["budget"].drop_nulls().unique().to_list())
    if len(budgets) < 3:
        return {"skipped": f"{len(budgets)} budgets; the backtest needs 3 (two to fit, one held out)"}
    top = budgets[-1]
    train = runs.filter(pl.col("budget").is_null() | (pl.col("budget") < top))
    held = runs.filter(pl.col("budget") == top)
    data = series_points(train, [reference, *compared])
    fit = fit_joint(data, shared=shared, grid=grid)
    boot = bootstrap_joint(data, fit, n_bootstrap=n_bootstrap, seed=seed, grid=grid)

    def best_loss(params, v):  # (n,) or scalar: the law's best loss over v's held-out runs
        pts = held.filter(pl.col("variant") == v)
        N, D = pts["N"].to_numpy()[None, :], pts["D"].to_numpy()[None, :]
        p = np.atleast_2d(params)
        return np.min(p[:, [0]] + p[:, [1]] / N ** p[:, [3]] + p[:, [2]] / D ** p[:, [4]], axis=1)

    as_row = {m: np.array([[fit.params[m][k] for k in ("E", "A", "B", "alpha", "beta")]]) for m in data}
    seen = {r["variant"]: r for r in observed_best
            if r["comparison"] == "best" and r["target"] == WHOLE_SPLIT and r["budget"] == top}
    lo_q = (1 - confidence) / 2
    pairs = []
    for v in compared:
        o = seen.get(v)
        if o is None or not held.filter(pl.col("variant") == v).height:
            continue
        predicted = float(best_loss(as_row[v], v)[0] - best_loss(as_row[reference], reference)[0])
        reps = best_loss(boot.samples[v], v) - best_loss(boot.samples[reference], reference)
        reps = reps[np.isfinite(reps)]
        lo, hi = np.quantile(reps, [lo_q, 1 - lo_q]) if len(reps) else (np.nan, np.nan)
        pairs.append({"variant": v, "reference": reference, "budget": top, "budget_kind": kind,
                      "predicted": predicted, "ci_low": float(lo), "ci_high": float(hi),
                      "observed": o["delta"], "observed_ci_low": o["ci_low"], "observed_ci_high": o["ci_high"],
                      "sign_right": bool(np.sign(predicted) == np.sign(o["delta"])),
                      "covered": bool(lo <= o["delta"] <= hi),
                      "excludes_zero": bool(lo > 0 or hi < 0)})
    decided = [q for q in pairs if q["excludes_zero"]]
    return {"held_out_budget": top, "budget_kind": kind, "fitted_budgets": budgets[:-1], "pairs": pairs,
            "sign_agreement": float(np.mean([q["sign_right"] for q in pairs])) if pairs else None,
            "coverage": float(np.mean([q["covered"] for q in pairs])) if pairs else None,
            "sign_agreement_where_decided": (float(np.mean([q["sign_right"] for q in decided])) if decided else None),
            "n_decided": len(decided)}


def _budget_scale(runs: pl.DataFrame) -> float:
    """The ladder's largest budget: its largest IsoFLOP budget, else its largest run's FLOPs."""
    budgets = runs["compute_budget"].drop_nulls() if "compute_budget" in runs.columns else pl.Series([])
    return float(budgets.max()) if len(budgets) else float(runs["C"].max())


def decision_report(points: pl.DataFrame, docs: pl.DataFrame | None, cfg, *, flops: FlopsPerToken,
                    unique_tokens: Mapping[str, float] | None = None,
                    downstream: pl.DataFrame | None = None) -> dict:
    """Every decision of the fit stage: observed and projected Delta rows, the joint fit, the
    nested test, the backtest and the ranking agreement (``cfg``: a DecisionConfig).

    ``points``: the fit's runs (``variant, N, D, loss, run, C, compute_budget[, series]``; only
    ``series == "trained"`` rows are series here); ``docs``: per-document losses (None: no
    observed rows, said in ``skipped``); ``downstream``: per-item bits per byte of trained models
    (``variant, run, item, bpb``; optional).
    """
    runs = points.filter(pl.col("series") == "trained") if "series" in points.columns else points
    if "compute_budget" not in runs.columns:
        runs = runs.with_columns(pl.lit(None, pl.Float64).alias("compute_budget"))
    trained = sorted(runs["variant"].unique().to_list())
    if cfg.reference not in trained:
        raise ValueError(f"fit.decisions.reference: {cfg.reference!r} was not trained (trained series: {trained})")
    unknown = [v for v in cfg.compared if v not in trained]
    if unknown:
        raise ValueError(f"fit.decisions.compared: {unknown[0]!r} was not trained (trained series: {trained})")
    compared = list(cfg.compared) or [v for v in trained if v != cfg.reference]
    out: dict = {"reference": cfg.reference, "compared": compared, "confidence": cfg.confidence, "skipped": []}
    rows: list[dict] = []
    if not compared:
        out["skipped"].append(f"only {cfg.reference!r} was trained: nothing to compare")
        return out | {"rows": rows}
    grid = ExponentGrid(cfg.grid_lo, cfg.grid_hi, cfg.grid_steps, cfg.zoom_steps)
    if docs is not None and docs.height:
        targets = [WHOLE_SPLIT]
        if cfg.per_source:
            targets += [f"{WHOLE_SPLIT}:{s}" for s in sorted(docs["source"].unique().to_list())]
        rows += observed_differences(docs, runs, cfg.reference, compared, targets=targets,
                                     n_bootstrap=cfg.n_bootstrap, confidence=cfg.confidence, seed=cfg.seed)
        whole = doc_losses(docs, WHOLE_SPLIT)
        sigma, dof = seed_sigma_delta(whole, cfg.reference)
        run_sigma, run_dof = seed_sigma(whole)
        out["sigma_seed"] = {"value": sigma, "dof": dof, "target": WHOLE_SPLIT,
                             "what": "seed spread of a one-seed paired Delta (enters every interval)",
                             "per_run_loss": run_sigma, "per_run_loss_dof": run_dof,
                             "seeds": sorted(docs["seed"].unique().to_list())}
        best: dict[float, dict[str, float]] = {}
        for r in with_budget(runs)[0].filter(pl.col("budget").is_not_null()).iter_rows(named=True):
            seeds = whole.seeds(r["variant"], r["run"])
            if seeds:
                loss = float(np.mean([whole.loss((r["variant"], r["run"], s)) for s in seeds]))
                cur = best.setdefault(r["budget"], {})
                cur[r["variant"]] = min(cur.get(r["variant"], np.inf), loss)
        out["ranking_agreement"] = ranking_agreement(best)
    else:
        out["skipped"].append("no per-document validation losses (reports/val_docs.parquet): no observed Delta")
    if downstream is not None and cfg.downstream_bpb and downstream.height:
        rows += downstream_differences(downstream, runs, cfg.reference, compared, n_bootstrap=cfg.n_bootstrap,
                                       confidence=cfg.confidence, seed=cfg.seed)
    fitted = [v for v in [cfg.reference, *compared] if runs.filter(pl.col("variant") == v).height >= 3]
    too_few = [v for v in compared if v not in fitted]
    for v in too_few:
        out["skipped"].append(f"{v}: fewer than 3 runs, no joint fit or projection")
    if cfg.reference in fitted and len(fitted) > 1:
        data = series_points(runs, fitted)
        joint = fit_joint(data, shared=cfg.shared, grid=grid)
        top = _budget_scale(runs)
        targets_c = [top * m for m in cfg.target_multiples]
        projected = projected_rows(joint, data, cfg.reference, fitted[1:], targets_c, flops,
                                   n_bootstrap=cfg.fit_bootstrap, confidence=cfg.confidence, seed=cfg.seed,
                                   grid=grid, unique_tokens=unique_tokens)
        rows += decide(projected, cfg.confidence)
        out["joint"] = joint.to_dict() | {"grid": {"lo": grid.lo, "hi": grid.hi, "steps": grid.steps,
                                                   "zoom_steps": grid.zoom_steps},
                                          "residual": "least squares on L (variable projection)",
                                          "largest_budget": top, "target_budgets": targets_c}
        out["nested"] = nested_test(data, fitted[1:], grid=grid, n_bootstrap=cfg.nested_bootstrap, seed=cfg.seed,
                                    level=1 - cfg.confidence)
        observed_best = [r for r in rows if r["kind"] == "observed"]
        out["backtest"] = backtest_decisions(runs, observed_best, cfg.reference, fitted[1:],
                                             n_bootstrap=cfg.fit_bootstrap, confidence=cfg.confidence,
                                             seed=cfg.seed, grid=grid, shared=cfg.shared)
    return out | {"rows": rows}


def downstream_differences(items: pl.DataFrame, runs: pl.DataFrame, reference: str, compared: Sequence[str], *,
                           n_bootstrap: int, confidence: float, seed: int) -> list[dict]:
    """Observed Delta of the downstream tasks' mean bits per byte of the gold answer between each
    series' and the reference's best evaluated run per budget, paired over items (target
    ``downstream_bpb``; lower is better). ``items``: ``variant, run, item, bpb``."""
    runs, budget_kind = with_budget(runs)
    evaluated = items.group_by("variant", "run").agg(pl.col("bpb").mean().alias("mean_bpb"))
    evaluated = evaluated.join(runs.select("variant", "run", "budget"), on=["variant", "run"], how="inner")
    rows = []
    for v in compared:
        for budget in sorted(evaluated["budget"].drop_nulls().unique().to_list()):
            pick = {}
            for s in (v, reference):
                cand = evaluated.filter((pl.col("variant") == s) & (pl.col("budget") == budget))
                if cand.height:
                    pick[s] = cand.sort("mean_bpb")["run"][0]
            if len(pick) < 2:
                continue
            a = items.filter((pl.col("variant") == v) & (pl.col("run") == pick[v])).select("item", "bpb")
            b = items.filter((pl.col("variant") == reference) & (pl.col("run") == pick[reference])).select("item", "bpb")
            joined = a.join(b, on="item", suffix="_ref").drop_nulls()
            if joined.height < 2:
                continue
            diff = (joined["bpb"] - joined["bpb_ref"]).to_numpy()
            w = document_weights(len(diff), n_bootstrap, seed)
            reps = (w @ diff) / len(diff)
            lo_q = (1 - confidence) / 2
            lo, hi = np.quantile(reps, [lo_q, 1 - lo_q])
            rows.append({"variant": v, "reference": reference, "target": "downstream_bpb", "kind": "observed",
                         "comparison": "best", "budget": budget, "budget_kind": budget_kind, "run": pick[v],
                         "reference_run": pick[reference], "delta": float(diff.mean()), "ci_low": float(lo),
                         "ci_high": float(hi), "p_value": normal_pvalue(float(diff.mean()), reps),
                         "sigma_doc": float(reps.std(ddof=1)), "sigma_seed": None, "n_docs": int(len(diff)),
                         "n_seeds": 1})
    return decide(rows, confidence)
