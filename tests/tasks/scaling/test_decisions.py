"""Paired differences over documents and seeds, decisions, the backtest and ranking agreement."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tasks.scaling.compute_optimal import FlopsPerToken
from tasks.scaling.config import DecisionConfig
from tasks.scaling.decisions import (
    backtest_decisions, decide, decision_report, doc_losses, document_weights, observed_differences,
    paired_difference, ranking_agreement, seed_sigma, seed_sigma_delta,
)
from tasks.scaling.joint import ExponentGrid


def doc_frame(per_doc: dict[tuple[str, str, int], np.ndarray], tokens: np.ndarray, sources=None) -> pl.DataFrame:
    n = len(tokens)
    sources = sources if sources is not None else ["news"] * n
    frames = [pl.DataFrame({"variant": [v] * n, "run": [r] * n, "seed": [s] * n, "doc": np.arange(n),
                            "source": sources, "tokens": tokens, "loss_sum": sums})
              for (v, r, s), sums in per_doc.items()]
    return pl.concat(frames)


def test_equal_documents_give_the_analytic_interval():
    # 400 documents of 50 tokens; per-token difference per document ~ N(-0.02, 0.1): the interval of
    # the mean is -0.02 +- 1.96 * sd / sqrt(n) (the bootstrap's percentile interval converges to it).
    rng = np.random.default_rng(0)
    n, t = 400, 50
    ref = rng.uniform(3, 5, n) * t
    diff = rng.normal(-0.02, 0.1, n) * t
    d = doc_losses(doc_frame({("x", "r", 0): ref + diff, ("raw", "r", 0): ref}, np.full(n, t)))
    out = paired_difference(d, [("x", "r", 0)], [("raw", "r", 0)], document_weights(n, 4000, 1),
                            sigma_seed=None, confidence=0.95)
    per_token = diff / t
    half = 1.96 * per_token.std(ddof=1) / np.sqrt(n)
    assert out["delta"] == pytest.approx(per_token.mean(), abs=1e-12)
    assert out["ci_low"] == pytest.approx(per_token.mean() - half, abs=0.12 * half)
    assert out["ci_high"] == pytest.approx(per_token.mean() + half, abs=0.12 * half)
    assert out["n_docs"] == n and out["n_seeds"] == 1


def test_unequal_documents_follow_the_ratio_estimator():
    # Delta = sum d_i / sum t_i; its delta-method variance is var(d_i - Delta t_i) / (n tbar^2).
    rng = np.random.default_rng(1)
    n = 500
    t = rng.integers(5, 200, n).astype(float)
    diff = rng.normal(0.03, 0.2, n) * t
    ref = 4.0 * t
    d = doc_losses(doc_frame({("x", "r", 0): ref + diff, ("raw", "r", 0): ref}, t))
    out = paired_difference(d, [("x", "r", 0)], [("raw", "r", 0)], document_weights(n, 4000, 2),
                            sigma_seed=None, confidence=0.95)
    delta = diff.sum() / t.sum()
    se = np.sqrt(np.var(diff - delta * t, ddof=1) / n) / t.mean()
    assert out["sigma_doc"] == pytest.approx(se, rel=0.1)
    assert out["ci_high"] - out["ci_low"] == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_seed_noise_widens_the_interval_by_its_variance():
    # A seed moves every series' loss by a shared amount (it cancels in Delta) plus its own
    # (it does not): sigma_seed is the spread of the one-seed paired Delta, and the interval of the
    # two-seed mean widens by sigma_seed^2 / 2.
    rng = np.random.default_rng(2)
    n, t = 300, 40
    base = rng.uniform(3, 5, n) * t
    per_doc = {}
    for s, shared, own in ((0, 0.0, 0.0), (1, 0.05, 0.02)):
        per_doc[("raw", "r", s)] = base + shared * t
        per_doc[("x", "r", s)] = base + (shared + own + 0.01) * t + rng.normal(0, 0.02, n) * t
    d = doc_losses(doc_frame(per_doc, np.full(n, t)))
    sigma, dof = seed_sigma_delta(d, "raw")
    assert dof == 1 and sigma == pytest.approx(0.02 / np.sqrt(2), abs=0.003)
    per_run, _ = seed_sigma(d)
    assert per_run > 2 * sigma  # the shared part of a seed's effect inflates the per-run spread
    w = document_weights(n, 3000, 0)
    keys = lambda v: [(v, "r", 0), (v, "r", 1)]  # noqa: E731
    without = paired_difference(d, keys("x"), keys("raw"), w, sigma_seed=None, confidence=0.95)
    with_seed = paired_difference(d, keys("x"), keys("raw"), w, sigma_seed=sigma, confidence=0.95)
    width = lambda r: r["ci_high"] - r["ci_low"]  # noqa: E731
    expected = 2 * 1.96 * np.sqrt(without["sigma_doc"] ** 2 + sigma ** 2 / 2)
    assert width(with_seed) == pytest.approx(expected, rel=0.1)
    assert with_seed["n_seeds"] == 2 and with_seed["sigma_seed"] == pytest.approx(sigma / np.sqrt(2))


def test_decide_holm_and_direction():
    # Holm: 0.03 * 2 = 0.06 and max(0.06, 0.04) are not decided at 0.05 although each alone would be.
    rows = [{"delta": -0.1, "p_value": 0.001}, {"delta": 0.2, "p_value": 0.03}, {"delta": -0.01, "p_value": 0.04}]
    out = decide(rows, 0.95)
    assert [r["decision"] for r in out] == ["better", "undecided", "undecided"]
    assert [r["p_holm"] for r in out] == pytest.approx([0.003, 0.06, 0.06])
    assert decide([{"delta": 0.2, "p_value": 0.001}], 0.95)[0]["decision"] == "worse"


def ladder_runs(variants=("raw", "x"), budgets=(1e9, 3e9, 1e10)):
    rows = []
    sizes = [1e4, 3e4, 1e5]
    for v in variants:
        for c in budgets:
            for n in sizes:
                rows.append({"variant": v, "run": f"n{int(n)}_c{c:g}", "N": n, "D": c / (6 * n), "C": c,
                             "compute_budget": c, "series": "trained"})
    return pl.DataFrame(rows)


def synthetic_docs(runs: pl.DataFrame, gaps: dict[str, float], n_docs=200, seeds=(0,), seed=0):
    """Doc losses from a known law per variant, with document difficulty shared by every model."""
    rng = np.random.default_rng(seed)
    t = rng.integers(20, 80, n_docs).astype(float)
    difficulty = rng.normal(0, 0.3, n_docs)
    sources = np.where(np.arange(n_docs) % 3 == 0, "tweets", "news")
    per_doc, losses = {}, []
    for r in runs.iter_rows(named=True):
        mean = 2.0 + 60 / r["N"] ** 0.4 + 300 / r["D"] ** 0.35 + gaps[r["variant"]]
        for s in seeds:
            noise = rng.normal(0, 0.01) if s else 0.0
            per_doc[(r["variant"], r["run"], s)] = (mean + noise + difficulty + rng.normal(0, 0.05, n_docs)) * t
        losses.append(mean)
    return doc_frame(per_doc, t, sources.tolist()), runs.with_columns(pl.Series("loss", losses))


def test_observed_rows_per_target_and_comparison():
    runs = ladder_runs()
    docs, runs = synthetic_docs(runs, {"raw": 0.0, "x": -0.05}, seeds=(0, 1))
    rows = observed_differences(docs, runs, "raw", ["x"], targets=("val", "val:tweets"), n_bootstrap=300)
    kinds = {(r["target"], r["comparison"]) for r in rows}
    assert kinds == {("val", "same_size"), ("val", "best"), ("val:tweets", "same_size"), ("val:tweets", "best")}
    best = [r for r in rows if r["comparison"] == "best" and r["target"] == "val"]
    assert len(best) == 3 and all(r["decision"] == "better" for r in best)
    assert all(r["n_seeds"] == 2 and r["sigma_seed"] is not None for r in rows)


def test_reference_or_series_without_documents_is_named():
    runs = ladder_runs()
    docs, runs = synthetic_docs(runs, {"raw": 0.0, "x": 0.0})
    with pytest.raises(ValueError, match="reference 'base' has no per-document"):
        observed_differences(docs, runs, "base", ["x"])


def test_report_errors_name_the_key():
    runs = ladder_runs()
    docs, runs = synthetic_docs(runs, {"raw": 0.0, "x": 0.0})
    with pytest.raises(ValueError, match="fit.decisions.reference: 'base' was not trained"):
        decision_report(runs, docs, DecisionConfig(reference="base"), flops=FlopsPerToken())
    with pytest.raises(ValueError, match="fit.decisions.compared: 'y' was not trained"):
        decision_report(runs, docs, DecisionConfig(compared=("y",)), flops=FlopsPerToken())
    with pytest.raises(ValueError, match="target_multiples"):
        DecisionConfig(target_multiples=(0.5,))


def test_report_end_to_end_on_a_synthetic_ladder():
    runs = ladder_runs(("raw", "x", "y"), budgets=(1e9, 3e9, 1e10, 3e10))
    docs, runs = synthetic_docs(runs, {"raw": 0.0, "x": -0.05, "y": 0.04})
    cfg = DecisionConfig(n_bootstrap=200, fit_bootstrap=40, nested_bootstrap=20, grid_steps=25)
    out = decision_report(runs, docs, cfg, flops=FlopsPerToken(), unique_tokens={"raw": 1e9, "x": 1e6, "y": 1e9})
    projected = [r for r in out["rows"] if r["kind"] == "projected"]
    assert {r["budget"] for r in projected} == {9e10, 3e11}
    assert {r["variant"]: r["decision"] for r in projected} == {"x": "better", "y": "worse"}
    assert all(r["repeats_data"] and "x: D*" in r["repeats_data"] for r in projected if r["variant"] == "x")
    assert set(out["nested"]) == {"x", "y"}
    bt = out["backtest"]
    assert bt["held_out_budget"] == 3e10 and bt["budget_kind"] == "flops" and {p["variant"] for p in bt["pairs"]} == {"x", "y"}
    assert bt["sign_agreement"] == 1.0
    agree = out["ranking_agreement"]["per_budget"]
    assert [a["accuracy"] for a in agree] == [1.0, 1.0, 1.0]


def test_backtest_coverage_on_known_noise():
    # Laws with a constant gap and Gaussian run noise: the held-out Delta's interval should cover
    # the observed gap in most repetitions (a broken interval, e.g. zero width, covers ~never).
    covered = []
    for rep in range(6):
        runs = ladder_runs(("raw", "x"), budgets=(1e9, 3e9, 1e10, 3e10))
        rng = np.random.default_rng(rep)
        loss = [2.0 + 60 / r["N"] ** 0.4 + 300 / r["D"] ** 0.35 + (-0.03 if r["variant"] == "x" else 0.0)
                + rng.normal(0, 0.004) for r in runs.iter_rows(named=True)]
        runs = runs.with_columns(pl.Series("loss", loss))
        top = runs.filter(pl.col("compute_budget") == 3e10)
        best = {v: top.filter(pl.col("variant") == v)["loss"].min() for v in ("raw", "x")}
        observed = [{"variant": "x", "comparison": "best", "target": "val", "budget": 3e10,
                     "delta": best["x"] - best["raw"], "ci_low": np.nan, "ci_high": np.nan}]
        bt = backtest_decisions(runs, observed, "raw", ["x"], n_bootstrap=60, confidence=0.95,
                                seed=rep, grid=ExponentGrid(steps=25), shared=("alpha", "beta"))
        covered.append(bt["pairs"][0]["covered"])
        assert bt["pairs"][0]["sign_right"]
    assert sum(covered) >= 4


def test_ranking_agreement_counts_pairs():
    out = ranking_agreement({1: {"a": 1.0, "b": 2.0, "c": 3.0}, 2: {"a": 0.5, "b": 0.4, "c": 0.9},
                             3: {"a": 0.1, "b": 0.2, "c": 0.3}})
    assert [r["accuracy"] for r in out["per_budget"]] == [1.0, pytest.approx(2 / 3)]
