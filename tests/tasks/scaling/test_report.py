import json

import numpy as np
import polars as pl
import pytest

from tasks.scaling.config import FitConfig
from tasks.scaling.report import fit_points, read_points, write_fit_report

# 150 replicates: the smallest two-sided bootstrap p is 2/151, which survives Holm over 3 budgets
CFG = FitConfig(n_bootstrap=150, n_jobs=1, n_starts=8, bootstrap_start_spread=0.0, bootstrap_n_starts=2,
                backtest_bootstrap=10, compute_budgets=(1e18, 1e20, 1e22), exclude_top_loss=1)


def _points(ladder):
    frames = []
    for name, E in (("base", 1.8), ("dedup", 1.7)):
        N, D, L = ladder(E=E, noise=0.004, seed=int(E * 10), n_sizes=6, n_tokens=5)
        frames.append(pl.DataFrame({"N": N, "D": D, "loss": L, "variant": [name] * len(N)}))
    return pl.concat(frames)


def test_missing_column_is_named(tmp_path):
    with pytest.raises(ValueError, match="missing column 'loss'"):
        fit_points(pl.DataFrame({"N": [1e8], "D": [1e9]}), CFG)
    path = tmp_path / "runs.csv"
    pl.DataFrame({"N": [1e8], "loss": [3.0]}).write_csv(path)
    with pytest.raises(ValueError, match=rf"{path}: missing column 'D'"):
        read_points(path)


@pytest.mark.parametrize("col,value", [("N", -1.0), ("D", 0.0), ("loss", float("nan"))])
def test_bad_row_is_named(ladder, col, value):
    points = _points(ladder)
    bad = points.with_columns(pl.when(pl.int_range(pl.len()) == 7).then(value).otherwise(pl.col(col)).alias(col))
    with pytest.raises(ValueError, match=rf"row 7: {col}="):
        fit_points(bad, CFG)


def test_report_content_and_files(ladder, tmp_path):
    points = _points(ladder)
    report = fit_points(points, CFG)
    assert set(report["variants"]) == {"base", "dedup"}
    base = report["variants"]["base"]
    for p in ("E", "A", "B", "alpha", "beta"):
        v = base[p]
        assert v["ci_low"] <= v["value"] <= v["ci_high"], p
    assert base["n_points"] == 29
    (excl,) = base["excluded"]
    assert excl["row"] == int(points.filter(pl.col("variant") == "base")["loss"].arg_max())
    assert "exclude_top_loss=1" in excl["reason"]
    assert len(base["compute_optimal"]) == 3 and len(report["comparisons"]) == 1
    # the variant with lower E is better at every budget, Holm-adjusted; same ladder -> paired
    cmp = report["comparisons"][0]
    assert (cmp["x"], cmp["better_at_largest_C"]) == ("base", "dedup")
    assert cmp["pairing"] == "paired_by_key" and cmp["better"] == ["dedup"] * 3
    assert report["multiple_testing"]["n_tests"] == 3 and report["multiple_testing"]["n_pairs_tested"] == 1
    assert all(p_adj >= p for p, p_adj in zip(cmp["p_value"], cmp["p_holm"]))
    assert base["identified"] is True and base["identification_reasons"] == []
    bt = base["diagnostics"]["backtest"]
    assert bt["available"] and bt["median_rel_error"]["value"] < 0.03
    assert set(bt["held_out_rows"]) <= set(points.with_row_index().filter(pl.col("variant") == "base")["index"])
    assert [s["huber_delta"] for s in base["diagnostics"]["huber_delta_sensitivity"]] == [1e-4, 1e-3, 1e-2]
    assert base["compute"]["flops_per_token"] == {"k": 6.0, "gamma": 1.0, "source": base["compute"]["flops_per_token"]["source"]}

    paths = write_fit_report(report, points, tmp_path / "fit")
    names = {p.name for p in paths}
    assert {"fits.json", "compute_optimal.csv", "frontier.png", "loss_vs_compute_base.png",
            "loss_vs_compute_dedup.png", "compare_base__dedup.png"} <= names
    assert json.loads((tmp_path / "fit" / "fits.json").read_text())["variants"]["base"]["n_points"] == 29
    table = pl.read_csv(tmp_path / "fit" / "compute_optimal.csv")
    assert table.columns[:5] == ["variant", "C", "N_opt", "N_opt_ci_low", "N_opt_ci_high"]
    assert table.height == 6 and "loss_pred_ci_high" in table.columns
    assert table["inside_measured_range"].to_list() == [True] * 6
    assert all((tmp_path / "fit" / n).stat().st_size > 1000 for n in names if n.endswith(".png"))
    assert not list((tmp_path / "fit").glob(".*.tmp"))


def test_single_variant_defaults_to_all(ladder):
    N, D, L = ladder(n_sizes=5, n_tokens=4)
    report = fit_points(pl.DataFrame({"N": N, "D": D, "loss": L}),
                        FitConfig(n_bootstrap=0, n_starts=8, compute_budgets=(1e20,)))
    assert list(report["variants"]) == ["all"] and report["comparisons"] == []
    assert report["variants"]["all"]["alpha"]["ci_low"] is None


def test_pool_of_laws_matches_serial_and_groups_frontiers(ladder, tmp_path):
    import dataclasses

    points = _points(ladder).with_columns(
        pl.col("variant").replace({"dedup": "base+rtn_w4"}))  # a compressed series of `base`
    serial = fit_points(points, CFG)
    pooled = fit_points(points, dataclasses.replace(CFG, n_jobs=2))  # one process per law
    for name in ("base", "base+rtn_w4"):
        for p in ("E", "A", "B", "alpha", "beta"):
            assert pooled["variants"][name][p] == serial["variants"][name][p], (name, p)
    names = {p.name for p in write_fit_report(pooled, points, tmp_path)}
    # frontier.png: data variants only; frontier_base.png: base beside its compressed series
    assert {"frontier.png", "frontier_base.png"} <= names
